"""The Qwen vision towers of transformers through the graph manager and the callback.

Tiny random towers: graphed outputs must equal each tower's own eager forward.
"""

import random

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from test_compile_regions import GraphCounter
from torch.utils.data import DataLoader

from examples.models.packed_vit import patchify
from lightning_cg.adapters import adapter_for
from lightning_cg.adapters.qwen import MIN_OFFSET_SLOTS, QwenVisionAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.compiled import CompiledEncoder
from lightning_cg.engine.encoder import CaptureSpec, GraphableEncoder
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager

transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")

PATCH, TEMPORAL, MERGE = 2, 2, 2
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH
KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
#: Small budgets: a batch of a few items splits into several padded sub-batches.
BUDGETS = BudgetConfig(min_budget=4, max_budget=16)


def tiny_tower(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    sizes = dict(depth=3, num_heads=4, patch_size=PATCH, temporal_patch_size=TEMPORAL)
    if kind == "qwen2_vl":
        config = transformers.Qwen2VLVisionConfig(embed_dim=32, hidden_size=24, **sizes)
        tower = qwen2_vl.Qwen2VisionTransformerPretrainedModel(config)
    elif kind == "qwen2_5_vl":
        # Windows of 2x2 merged tokens; block 1 attends over whole frames.
        config = transformers.Qwen2_5_VLVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=24,
            window_size=8,
            fullatt_block_indexes=[1],
            **sizes,
        )
        # Not exported at the top level by every transformers 5.x (5.17 lacks it).
        from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

        tower = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(config)
    else:
        config = transformers.Qwen3VLVisionConfig(
            hidden_size=32,
            # Wide enough that the blocks hold most weights (the deepstack mergers
            # are large): blocks are what a dynamic-shape compile compiles.
            intermediate_size=512,
            out_hidden_size=24,
            deepstack_visual_indexes=[0, 1],
            num_position_embeddings=16,
            **sizes,
        )
        tower = transformers.Qwen3VLVisionModel(config)
    return tower.to(device, dtype).eval()


