import random

import pytest
import torch
from packed_calls import packed_tower

from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from lightning_cg.adapters import adapter_for, packed
from lightning_cg.adapters.packed import (
    GLOBAL_PATH,
    LOCAL_PATH,
    PackedEncoderAdapter,
)
from lightning_cg.engine.encoder import CaptureSpec, GraphableEncoder, ItemSpec

PATCH = 4
SIDES = (8, 16, 24, 32)  # multiples of patch * merge


def random_items(seed: int, count: int, max_frames: int = 3) -> list[torch.Tensor]:
    """Images [3, H, W] and videos [T, 3, H, W] of random sizes, reproducible by seed."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    items = []
    for _ in range(count):
        frames = rng.choice([1, 1, rng.randint(2, max_frames)])
        shape = (3, rng.choice(SIDES), rng.choice(SIDES))
        item = torch.randn((frames, *shape), generator=generator)
        items.append(item[0] if frames == 1 else item)
    return items


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def fill(adapter: PackedEncoderAdapter, buffers: dict, path: str, inputs) -> None:
    """What the manager does before a replay: real rows as prefixes, the rest padded by rule."""
    rules = adapter.graph_config().padding_rules
    for name, rows in adapter.replay_inputs(path, inputs).items():
        buffer, count = buffers[name], rows.shape[0]
        buffer[:count].copy_(rows)
        if rules.get(name, "zero") == "repeat_last":
            buffer[count:] = rows[-1]
        else:
            buffer[count:].zero_()


def path_tokens(adapter: PackedEncoderAdapter, inputs, path: str) -> list[int]:
    return [spec.path_tokens[path] for spec in adapter.item_specs(inputs)]


def capture_spec(adapter, inputs, path: str, token_budget: int, max_frames: int) -> CaptureSpec:
    signature = adapter.graph_signature(inputs)
    return CaptureSpec(path, token_budget, max_items=16, max_frames=max_frames, signature=signature)


@pytest.mark.parametrize("global_view", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_padded_replay_matches_eager_and_tower_forward(seed, global_view):
    """The manager by hand: sub-batches in shuffled order share one set of static
    buffers per path, larger than any of them needs."""
    tower = packed_tower(global_view=global_view)
    adapter = PackedEncoderAdapter(tower, max_frames_per_item=3)
    patches, grid_thw = patchify(random_items(seed, count=7), PATCH)
    inputs = adapter.inputs_from_call((patches, grid_thw), {})
    order = list(range(7))
    random.Random(seed).shuffle(order)
    outputs: list[dict[str, torch.Tensor]] = [{} for _ in order]
    buffers = {}
    with torch.no_grad():
        for indices in (order[:4], order[4:]):
            sub = adapter.select_items(inputs, indices)
            for path in (LOCAL_PATH, GLOBAL_PATH):
                tokens = path_tokens(adapter, sub, path)
                if not sum(tokens):
                    continue
                if path not in buffers:
                    budget = sum(path_tokens(adapter, inputs, path)) + 3  # fits every sub-batch
                    spec = capture_spec(adapter, inputs, path, budget, max_frames=24)
                    buffers[path] = adapter.capture_inputs(spec)
                fill(adapter, buffers[path], path, sub)
                replayed = adapter.graph_forward(path, buffers[path])[: sum(tokens)]
                assert relative_error(replayed, adapter.eager_forward(path, sub)) < 1e-5
                for index, rows in zip(indices, replayed.split(tokens), strict=True):
                    outputs[index][path] = rows
        assert (GLOBAL_PATH in buffers) == global_view
        expected = tower(patches, grid_thw)
    assert relative_error(adapter.postprocess(outputs, inputs), expected) < 1e-5


def test_capture_inputs_are_a_valid_batch():
    adapter = PackedEncoderAdapter(packed_tower())
    inputs = adapter.inputs_from_call(patchify([torch.randn(3, 8, 8)], PATCH), {})
    spec = capture_spec(adapter, inputs, LOCAL_PATH, token_budget=12, max_frames=5)
    buffers = adapter.capture_inputs(spec)
    assert buffers["pixel_patches"].shape == (48, 3 * PATCH * PATCH)
    assert buffers["cu_seqlens"].dtype == torch.int32
    assert buffers["cu_seqlens"].tolist() == [0, 48, 48, 48, 48, 48]
    assert buffers["positions"].shape == (48, 2)
    assert buffers["positions"].dtype == torch.int32
    with torch.no_grad():
        out = adapter.graph_forward(LOCAL_PATH, buffers)
    assert out.shape == (12, 32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("global_view", [False, True])
def test_graph_config_and_item_specs(global_view):
    adapter = PackedEncoderAdapter(packed_tower(global_view=global_view), max_frames_per_item=4)
    assert isinstance(adapter, GraphableEncoder)
    config = adapter.graph_config()
    assert list(config.paths) == [LOCAL_PATH, GLOBAL_PATH]
    assert config.paths[LOCAL_PATH].min_token_budget == 64
    assert config.paths[GLOBAL_PATH].min_token_budget == 4
    assert config.paths[LOCAL_PATH].per_item_metadata
    assert not config.paths[GLOBAL_PATH].per_item_metadata
    assert config.padding_rules == {"cu_seqlens": "repeat_last"}
    assert config.max_frames_per_item == 4
    assert adapter.token_budget_range(LOCAL_PATH) == (64, 4096)
    assert adapter.token_budget_range(GLOBAL_PATH) == (4, 4096)
    inputs = adapter.inputs_from_call(
        patchify([torch.randn(3, 16, 24), torch.randn(2, 3, 8, 8)], PATCH), {}
    )
    specs = adapter.item_specs(inputs)
    extra = 4 if global_view else 0
    assert [s.input_size for s in specs] == [24, 8]
    assert [s.num_frames for s in specs] == [1, 2]
    assert [s.path_tokens for s in specs] == [
        {LOCAL_PATH: 6, GLOBAL_PATH: extra},
        {LOCAL_PATH: 2, GLOBAL_PATH: extra},
    ]
    assert [s.output_tokens for s in specs] == [6 + extra, 2 + extra]


def test_item_specs_of_sizes_seen_before_and_past_the_kept_maximum(monkeypatch):
    monkeypatch.setattr(packed, "MAX_KEPT_ITEM_SPECS", 2)
    adapter = PackedEncoderAdapter(packed_tower(global_view=True), max_frames_per_item=3)
    grids = [[(1, 4, 6), (2, 2, 2)], [(2, 2, 2), (1, 4, 6), (3, 2, 4)], [(1, 4, 6), (1, 8, 2)]]
    for grid in grids * 2:
        inputs = adapter.inputs_from_call(
            (torch.zeros(sum(t * h * w for t, h, w in grid), 48), torch.tensor(grid)), {}
        )
        assert adapter.item_specs(inputs) == [
            ItemSpec(t * h * w, t * h * w // 4 + 4, {LOCAL_PATH: t * h * w // 4, GLOBAL_PATH: 4}, t)
            for t, h, w in grid
        ]
        assert len(adapter._specs_by_size) <= 2


def test_select_items_keeps_the_requested_order():
    adapter = PackedEncoderAdapter(packed_tower())
    items = [torch.randn(3, 8, 8), torch.randn(2, 3, 8, 16), torch.randn(3, 16, 8)]
    inputs = adapter.inputs_from_call(patchify(items, PATCH), {})
    sub = adapter.select_items(inputs, [2, 0])
    expected_patches, expected_grid = patchify([items[2], items[0]], PATCH)
    torch.testing.assert_close(sub.pixel_patches, expected_patches)
    assert sub.grid_thw.tolist() == expected_grid.tolist() == [list(g) for g in sub.grid]
    empty = adapter.select_items(inputs, [])
    assert empty.pixel_patches.shape == (0, 48) and empty.grid_thw.shape == (0, 3)


def test_select_items_of_consecutive_items_are_views():
    adapter = PackedEncoderAdapter(packed_tower())
    items = [torch.randn(3, 8, 8), torch.randn(2, 3, 8, 16), torch.randn(3, 16, 8)]
    inputs = adapter.inputs_from_call(patchify(items, PATCH), {})
    sub = adapter.select_items(inputs, [1, 2])
    expected_patches, expected_grid = patchify(items[1:], PATCH)
    torch.testing.assert_close(sub.pixel_patches, expected_patches)
    assert sub.grid_thw.tolist() == expected_grid.tolist() == [list(g) for g in sub.grid]
    assert sub.pixel_patches.untyped_storage().data_ptr() == (
        inputs.pixel_patches.untyped_storage().data_ptr()
    )


def test_adapter_never_calls_tower_forward():
    tower = packed_tower(global_view=True)
    adapter = PackedEncoderAdapter(tower)
    inputs = adapter.inputs_from_call(patchify(random_items(3, count=3), PATCH), {})

    def swapped(*args, **kwargs):
        raise AssertionError("the adapter called tower.forward")

    tower.forward = swapped
    with torch.no_grad():
        for path in (LOCAL_PATH, GLOBAL_PATH):
            adapter.eager_forward(path, inputs)
            spec = capture_spec(adapter, inputs, path, token_budget=128, max_frames=12)
            buffers = adapter.capture_inputs(spec)
            fill(adapter, buffers, path, inputs)
            adapter.graph_forward(path, buffers)


def test_postprocess_of_an_empty_batch():
    adapter = PackedEncoderAdapter(packed_tower(global_view=True).double())
    inputs = adapter.inputs_from_call((torch.zeros(0, 48), torch.zeros(0, 3, dtype=torch.long)), {})
    out = adapter.postprocess([], inputs)
    assert out.shape == (0, 32) and out.dtype == torch.float64


@pytest.mark.parametrize(
    "call",
    [
        lambda patches, grid_thw: ((patches, grid_thw), {}),  # the fast path
        lambda patches, grid_thw: ((), {"grid_thw": grid_thw, "pixel_patches": patches}),
        lambda patches, grid_thw: ((patches,), {"grid_thw": grid_thw}),
    ],
)
def test_positional_and_keyword_calls_read_the_same_inputs(call):
    adapter = PackedEncoderAdapter(packed_tower())
    patches, grid_thw = patchify([torch.randn(3, 8, 8), torch.randn(3, 16, 8)], PATCH)
    inputs = adapter.inputs_from_call(*call(patches, grid_thw))
    assert inputs.pixel_patches is patches and inputs.grid_thw is grid_thw
    assert inputs.grid == [(1, 2, 2), (1, 4, 2)]


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.zeros(4, 48),), {}, "grid_thw"),
        ((torch.zeros(4, 48), torch.tensor([[1, 2, 2]]), None), {}, "too many positional"),
        ((torch.zeros(4, 48), torch.tensor([[1, 2, 2]])), {"grid_thw": None}, "grid_thw"),
        ((torch.zeros(4, 48), torch.tensor([[1, 2, 2]])), {"scale": 2}, "scale"),
    ],
)
def test_a_call_that_does_not_bind_names_the_argument(args, kwargs, message):
    adapter = PackedEncoderAdapter(packed_tower())
    with pytest.raises(TypeError, match=message):
        adapter.inputs_from_call(args, kwargs)


def test_the_device_check_follows_the_tower_after_the_adapter_is_made():
    tower = packed_tower()
    adapter = PackedEncoderAdapter(tower)
    call = patchify([torch.randn(3, 8, 8)], PATCH)
    adapter.inputs_from_call(call, {})
    tower.to("meta")
    with pytest.raises(ValueError, match="pixel_patches is on cpu, the tower on meta"):
        adapter.inputs_from_call(call, {})
    tower.to_empty(device="cpu")
    adapter.inputs_from_call(call, {})
    # A new first parameter, not moved in place: read from the tower as it is now.
    tower.patch_embed.weight = torch.nn.Parameter(tower.patch_embed.weight.to("meta"))
    with pytest.raises(ValueError, match="the tower on meta"):
        adapter.inputs_from_call(call, {})


@pytest.mark.parametrize(
    ("patches", "grid_thw", "message"),
    [
        (torch.zeros(4, 48), torch.tensor([[1, 2, 2, 1]]), r"grid_thw must have shape \[N, 3\]"),
        (torch.zeros(4, 48), torch.tensor([[1.0, 2, 2]]), "grid_thw must be an integer tensor"),
        (torch.zeros(6, 48), torch.tensor([[1, 2, 3]]), r"grid_thw\[0\] is \[1, 2, 3\]"),
        (torch.zeros(4, 47), torch.tensor([[1, 2, 2]]), r"pixel_patches must have shape \[4, 48\]"),
        (torch.zeros(8, 48), torch.tensor([[1, 2, 2]]), "grid_thw disagrees with pixel_patches"),
        (torch.zeros(4, 48, 1), torch.tensor([[1, 2, 2]]), "pixel_patches must have shape"),
        (torch.zeros(4, 48, dtype=torch.long), torch.tensor([[1, 2, 2]]), "floating-point"),
    ],
)
def test_bad_inputs_name_the_argument(patches, grid_thw, message):
    adapter = PackedEncoderAdapter(packed_tower())
    with pytest.raises(ValueError, match=message):
        adapter.inputs_from_call((patches, grid_thw), {})


def test_unknown_path():
    adapter = PackedEncoderAdapter(packed_tower())
    with pytest.raises(ValueError, match="unknown encoder path 'thumbnail'"):
        adapter.token_budget_range("thumbnail")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_frames_per_item": 0}, "max_frames_per_item"),
        ({"min_token_budget": 0}, "min_token_budget"),
        ({"min_token_budget": 128, "max_token_budget": 64}, "max_token_budget"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PackedEncoderAdapter(packed_tower(), **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cuda_graph_replay_matches_eager(dtype, tolerance):
    """Capture each path once, then replay two different batches through it."""
    tower = packed_tower(global_view=True, device="cuda").to(dtype)
    adapter = PackedEncoderAdapter(tower, max_frames_per_item=3)
    batches = []
    for seed in (4, 5):
        patches, grid_thw = patchify(random_items(seed, count=5), PATCH)
        call = (patches.to("cuda", dtype), grid_thw.cuda())
        batches.append(adapter.inputs_from_call(call, {}))
    with torch.no_grad():
        for path in (LOCAL_PATH, GLOBAL_PATH):
            spec = capture_spec(adapter, batches[0], path, token_budget=512, max_frames=16)
            buffers = adapter.capture_inputs(spec)
            fill(adapter, buffers, path, batches[0])
            torch.cuda.synchronize()
            for _ in range(2):  # warm-up outside the graph
                adapter.graph_forward(path, buffers)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = adapter.graph_forward(path, buffers)
            for inputs in batches:
                fill(adapter, buffers, path, inputs)
                graph.replay()
                tokens = sum(path_tokens(adapter, inputs, path))
                expected = adapter.eager_forward(path, inputs)
                assert torch.isfinite(output).all()
                assert relative_error(output[:tokens], expected) < tolerance


@pytest.mark.parametrize("name", ["hf", "batched"])
def test_a_batch_row_adapter_named_for_a_packed_tower_says_which_fits(name):
    config = PackedViTConfig(hidden_size=32, depth=1, num_heads=2, patch_size=4, out_hidden_size=16)
    tower = PackedViT(config)
    with pytest.raises(TypeError, match=f"adapter='{name}' serves towers whose items are"):
        adapter_for(tower, name)
    assert isinstance(adapter_for(tower, "packed"), PackedEncoderAdapter)
