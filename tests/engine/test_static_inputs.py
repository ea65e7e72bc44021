"""Every replay rewrites each static buffer whole (real rows, then the padding rule),
whether its rows come from the buffer's device or from the host through pinned
staging reused across replays."""

import random

import numpy as np
import pytest
import torch

import lightning_cg.engine.static_inputs as static_inputs_module
from examples.models.packed_vit import PackedViT, PackedViTConfig, patchify
from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.engine.manager import BudgetConfig, EncoderGraphManager
from lightning_cg.engine.replay import relative_error
from lightning_cg.engine.replay_checks import FIRST_PADDED_CHECKS
from lightning_cg.engine.static_inputs import MAX_STAGING_SLOTS, PieceRows, StaticInputs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
RULES = {"offsets": "repeat_last"}
#: Integer rows go through numpy on the host, bfloat16 ones through torch.
DTYPES = {"offsets": torch.int32, "positions": torch.int64, "features": torch.bfloat16}


def buffers_on(device: str, size: int = 16) -> dict[str, torch.Tensor]:
    return {
        "offsets": torch.full((size,), -1, dtype=DTYPES["offsets"], device=device),
        "positions": torch.full((size, 2), -1, dtype=DTYPES["positions"], device=device),
        "features": torch.full((size, 3), -1, dtype=DTYPES["features"], device=device),
    }


