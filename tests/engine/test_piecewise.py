import random

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from test_app import CONF
from test_callback import predictions
from torchvision.models import VisionTransformer
from toy_encoder import ToyEncoder, ToyTower

from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from lightning_cg.adapters.batched import IMAGE_PATH, BatchedEncoderAdapter
from lightning_cg.adapters.packed import LOCAL_PATH, PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.engine.encoder import CaptureSpec
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.piecewise import (
    PiecewiseUnsupported,
    check_splitting_ops,
    split_graph_forward,
)
from lightning_cg.engine.piecewise_graph import PiecewiseGraph
from lightning_cg.engine.replay import relative_error

PATCH = 4
SIDES = (8, 16, 24)  # multiples of patch * merge


def packed_tower(depth: int = 2, global_view: bool = False, device: str = "cpu") -> PackedViT:
    """A packed_vit_small-shaped tower, shrunk."""
    torch.manual_seed(0)
    config = PackedViTConfig(
        hidden_size=64,
        depth=depth,
        num_heads=4,
        patch_size=PATCH,
        out_hidden_size=32,
        global_view=global_view,
        global_grid=4,
    )
    return PackedViT(config).to(device).eval()


def tiny_vit(device: str = "cpu") -> VisionTransformer:
    torch.manual_seed(0)
    vit = VisionTransformer(
        image_size=32, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128
    )
    # torchvision zeroes the head: every output would be 0, whatever the graph did.
    torch.nn.init.normal_(vit.heads.head.weight)
    return vit.to(device).eval()