def random_batch(seed: int, count: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Images of mixed sizes and videos (t > 1; item ``count // 2`` is one), as
    (hidden_states, grid_thw)."""
    rng = random.Random(seed)
    grid = [
        (rng.choice([1, 1, 1, 2, 3]), MERGE * rng.randint(1, 4), MERGE * rng.randint(1, 4))
        for _ in range(count)
    ]
    if count > 1:
        grid[count // 2] = (2, *grid[count // 2][1:])
    patches = sum(t * h * w for t, h, w in grid)
    generator = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(patches, PATCH_DIM, generator=generator)
    return hidden_states.to(device), torch.tensor(grid, dtype=torch.long, device=device).reshape(
        -1, 3
    )


def manager_for(tower, **kwargs) -> EncoderGraphManager:
    adapter = adapter_for(tower)
    options = dict(
        mode="full", budgets=BUDGETS, max_items_per_batch=4, capture="first_use", **kwargs
    )
    return EncoderGraphManager(adapter, **options)


def assert_outputs_equal(actual, expected, **tolerance) -> None:
    """Same type, same fields, every tensor close (lists and tuples entry by entry)."""
    assert type(actual) is type(expected)
    if isinstance(expected, tuple | list):
        assert len(actual) == len(expected)
        for actual_part, expected_part in zip(actual, expected, strict=True):
            assert_outputs_equal(actual_part, expected_part, **tolerance)
        return
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, **tolerance)
        return
    assert list(actual.keys()) == list(expected.keys())
    for key in expected.keys():
        assert_outputs_equal(actual[key], expected[key], **tolerance)


def graphed(manager: EncoderGraphManager, hidden_states, grid_thw, **options):
    inputs = manager.encoder.inputs_from_call((hidden_states,), {"grid_thw": grid_thw, **options})
    with torch.no_grad():
        return manager.execute(inputs)


def eager(tower, hidden_states, grid_thw, **options):
    with torch.no_grad():
        return tower(hidden_states, grid_thw=grid_thw, **options)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_mode_equals_the_towers_forward(kind, seed):
    tower = tiny_tower(kind)
    manager = manager_for(tower, max_frames_per_batch=6)
    hidden_states, grid_thw = random_batch(seed, count=6)
    expected = eager(tower, hidden_states, grid_thw)
    actual = graphed(manager, hidden_states, grid_thw)
    assert_outputs_equal(actual, expected, rtol=1e-5, atol=1e-6)
    stats = manager.stats
    assert stats.sub_batches > 1 and stats.hits > 0 and stats.padded_tokens > 0
    assert tower.config._attn_implementation == "sdpa"  # the user's, back after the graphs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compositions", [12, pytest.param(200, marks=pytest.mark.slow)])
def test_random_batch_compositions_equal_the_towers_forward(kind, compositions):
    """One manager over many batches: mixed sizes, videos, single items, empty batches."""
    tower = tiny_tower(kind)
    manager = manager_for(tower, max_frames_per_batch=6)
    rng = random.Random(kind)
    for composition in range(compositions):
        count = rng.choice([0, 1, 1, 2, 3, 5, 8])
        hidden_states, grid_thw = random_batch(1000 + composition, count)
        actual = graphed(manager, hidden_states, grid_thw)
        if count:
            assert_outputs_equal(
                actual, eager(tower, hidden_states, grid_thw), rtol=1e-5, atol=1e-6
            )
        else:
            assert actual.pooler_output.shape == (0, 24)
    assert manager.stats.hits > 0


def compiled_blocks_manager(tower) -> tuple[EncoderGraphManager, GraphCounter]:
    """A manager over ``tower``'s blocks compiled once (by a backend that counts
    its graphs), with small budgets, capturing at first use; ``manager.encoder``
    is that compiling wrapper (``compile=False``: the manager adds none of its own)."""
    backend = GraphCounter()
    encoder = CompiledEncoder(adapter_for(tower), backend=backend)
    manager = EncoderGraphManager(
        encoder,
        budgets=BUDGETS,
        max_items_per_batch=4,
        max_frames_per_batch=6,
        capture="first_use",
        compile=False,
    )
    return manager, backend


def patches_of(grid: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random patches of the items of ``grid``, as (hidden_states, grid_thw)."""
    generator = torch.Generator().manual_seed(0)
    patches = torch.randn(sum(t * h * w for t, h, w in grid), PATCH_DIM, generator=generator)
    return patches, torch.tensor(grid)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_blocks_equal_the_towers_forward_and_compile_once(kind):
    # The towers' blocks share one code object (transformers wraps every layer's
    # forward in one function), and dynamo keeps its compiles on it: those of the
    # other towers' tests would count towards its limit of compiles per code object.
    torch._dynamo.reset()
    tower = tiny_tower(kind)
    manager, backend = compiled_blocks_manager(tower)
    assert manager.encoder.compiled_blocks.blocks == list(tower.blocks)
    # Budget 8, whose 32 patch rows equal the hidden width, in a graph of one
    # frame, then budget 16 with two items (a video among them) and with one.
    for grid in ([(1, 4, 8)], [(2, 4, 4), (1, 2, 6)], [(1, 8, 8)]):
        hidden_states, grid_thw = patches_of(grid)
        actual = graphed(manager, hidden_states, grid_thw)
        assert_outputs_equal(actual, eager(tower, hidden_states, grid_thw), atol=1e-5, rtol=1e-5)
    assert manager.stats.hits == 3
    assert {key.descriptor.num_tokens for key in manager.cache.keys()} == {8, 16}
    # One block's forward compiled once serves every block (the first, whose input
    # is a view; Qwen2.5-VL's window and full-attention ones) and every budget.
    assert backend.graphs == 1
    assert not any("forward" in vars(block) for block in tower.blocks)


@pytest.mark.parametrize("kind", KINDS)
def test_calls_that_collect_attentions_capture_the_uncompiled_forward(kind):
    # transformers appends each block's attentions to a Python list whose length
    # dynamo guards: one compiled block would compile again for every block.
    torch._dynamo.reset()
    tower = tiny_tower(kind)
    manager, backend = compiled_blocks_manager(tower)
    calls = [([(1, 4, 8)], {}), ([(1, 4, 8)], {"output_attentions": True})]
    calls += [([(2, 4, 4), (1, 2, 6)], {"output_attentions": True}), ([(1, 8, 8)], {})]
    for grid, options in calls:
        hidden_states, grid_thw = patches_of(grid)
        actual = graphed(manager, hidden_states, grid_thw, **options)
        expected = eager(tower, hidden_states, grid_thw, **options)
        assert_outputs_equal(actual, expected, atol=1e-5, rtol=1e-5)
    assert manager.stats.hits == 4
    # Only the calls without attentions ran the compiled block: one compile.
    assert backend.graphs == 1


def test_a_config_that_collects_attentions_leaves_the_blocks_uncompiled():
    torch._dynamo.reset()
    tower = tiny_tower("qwen2_vl")
    tower.config._attn_implementation = "eager"  # sdpa refuses output_attentions
    tower.config.output_attentions = True  # asked for by the config, not the call
    manager, backend = compiled_blocks_manager(tower)
    hidden_states, grid_thw = patches_of([(1, 4, 8)])
    actual = graphed(manager, hidden_states, grid_thw)
    assert_outputs_equal(actual, eager(tower, hidden_states, grid_thw), atol=1e-5, rtol=1e-5)
    assert len(actual.attentions) == 3 and manager.stats.hits == 1
    assert backend.graphs == 0


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_a_graph_of_one_frame_has_an_empty_sequence_more(kind):
    # Two offsets would give one sequence length, a size of 1 that aot_autograd
    # (inductor) specializes: the first graph of more frames would compile the
    # blocks again. Counted with aot_eager, that test takes too long for CI.
    adapter = adapter_for(tiny_tower(kind))
    inputs = adapter.inputs_from_call(patches_of([(1, 4, 8)]), {})
    spec = CaptureSpec(
        "local", 8, max_items=1, max_frames=1, signature=adapter.graph_signature(inputs)
    )
    buffers = adapter.capture_inputs(spec)
    for name in ("cu_seqlens", "cu_window_seqlens"):
        if name in buffers:
            assert len(buffers[name]) >= MIN_OFFSET_SLOTS
    fill(adapter, buffers, inputs, padding=0.0)
    with torch.no_grad():
        expected = adapter.eager_forward("local", inputs)
        torch.testing.assert_close(adapter.graph_forward("local", buffers), expected)


@pytest.mark.parametrize("kind", KINDS)
def test_deepstack_and_hidden_states_options_and_tuples(kind):
    tower = tiny_tower(kind)
    manager = manager_for(tower)
    hidden_states, grid_thw = random_batch(3, count=5)
    for options in (
        {"output_hidden_states": True, "output_attentions": True},
        {"return_dict": False},
        {},
    ):
        expected = eager(tower, hidden_states, grid_thw, **options)
        actual = graphed(manager, hidden_states, grid_thw, **options)
        assert_outputs_equal(actual, expected, rtol=1e-5, atol=1e-6)
    if kind == "qwen3_vl":
        assert len(actual.deepstack_features) == 2
    assert len(expected.keys()) == (3 if kind == "qwen3_vl" else 2)


def fill(adapter: QwenVisionAdapter, buffers: dict, inputs, padding: float) -> None:
    """The manager's copy before a replay, with the patches' padding rows set to ``padding``."""
    rules = adapter.graph_config().padding_rules
    for name, rows in adapter.replay_inputs("local", inputs).items():
        buffer, count = buffers[name], rows.shape[0]
        buffer[:count].copy_(rows)
        if rules.get(name) == "repeat_last":
            buffer[count:] = rows[-1]
        elif name.startswith("hidden_states"):
            buffer[count:] = padding
        else:
            buffer[count:] = 0


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_do_not_change_the_real_rows(kind):
    """One set of buffers far larger than the batch; whatever the padding patches
    hold, the real rows equal the eager forward's."""
    adapter = QwenVisionAdapter(tiny_tower(kind), max_frames_per_item=3)
    inputs = adapter.inputs_from_call(random_batch(4, count=3), {})
    tokens = sum(spec.output_tokens for spec in adapter.item_specs(inputs))
    frames = sum(spec.num_frames for spec in adapter.item_specs(inputs))
    signature = adapter.graph_signature(inputs)
    spec = CaptureSpec(
        "local", tokens + 24, max_items=8, max_frames=frames + 5, signature=signature
    )
    buffers = adapter.capture_inputs(spec)
    assert buffers["cu_seqlens"].shape == (frames + 6,)
    with torch.no_grad():
        expected = adapter.eager_forward("local", inputs)
        for padding in (0.0, 1e3):
            fill(adapter, buffers, inputs, padding)
            rows = adapter.graph_forward("local", buffers)
            assert rows.shape == (tokens + 24, expected.shape[1])
            torch.testing.assert_close(rows[:tokens], expected, rtol=1e-5, atol=1e-6)


#: Two images of 7 tokens in a graph of 8 tokens and two frame slots: the second
#: image fills the last offset slot and padding patches follow it.
FULL_SLOTS_GRID = [(1, 4, 4), (1, 2, 6)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_last_frame_of_full_offset_slots_keeps_clear_of_the_padding(kind, monkeypatch):
    """The packed attention's mask must not search a view of ``cu_seqlens``:
    inductor's Triton ``searchsorted`` (torch before pytorch/pytorch#184043, 2.11
    among them) drops a view's storage offset, so ``cu_seqlens[1:]`` was searched as
    ``cu_seqlens[:-1]`` and compiled blocks let the last frame attend the padding
    rows (relative errors 0.01-0.14 on the H200). That lowering runs on the GPU
    only; here ``torch.searchsorted`` drops the offset the same way."""
    search = torch.searchsorted

    def search_from_the_storage_start(sorted_sequence, values, **options):
        start = sorted_sequence.as_strided(sorted_sequence.shape, sorted_sequence.stride(), 0)
        return search(start, values, **options)

    adapter = adapter_for(tiny_tower(kind))
    inputs = adapter.inputs_from_call(patches_of(FULL_SLOTS_GRID), {})
    spec = CaptureSpec(
        "local", 8, max_items=2, max_frames=2, signature=adapter.graph_signature(inputs)
    )
    buffers = adapter.capture_inputs(spec)
    fill(adapter, buffers, inputs, padding=1.0)
    assert buffers["cu_seqlens"].tolist() == [0, 16, 28]  # every slot real, 4 padding rows
    with torch.no_grad():
        expected = adapter.eager_forward("local", inputs)
        monkeypatch.setattr(torch, "searchsorted", search_from_the_storage_start)
        rows = adapter.graph_forward("local", buffers)
    torch.testing.assert_close(rows[:7], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_inductor_compiled_blocks_equal_the_towers_forward_with_padding(kind):
    """The case above with inductor itself: a second budget of two images whose
    second fills the last offset slot, padding rows after it."""
    torch._dynamo.reset()
    tower = tiny_tower(kind, device="cuda")
    encoder = CompiledEncoder(adapter_for(tower), backend="inductor")
    manager = EncoderGraphManager(
        encoder, budgets=BUDGETS, max_items_per_batch=4, max_frames_per_batch=6, capture="first_use"
    )
    # Budget 8 (one frame, no padding rows), then budget 16: 10 tokens of two images.
    for grid in ([(1, 4, 8)], [(1, 4, 6), (1, 4, 4)], FULL_SLOTS_GRID):
        hidden_states, grid_thw = (tensor.cuda() for tensor in patches_of(grid))
        actual = graphed(manager, hidden_states, grid_thw)
        expected = eager(tower, hidden_states, grid_thw)
        assert_outputs_equal(actual, expected, atol=1e-4, rtol=1e-4)


def test_the_qwen3_vl_moe_tower_is_served_as_qwen3_vl():
    torch.manual_seed(0)
    config = transformers.Qwen3VLMoeVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=24,
        num_heads=4,
        patch_size=PATCH,
        deepstack_visual_indexes=[0],
        num_position_embeddings=16,
    )
    tower = transformers.Qwen3VLMoeVisionModel(config).eval()
    manager = manager_for(tower)
    assert manager.encoder.kind == "qwen3_vl"
    hidden_states, grid_thw = random_batch(11, count=5)
    expected = eager(tower, hidden_states, grid_thw)
    assert_outputs_equal(graphed(manager, hidden_states, grid_thw), expected, rtol=1e-5, atol=1e-6)


def test_items_come_back_in_order_when_packing_reorders_them():
    tower = tiny_tower("qwen2_5_vl")
    manager = manager_for(tower)
    hidden_states, grid_thw = random_batch(5, count=7)
    expected = eager(tower, hidden_states, grid_thw)
    assert_outputs_equal(graphed(manager, hidden_states, grid_thw), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_first_call_served_eagerly_runs_the_tower_once(kind):
    # The output layout comes from that call's own output, not from a forward more.
    tower = tiny_tower(kind)
    adapter = adapter_for(tower)
    manager = EncoderGraphManager(adapter, mode="full", budgets=BUDGETS)  # default capture
    forwards = []
    tower.blocks[0].register_forward_hook(lambda *_: forwards.append(1))
    hidden_states, grid_thw = random_batch(4, count=3)
    actual = graphed(manager, hidden_states, grid_thw, output_hidden_states=True)
    assert len(forwards) == 1 and manager.stats.hits == 0
    expected = eager(tower, hidden_states, grid_thw, output_hidden_states=True)
    assert_outputs_equal(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_batch_gives_empty_fields(kind):
    tower = tiny_tower(kind)
    manager = manager_for(tower)
    output = graphed(manager, torch.zeros(0, PATCH_DIM), torch.zeros(0, 3, dtype=torch.long))
    reference = eager(tower, *random_batch(6, count=1))
    assert type(output) is type(reference)
    for key in reference.keys():
        value, width = output[key], reference[key]
        for part, reference_part in zip(
            value if isinstance(value, list) else [value],
            width if isinstance(width, list) else [width],
            strict=True,
        ):
            assert part.shape == (0, reference_part.shape[1])


def test_patchify_cuts_images_as_the_qwen_processor_does():
    """The project's data (patchify with a temporal patch) feeds these towers as
    transformers' own Qwen2-VL image processor would."""
    processor = transformers.Qwen2VLImageProcessor(
        do_resize=False,
        do_rescale=False,
        do_normalize=False,
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
    )
    images = [torch.rand(3, 8, 12), torch.rand(3, 4, 4)]
    expected = processor(images=images, return_tensors="pt")
    patches, grid_thw = patchify(images, PATCH, MERGE, TEMPORAL)
    assert grid_thw.tolist() == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(patches, expected["pixel_values"])


def test_adapter_is_chosen_by_type_and_for_the_packed_name():
    for kind in KINDS:
        tower = tiny_tower(kind)
        adapter = adapter_for(tower)
        assert isinstance(adapter, QwenVisionAdapter) and isinstance(adapter, GraphableEncoder)
        assert adapter.kind == kind
        assert isinstance(adapter_for(tower, "packed"), QwenVisionAdapter)
    config = adapter_for(tiny_tower("qwen2_vl")).graph_config()
    assert config.paths["local"].per_item_metadata
    assert config.padding_rules["cu_seqlens"] == "repeat_last"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cu_seqlens": torch.tensor([0, 16])}, "cu_seqlens is computed from grid_thw"),
        ({"output_hidden_states": [0, 1]}, "output_hidden_states=.* is not a plain value"),
    ],
)
def test_options_the_graphs_cannot_take_name_themselves(options, message):
    adapter = QwenVisionAdapter(tiny_tower("qwen2_vl"))
    hidden_states, grid_thw = random_batch(7, count=1)
    with pytest.raises(ValueError, match=message):
        adapter.inputs_from_call((hidden_states, grid_thw), options)


def test_bad_patches_name_the_argument():
    adapter = QwenVisionAdapter(tiny_tower("qwen2_vl"))
    grid_thw = torch.tensor([[1, 2, 2]])
    with pytest.raises(ValueError, match=rf"hidden_states must have shape \[4, {PATCH_DIM}\]"):
        adapter.inputs_from_call((torch.zeros(4, PATCH_DIM + 1), grid_thw), {})
    with pytest.raises(ValueError, match="QwenVisionAdapter serves the transformers towers"):
        QwenVisionAdapter(torch.nn.Linear(2, 2))


def test_a_batch_on_another_device_than_the_tower_is_refused_after_it_moves():
    tower = tiny_tower("qwen2_vl")
    adapter = QwenVisionAdapter(tower)
    hidden_states, grid_thw = random_batch(8, count=2)
    adapter.inputs_from_call((hidden_states,), {"grid_thw": grid_thw})
    tower.to("meta")
    with pytest.raises(ValueError, match="hidden_states is on cpu, the tower on meta"):
        adapter.inputs_from_call((hidden_states,), {"grid_thw": grid_thw})


IMAGE_TOKEN, VISION_START = 150, 152


def tiny_qwen2_vl_model():
    """A Qwen2-VL model (vision tower and a 2-layer language model), random weights."""
    torch.manual_seed(0)
    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=200,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
    )
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=PATCH)
    config = transformers.Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE_TOKEN,
        video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=VISION_START,
    )
    return transformers.Qwen2VLForConditionalGeneration(config).eval()