def random_rows(rng: random.Random, count: int) -> dict[str, torch.Tensor]:
    """Host rows of ``count`` rows per buffer, none of them -1 or 0."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    return {
        "offsets": torch.randint(1, 100, (count,), generator=generator, dtype=torch.int32),
        "positions": torch.randint(1, 100, (count, 2), generator=generator),
        "features": torch.randint(1, 100, (count, 3), generator=generator).to(torch.bfloat16),
    }


def expected_buffer(rows: torch.Tensor, size: int, rule: str) -> torch.Tensor:
    zero = torch.zeros((1, *rows.shape[1:]), dtype=rows.dtype)
    padding = rows[-1:] if rule == "repeat_last" and len(rows) else zero
    return torch.cat([rows, padding.expand(size - len(rows), *rows.shape[1:])])


@pytest.mark.parametrize("device", DEVICES)
def test_each_fill_rewrites_every_buffer_whole_by_its_rule(device):
    rng = random.Random(0)
    buffers = buffers_on(device)
    static_inputs = StaticInputs(buffers, RULES)
    # Larger then smaller fills: rows of an earlier fill must not survive.
    for count in (16, 11, 3, 0, 7, 16, 1):
        rows = random_rows(rng, count)
        static_inputs.fill(rows, "path")
        for name, buffer in buffers.items():
            expected = expected_buffer(rows[name], 16, RULES.get(name, "zero"))
            assert torch.equal(buffer.cpu(), expected), (name, count)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_do_not_fit_a_buffer_raise_and_name_it(device):
    static_inputs = StaticInputs(buffers_on(device, size=4), RULES)
    rows = random_rows(random.Random(1), 4)
    with pytest.raises(RuntimeError, match=r"lacks buffer\(s\) \['features'\]"):
        static_inputs.fill({k: v for k, v in rows.items() if k != "features"}, "path")
    with pytest.raises(RuntimeError, match=r"buffer 'positions' holds \(4, 2\); replay rows"):
        static_inputs.fill({**rows, "positions": torch.zeros(5, 2, dtype=torch.int64)}, "p")
    with pytest.raises(RuntimeError, match=r"buffer 'positions' holds \(4, 2\); replay rows"):
        static_inputs.fill({**rows, "positions": torch.zeros(4, 3, dtype=torch.int64)}, "p")
    with pytest.raises(RuntimeError, match="buffer 'offsets' is torch.int32 on"):
        static_inputs.fill({**rows, "offsets": rows["offsets"].long()}, "p")


@pytest.mark.cuda
@pytest.mark.parametrize("private_stream_call", [True, False])
def test_cuda_staging_is_not_rewritten_before_the_gpu_has_read_it(private_stream_call, monkeypatch):
    """The GPU is kept busy, so copies out of the staging are still queued when the
    host writes the next rows: more fills than slots must still each land whole
    (also with the public current-stream call, for a torch without the private one)."""
    if not private_stream_call:
        monkeypatch.setattr(static_inputs_module, "_current_stream_id", None)
    rng = random.Random(2)
    buffers = buffers_on("cuda", size=64)
    static_inputs = StaticInputs(buffers, RULES)
    filled, snapshots = [], []
    for _ in range(3 * MAX_STAGING_SLOTS):
        torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time before each copy
        rows = random_rows(rng, rng.randint(0, 64))
        static_inputs.fill(rows, "path")
        filled.append(rows)
        # Queued after the copies: what the buffers held once they had run.
        snapshots.append({name: buffer.clone() for name, buffer in buffers.items()})
    torch.cuda.synchronize()
    for rows, snapshot in zip(filled, snapshots, strict=True):
        for name, buffer in snapshot.items():
            expected = expected_buffer(rows[name], 64, RULES.get(name, "zero"))
            assert torch.equal(buffer.cpu(), expected), name


def in_pieces(rng: random.Random, rows: torch.Tensor) -> list[np.ndarray]:
    """``rows`` as numpy pieces of random lengths (empty ones too), at least one."""
    cuts = sorted(rng.randint(0, len(rows)) for _ in range(rng.randint(0, 3)))
    bounds = [0, *cuts, len(rows)]
    return [rows[start:stop].numpy() for start, stop in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("device", DEVICES)
def test_rows_in_pieces_fill_each_buffer_as_the_stacked_rows_would(device):
    rng = random.Random(4)
    buffers = {name: buffers_on(device)[name] for name in ("offsets", "positions")}
    static_inputs = StaticInputs(buffers, RULES)
    for count in (16, 11, 3, 0, 7, 16, 1):
        rows = random_rows(rng, count)
        pieces = {name: in_pieces(rng, rows[name]) for name in buffers}
        static_inputs.fill(PieceRows({}, pieces), "path")
        for name, buffer in buffers.items():
            expected = expected_buffer(rows[name], 16, RULES.get(name, "zero"))
            assert torch.equal(buffer.cpu(), expected), (name, count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "pieces",
    [
        [np.zeros((3, 2), np.int64), np.zeros((2, 2), np.int64)],  # too many rows
        [np.zeros((2, 1), np.int64)],  # another row shape (numpy would broadcast it)
        [np.zeros((2, 2), np.int32)],  # another dtype (numpy would cast it)
    ],
)
def test_pieces_that_do_not_fit_a_buffer_raise_and_name_it(device, pieces):
    static_inputs = StaticInputs({"positions": buffers_on(device, size=4)["positions"]}, {})
    with pytest.raises(RuntimeError, match=r"buffer 'positions' holds \(4, 2\)"):
        static_inputs.fill(PieceRows({}, {"positions": pieces}), "path")


def test_piece_rows_read_as_a_mapping_of_tensors():
    features = torch.ones(2, 3)
    rows = PieceRows(
        {"features": features},
        {"positions": [np.array([[1, 2]], np.int32), np.array([[3, 4], [5, 6]], np.int32)]},
    )
    assert list(rows) == ["features", "positions"] and len(rows) == 2
    assert rows["features"] is features
    assert rows["positions"].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert rows["positions"] is rows["positions"]  # stacked once
    assert dict(rows.items()).keys() == {"features", "positions"}
    with pytest.raises(ValueError, match="both whole and in pieces"):
        PieceRows({"positions": features}, {"positions": [np.zeros((1, 3))]})


# ---------------------------------------------------------------- through the manager

PATCH = 4


def packed_manager(device: str) -> tuple[PackedViT, EncoderGraphManager]:
    torch.manual_seed(0)
    config = PackedViTConfig(
        hidden_size=32, depth=1, num_heads=2, patch_size=PATCH, out_hidden_size=16
    )
    tower = PackedViT(config).to(device).eval()
    manager = EncoderGraphManager(
        PackedEncoderAdapter(tower, min_token_budget=4),
        budgets=BudgetConfig(budgets=[64]),
        max_items_per_batch=2,
        capture="first_use",
    )
    return tower, manager


def images(sides: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    """Images of ``sides`` patches (multiples of the merge size 2)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h * PATCH, w * PATCH, generator=generator) for h, w in sides]