def random_items(rng: random.Random, count: int, max_frames: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    items = []
    for _ in range(count):
        frames = rng.randint(1, max_frames)
        item = torch.randn(frames, 3, rng.choice(SIDES), rng.choice(SIDES), generator=generator)
        items.append(item[0] if frames == 1 else item)
    return items


def packed_call(rng: random.Random, count: int, dtype=torch.float32, device="cpu", **kwargs):
    count = max(count, 1)  # patchify needs an item
    patches, grid_thw = patchify(random_items(rng, count, **kwargs), PATCH)
    return patches.to(device, dtype), grid_thw.to(device)


def toy_call(rng: random.Random, count: int, dtype=torch.float32, device="cpu"):
    # Mostly small items, sometimes one larger than every budget (eager).
    lengths = [rng.choice([1, 2, 3, 7, 8, 15, 16, 30, 70]) for _ in range(count)]
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    tokens = torch.randn(sum(lengths), 8, generator=generator).to(device, dtype)
    return tokens, torch.tensor(lengths)


def random_count(rng: random.Random) -> int:
    return rng.choice([0, 1, 1, 2, 3, 5, 8, 13])


def buffers_for(encoder, path: str, token_budget: int, signature) -> dict[str, torch.Tensor]:
    spec = CaptureSpec(path, token_budget, max_items=8, max_frames=8, signature=signature)
    return encoder.capture_inputs(spec)


def split_of(encoder, path: str, buffers, **kwargs):
    return split_graph_forward(lambda b: encoder.graph_forward(path, b), buffers, **kwargs)


def packed_buffers(adapter: PackedEncoderAdapter, rng: random.Random, count: int = 3):
    """Static buffers of one budget filled with a real batch, the way the manager fills them."""
    inputs = adapter.inputs_from_call(packed_call(rng, count), {})
    buffers = buffers_for(adapter, LOCAL_PATH, 64, adapter.graph_signature(inputs))
    for name, rows in adapter.replay_inputs(LOCAL_PATH, inputs).items():
        buffers[name][: rows.shape[0]] = rows
        buffers[name][rows.shape[0] :] = rows[-1] if name == "cu_seqlens" else 0
    return buffers


def run_tower(manager: EncoderGraphManager, *call) -> torch.Tensor:
    return manager.execute(manager.encoder.inputs_from_call(call, {}))


# ------------------------------------------------------------------- splitting


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_packed_tower_splits_into_depth_plus_one_pieces(depth):
    adapter = PackedEncoderAdapter(packed_tower(depth))
    buffers = buffers_for(adapter, LOCAL_PATH, 16, (torch.float32, torch.device("cpu")))
    with torch.no_grad():
        split = split_of(adapter, LOCAL_PATH, buffers)
    assert (split.num_pieces, split.num_splits) == (depth + 1, depth)
    assert [stage.eager for stage in split.stages] == [False, True] * depth + [False]


def test_torchvision_vit_splits_at_its_multihead_attention():
    adapter = BatchedEncoderAdapter(tiny_vit())
    buffers = buffers_for(adapter, IMAGE_PATH, 4, ((3, 32, 32), torch.float32, torch.device("cpu")))
    with torch.no_grad():
        split = split_of(adapter, IMAGE_PATH, buffers)
    assert (split.num_pieces, split.num_splits) == (3, 2)


def encoders_and_buffers():
    rng = random.Random(0)
    packed = PackedEncoderAdapter(packed_tower())
    vit = BatchedEncoderAdapter(tiny_vit())
    toy = ToyEncoder(ToyTower())
    return [
        (packed, LOCAL_PATH, packed_buffers(packed, rng)),
        (vit, IMAGE_PATH, buffers_for(vit, IMAGE_PATH, 4, ((3, 32, 32), torch.float32, "cpu"))),
        (toy, "local", buffers_for(toy, "local", 16, (torch.float32, torch.device("cpu")))),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["packed_vit", "vit", "toy"])
def test_running_the_pieces_equals_the_graph_forward(index):
    encoder, path, buffers = encoders_and_buffers()[index]
    with torch.no_grad():
        graph = PiecewiseGraph(split_of(encoder, path, buffers), buffers)
        for seed in range(3):
            # New values in the same buffers, as before every replay.
            generator = torch.Generator().manual_seed(seed)
            for buffer in buffers.values():
                if buffer.is_floating_point():
                    buffer.copy_(torch.randn(buffer.shape, generator=generator))
            expected = encoder.graph_forward(path, buffers)
            assert relative_error(graph.run(), expected) < 1e-5


def test_custom_splitting_ops_split_elsewhere_and_still_equal_the_forward():
    depth = 2
    adapter = PackedEncoderAdapter(packed_tower(depth))
    buffers = packed_buffers(adapter, random.Random(1))
    ops = ["aten::gelu", "aten.scaled_dot_product_attention"]
    with torch.no_grad():
        split = split_of(adapter, LOCAL_PATH, buffers, splitting_ops=ops)
        # Attention and the MLP's GELU in every block, and the merger's GELU.
        assert split.num_splits == 2 * depth + 1
        pieces = PiecewiseGraph(split, buffers).run()
        assert relative_error(pieces, adapter.graph_forward(LOCAL_PATH, buffers)) < 1e-5


def test_slots_do_not_grow_with_depth():
    slots = []
    for depth in (2, 5):
        adapter = PackedEncoderAdapter(packed_tower(depth))
        buffers = packed_buffers(adapter, random.Random(2))
        with torch.no_grad():
            graph = PiecewiseGraph(split_of(adapter, LOCAL_PATH, buffers), buffers)
        slots.append(len(graph._slots))
    assert slots[0] == slots[1]


# ----------------------------------------------------------- what cannot split


class HostReadingEncoder(ToyEncoder):
    """Reads a buffer's value on the host: fine eagerly, not traceable."""

    def graph_forward(self, path, buffers):
        real_rows = int(buffers["cu_seqlens"][-1])
        return self.tower.body(buffers["tokens"], buffers["cu_seqlens"]) * min(real_rows, 1)


class HandWrittenAttentionEncoder(ToyEncoder):
    """Attention as matmul + softmax: no splitting op to cut at."""

    def graph_forward(self, path, buffers):
        x = self.tower.embed(buffers["tokens"])
        q, k, v = self.tower.qkv(x).chunk(3, dim=-1)
        return self.tower.out(x + torch.softmax(q @ k.T, dim=-1) @ v)


def test_an_untraceable_tower_names_the_op_and_the_line():
    encoder = HostReadingEncoder(ToyTower())
    buffers = buffers_for(encoder, "local", 16, (torch.float32, torch.device("cpu")))
    with torch.no_grad(), pytest.raises(PiecewiseUnsupported) as raised:
        split_of(encoder, "local", buffers)
    message = str(raised.value)
    assert "test_piecewise.py" in message
    assert 'int(buffers["cu_seqlens"][-1])' in message
    assert "aten." in message


def test_a_tower_without_splitting_ops_names_its_attention_like_ops():
    encoder = HandWrittenAttentionEncoder(ToyTower())
    buffers = buffers_for(encoder, "local", 16, (torch.float32, torch.device("cpu")))
    with torch.no_grad(), pytest.raises(PiecewiseUnsupported, match="aten::_softmax|aten::softmax"):
        split_of(encoder, "local", buffers)


@pytest.mark.parametrize("ops", [[], "aten::gelu", ["gelu"], ["aten::gelu.default"], [3]])
def test_bad_splitting_ops_name_the_field(ops):
    with pytest.raises(ValueError, match="splitting_ops"):
        check_splitting_ops(ops)


def test_bad_manager_arguments_name_the_field():
    with pytest.raises(ValueError, match="piecewise_fallback"):
        EncoderGraphManager(
            ToyEncoder(ToyTower()), mode="piecewise", piecewise_fallback="cpu", capture="first_use"
        )
    with pytest.raises(ValueError, match="splitting_ops"):
        EncoderGraphManager(
            ToyEncoder(ToyTower()), mode="piecewise", splitting_ops=["sdpa"], capture="first_use"
        )


def test_without_fallback_capture_raises_the_clear_error():
    manager = EncoderGraphManager(
        HostReadingEncoder(ToyTower()), mode="piecewise", capture="first_use"
    )
    with torch.no_grad(), pytest.raises(PiecewiseUnsupported, match="HostReadingEncoder"):
        run_tower(manager, *toy_call(random.Random(0), 2))


@pytest.mark.parametrize(
    ("mode", "fallback", "graphed"),
    [
        ("piecewise", "eager", False),
        ("piecewise", "full", True),
        ("full_and_piecewise", "eager", True),  # uniform batches stay FULL
        ("full_and_piecewise", "full", True),
    ],
)
def test_fallback_warns_and_runs_eager_or_full(mode, fallback, graphed):
    tower = ToyTower().eval()
    manager = EncoderGraphManager(
        HostReadingEncoder(tower), mode=mode, piecewise_fallback=fallback, capture="first_use"
    )
    rng = random.Random(3)
    # The warning comes with the first batch that needs a PIECEWISE key.
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="HostReadingEncoder"):
        tokens, lengths = toy_call(rng, 1)  # one item: a uniform batch
        assert relative_error(run_tower(manager, tokens, lengths), tower(tokens, lengths)) < 1e-5
        for _ in range(20):
            tokens, lengths = toy_call(rng, random_count(rng))
            expected = tower(tokens, lengths)
            assert relative_error(run_tower(manager, tokens, lengths), expected) < 1e-5
    assert manager.stats.piecewise_hits == 0
    assert (manager.stats.hits > 0) == graphed
    assert not any(graph.pieces for graph in manager.cache.graphs())