def prompt(grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """A prompt with each item's image tokens, as the Qwen2-VL processor lays them out."""
    ids = []
    for tokens in (grid_thw.prod(-1) // MERGE**2).tolist():
        ids += [VISION_START] + [IMAGE_TOKEN] * tokens + [5, 6]
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "mm_token_type_ids": (input_ids == IMAGE_TOKEN).long()}


class ChatModel(LightningModule):
    """Holds a Qwen2-VL model, which calls its tower itself."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def predict_step(self, batch, batch_idx):
        return self.model(**batch).logits


def test_predict_through_the_callback_as_the_qwen2_vl_model_calls_its_tower():
    model = tiny_qwen2_vl_model()
    batches = []
    for seed in range(3):
        hidden_states, grid_thw = random_batch(seed, count=4)
        grid_thw[:, 0] = 1  # images: the prompt holds image tokens only
        hidden_states = hidden_states[: int(grid_thw.prod(-1).sum())]
        batches.append(
            {"pixel_values": hidden_states, "image_grid_thw": grid_thw, **prompt(grid_thw)}
        )
    callback = CUDAGraphCallback(
        module="model.model.visual",
        budgets={"min_budget": 4, "max_budget": 16},
        max_items_per_batch=2,
        capture="first_use",
    )
    trainer = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    outputs = trainer.predict(ChatModel(model), DataLoader(batches, batch_size=None))
    assert callback.last_stats["hits"] > 0 and callback.last_stats["sub_batches"] > 3
    assert "forward" not in model.model.visual.__dict__
    for logits, batch in zip(outputs, batches, strict=True):
        with torch.no_grad():
            expected = model(**batch).logits
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_graphs_match_the_towers_sdpa_forward(kind):
    """Mixed-size images and a video, replayed from CUDA graphs, against transformers'
    own eager forward with its sdpa attention."""
    tower = tiny_tower(kind, device="cuda", dtype=torch.bfloat16)
    assert tower.config._attn_implementation == "sdpa"
    manager = manager_for(tower, max_frames_per_batch=8)
    for seed in (8, 9, 10):
        hidden_states, grid_thw = random_batch(seed, count=6, device="cuda")
        hidden_states = hidden_states.bfloat16()
        expected = eager(tower, hidden_states, grid_thw)
        actual = graphed(manager, hidden_states, grid_thw)
        assert type(actual) is type(expected)
        for key in expected.keys():
            values = expected[key] if isinstance(expected[key], list) else [expected[key]]
            actual_values = actual[key] if isinstance(actual[key], list) else [actual[key]]
            for value, actual_value in zip(values, actual_values, strict=True):
                assert actual_value.dtype == value.dtype and actual_value.shape == value.shape
                assert relative_error(actual_value, value) < 2e-2, key
    assert manager.stats.graphs > 0 and manager.stats.hits > 0