@pytest.mark.parametrize("device", DEVICES)
def test_a_smaller_replay_after_a_larger_one_equals_eager_and_pads_its_buffers(device):
    tower, manager = packed_manager(device)
    # One image each, 60 then 6 of the 64-token budget: one graph for both.
    calls = [images([(12, 20)], seed=0), images([(4, 6)], seed=1)]
    with torch.no_grad():
        for items in calls:
            patches, grid_thw = patchify(items, PATCH)
            patches, grid_thw = patches.to(device), grid_thw.to(device)
            inputs = manager.encoder.inputs_from_call((patches, grid_thw), {})
            output = manager.execute(inputs)
            assert relative_error(output, tower(patches, grid_thw)) < 1e-4
    assert manager.stats.hits == 2 and len(manager.cache) == 1
    ((_, graph),) = manager.cache.items()
    patches_rows = 4 * 6
    assert graph.buffers["cu_seqlens"].tolist() == [0, patches_rows]
    assert not graph.buffers["positions"][patches_rows:].any()
    assert not graph.buffers["pixel_patches"][patches_rows:].any()


@pytest.mark.cuda
def test_cuda_replays_queued_behind_a_busy_gpu_equal_eager():
    """The host queues many replays of one graph while the GPU is busy (a host
    ``grid_thw``, so no call waits for the GPU): staging reused too early would
    hand a replay another call's metadata."""
    tower, manager = packed_manager("cuda")
    rng = random.Random(3)
    calls = []
    for seed in range(3 * MAX_STAGING_SLOTS):
        sides = [(2 * rng.randint(1, 7), 2 * rng.randint(1, 7)) for _ in range(2)]
        patches, grid_thw = patchify(images(sides, seed), PATCH)
        calls.append((patches.cuda(), grid_thw))
    with torch.no_grad():
        for call in calls:  # captures every key
            manager.execute(manager.encoder.inputs_from_call(call, {}))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        outputs = [manager.execute(manager.encoder.inputs_from_call(call, {})) for call in calls]
        expected = [tower(*call) for call in calls]
    for output, eager in zip(outputs, expected, strict=True):
        assert relative_error(output, eager) < 1e-4


@pytest.mark.cuda
def test_cuda_replay_of_gathered_items_does_not_wait_for_the_gpu():
    tower, manager = packed_manager("cuda")
    # Small, large, small: packing pairs items 0 and 2, a gathered sub-batch.
    patches, grid_thw = patchify(images([(2, 4), (6, 8), (4, 2)], seed=4), PATCH)
    call = (patches.cuda(), grid_thw.cuda())
    with torch.no_grad():
        # Captures, then the replays checked against eager (which waits for the GPU).
        for _ in range(FIRST_PADDED_CHECKS):
            manager.execute(manager.encoder.inputs_from_call(call, {}))
        # Reading grid_thw on the host waits for the GPU: outside the check.
        inputs = manager.encoder.inputs_from_call(call, {})
        torch.cuda.set_sync_debug_mode("error")
        try:
            output = manager.execute(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected = tower(*call)
    assert manager.stats.hits == 2 * (FIRST_PADDED_CHECKS + 1)
    assert relative_error(output, expected) < 1e-4