# ------------------------------------------------------------------- manager


@pytest.mark.parametrize("global_tokens", [0, 4])
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_toy_manager_equals_eager_on_random_batches(mode, global_tokens):
    rng = random.Random(f"{mode}{global_tokens}")
    tower = ToyTower(global_tokens=global_tokens).eval()
    manager = EncoderGraphManager(ToyEncoder(tower, max_budget=64), mode=mode, capture="first_use")
    with torch.no_grad():
        for _ in range(100):
            tokens, lengths = toy_call(rng, random_count(rng))
            actual = run_tower(manager, tokens, lengths)
            expected = tower(tokens, lengths)
            assert actual.shape == expected.shape
            assert relative_error(actual, expected) < 1e-5
    stats = manager.stats
    assert stats.piecewise_hits > 0 and stats.misses > 0
    assert (stats.hits > stats.piecewise_hits) == (mode == "full_and_piecewise")


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_packed_manager_equals_eager_on_random_batches(mode):
    rng = random.Random(mode)
    tower = packed_tower(global_view=True)
    adapter = PackedEncoderAdapter(tower, max_frames_per_item=2, max_token_budget=64)
    manager = EncoderGraphManager(
        adapter, mode=mode, budgets=BudgetConfig(min_budget=4), capture="first_use"
    )
    with torch.no_grad():
        for _ in range(30):
            patches, grid_thw = packed_call(rng, random_count(rng), max_frames=2)
            actual = run_tower(manager, patches, grid_thw)
            assert relative_error(actual, tower(patches, grid_thw)) < 1e-5
    assert manager.stats.piecewise_hits > 0


def test_vit_manager_equals_eager_on_random_batches():
    rng = random.Random(4)
    tower = tiny_vit()
    manager = EncoderGraphManager(
        BatchedEncoderAdapter(tower, max_batch_size=8), mode="piecewise", capture="first_use"
    )
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(rng.randint(1, 12), 3, 32, 32)
            assert relative_error(run_tower(manager, x), tower(x)) < 1e-5
    assert manager.stats.piecewise_hits == manager.stats.hits > 0


def test_frames_over_the_full_capacity_run_piecewise():
    tower = packed_tower()
    # The adapter promises images; videos overflow the FULL graphs' metadata.
    adapter = PackedEncoderAdapter(tower, min_token_budget=4, max_token_budget=64)
    manager = EncoderGraphManager(adapter, mode="full_and_piecewise", capture="first_use")
    video = torch.randn(3, 3, 8, 8)
    patches, grid_thw = patchify([video, video], PATCH)  # uniform: an exact FULL key
    with torch.no_grad():
        actual = run_tower(manager, patches, grid_thw)
    assert relative_error(actual, tower(patches, grid_thw)) < 1e-5
    assert (manager.stats.piecewise_hits, manager.stats.misses) == (1, 0)


def test_piecewise_stats_reach_as_dict():
    manager = EncoderGraphManager(
        ToyEncoder(ToyTower().eval()), mode="piecewise", capture="first_use"
    )
    with torch.no_grad():
        run_tower(manager, *toy_call(random.Random(5), 3))
    assert manager.stats.as_dict()["piecewise_hits"] == manager.stats.piecewise_hits > 0


def test_callback_checks_and_passes_the_piecewise_arguments():
    with pytest.raises(ValueError, match="piecewise_fallback"):
        CUDAGraphCallback(mode="piecewise", piecewise_fallback="never", capture="first_use")
    with pytest.raises(ValueError, match="splitting_ops"):
        CUDAGraphCallback(mode="piecewise", splitting_ops=["attention"], capture="first_use")
    callback = CUDAGraphCallback(
        mode="piecewise",
        splitting_ops=["aten.gelu"],
        piecewise_fallback="full",
        capture="first_use",
    )
    predictions(callback)  # builds the manager at setup
    assert callback.manager.config.splitting_ops == ("aten::gelu",)
    assert callback.manager.config.piecewise_fallback == "full"


def test_hydra_overrides_reach_the_callback():
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose(
            "predict",
            overrides=[
                "cudagraph=full_and_piecewise",
                "cudagraph.splitting_ops=[aten::scaled_dot_product_attention]",
                "cudagraph.piecewise_fallback=eager",
            ],
        )
    callback = instantiate(cfg.cudagraph)
    assert callback.config.splitting_ops == ("aten::scaled_dot_product_attention",)
    assert callback.config.piecewise_fallback == "eager"


# ---------------------------------------------------------------------- CUDA


def cuda_tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_cuda_packed_replay_equals_eager(mode, dtype):
    rng = random.Random(f"{mode}{dtype}")
    tower = packed_tower(global_view=True, device="cuda").to(dtype)
    adapter = PackedEncoderAdapter(tower, max_frames_per_item=2, max_token_budget=64)
    manager = EncoderGraphManager(
        adapter, mode=mode, budgets=BudgetConfig(min_budget=4), capture="first_use"
    )
    with torch.no_grad():
        for _ in range(50):
            patches, grid_thw = packed_call(rng, random_count(rng), dtype, "cuda", max_frames=2)
            actual = run_tower(manager, patches, grid_thw)
            expected = tower(patches, grid_thw)
            assert torch.isfinite(actual).all()
            assert relative_error(actual, expected) < cuda_tolerance(dtype)
    assert manager.stats.piecewise_hits > 0
    pieces = [graph.pieces for graph in manager.cache.graphs() if graph.pieces]
    assert pieces and all(p.num_graphs == tower.config.depth + 1 for p in pieces)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_vit_replay_equals_eager(dtype, monkeypatch):
    # TF32 convolutions differ between batch sizes by ~1e-3, past the fp32 tolerance.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    rng = random.Random(str(dtype))
    tower = tiny_vit("cuda").to(dtype)
    manager = EncoderGraphManager(
        BatchedEncoderAdapter(tower, max_batch_size=8), mode="piecewise", capture="first_use"
    )
    with torch.no_grad():
        for _ in range(30):
            x = torch.randn(rng.randint(1, 12), 3, 32, 32, device="cuda", dtype=dtype)
            assert relative_error(run_tower(manager, x), tower(x)) < cuda_tolerance(dtype)
    assert manager.stats.piecewise_hits == manager.stats.hits > 0
    assert all(graph.pieces.num_graphs == 3 for graph in manager.cache.graphs())


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_frames_over_the_full_capacity_run_piecewise(dtype):
    tower = packed_tower(device="cuda").to(dtype)
    adapter = PackedEncoderAdapter(tower, min_token_budget=4, max_token_budget=64)
    manager = EncoderGraphManager(adapter, mode="full_and_piecewise", capture="first_use")
    video = torch.randn(3, 3, 8, 8)
    patches, grid_thw = patchify([video, video], PATCH)
    patches, grid_thw = patches.to("cuda", dtype), grid_thw.cuda()
    with torch.no_grad():
        actual = run_tower(manager, patches, grid_thw)
        expected = tower(patches, grid_thw)
    assert relative_error(actual, expected) < cuda_tolerance(dtype)
    assert (manager.stats.piecewise_hits, manager.stats.misses) == (1, 0)
    assert manager.stats.graphs > 0


def test_piecewise_runs_an_item_of_more_frames_than_its_graph_holds_eagerly():
    tower = packed_tower()
    # Images only: the piecewise graph's metadata holds one frame per item, one item.
    adapter = PackedEncoderAdapter(tower, min_token_budget=4, max_token_budget=64)
    manager = EncoderGraphManager(
        adapter,
        mode="piecewise",
        budgets=BudgetConfig(budgets=[64]),
        max_items_per_batch=1,
        capture="first_use",
    )
    video, image = torch.randn(3, 3, 8, 8), torch.randn(3, 8, 8)
    with torch.no_grad():
        for item in (video, image):
            patches, grid_thw = patchify([item], PATCH)
            actual = run_tower(manager, patches, grid_thw)
            assert relative_error(actual, tower(patches, grid_thw)) < 1e-5
    # The video ran eagerly, the image through the pieces.
    assert (manager.stats.misses, manager.stats.piecewise_hits) == (1, 1)
