"""The callback under Lightning's DDP: two CPU processes (gloo), launched as torchrun would.

Each test spawns its ranks with :func:`distributed.run_ranks`; every rank saves
what the test checks to a file, and the test compares it with a single-process
run. The dataset size is a multiple of world size times batch size, so the
DistributedSampler adds no duplicate items.
"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from distributed import run_ranks
from lightning.pytorch.callbacks import BasePredictionWriter
from test_app import ROOT, SMALL_DATA, TINY_TOWER
from test_callback import BUDGETS, RecordingModel, datamodule, model, trainer

from lightning_cg.adapters.packed import PackedEncoderAdapter
from lightning_cg.callback.graph_callback import CUDAGraphCallback

WORLD_SIZE = 2
NUM_ITEMS = 16
COUNTERS = ("hits", "misses", "real_tokens", "padded_tokens", "sub_batches", "items", "tokens")


class IndexedPredictions(BasePredictionWriter):
    """Each rank's prediction rows by dataset index."""

    def __init__(self) -> None:
        super().__init__("batch")
        self.rows: dict[int, torch.Tensor] = {}

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0
    ):
        self.rows.update(zip(batch_indices, prediction, strict=True))


def ddp_trainer(*callbacks, **kwargs):
    return trainer(*callbacks, strategy="ddp", devices=WORLD_SIZE, **kwargs)


def ddp_predict(callback: CUDAGraphCallback, **kwargs) -> dict[int, torch.Tensor]:
    writer = IndexedPredictions()
    ddp_trainer(callback, writer, **kwargs).predict(
        model(), datamodule(NUM_ITEMS), return_predictions=False
    )
    return writer.rows


def single_process_predictions() -> torch.Tensor:
    return torch.cat(trainer().predict(model(), datamodule(NUM_ITEMS)))


def load_ranks(directory: Path) -> list[dict]:
    return [torch.load(directory / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def assert_summed(stats: list[dict], local: list[dict]) -> None:
    """Every rank reports the same stats, the sums of the ranks' own counters."""
    assert stats[0] == stats[1]
    for name in COUNTERS:
        assert stats[0][name] == sum(rank[name] for rank in local), name


# --------------------------------------------------------------------- predict


def _predict(rank: int, world_size: int, out: Path) -> None:
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    rows = ddp_predict(callback)
    local = callback.manager.stats.as_dict()
    torch.save({"rows": rows, "stats": callback.last_stats, "local": local}, out / f"rank{rank}.pt")


def test_ddp_predict_matches_single_process_and_sums_stats(tmp_path):
    run_ranks(_predict, WORLD_SIZE, tmp_path, backend=None)
    ranks = load_ranks(tmp_path)
    rows = {**ranks[0]["rows"], **ranks[1]["rows"]}
    assert sorted(rows) == list(range(NUM_ITEMS))
    assert not set(ranks[0]["rows"]) & set(ranks[1]["rows"])
    predicted = torch.stack([rows[index] for index in range(NUM_ITEMS)])
    torch.testing.assert_close(predicted, single_process_predictions(), rtol=1e-5, atol=1e-6)
    assert_summed([r["stats"] for r in ranks], [r["local"] for r in ranks])
    assert ranks[0]["stats"]["items"] == NUM_ITEMS and ranks[0]["stats"]["hits"] > 0


# ----------------------------------------------------------------- fit + validate


def _fit_validate(rank: int, world_size: int, out: Path) -> None:
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    net = model()
    fit_trainer = ddp_trainer(callback, max_epochs=1, deterministic=True)
    fit_trainer.fit(net, datamodule(NUM_ITEMS))
    fit_stats, fit_local = dict(callback.last_stats), callback.manager.stats.as_dict()
    graphed = fit_trainer.validate(net, datamodule(NUM_ITEMS), verbose=False)[0]["val_loss"]
    eager = ddp_trainer().validate(net, datamodule(NUM_ITEMS), verbose=False)[0]["val_loss"]
    plain = model()
    ddp_trainer(max_epochs=1, deterministic=True).fit(plain, datamodule(NUM_ITEMS))
    same_weights = all(
        torch.equal(a, b)
        for a, b in zip(net.state_dict().values(), plain.state_dict().values(), strict=True)
    )
    torch.save(
        {
            "training_forwards": net.training_forwards,
            "stats": fit_stats,
            "local": fit_local,
            "val_loss": (graphed, eager),
            "same_weights": same_weights,
        },
        out / f"rank{rank}.pt",
    )


def test_ddp_fit_trains_eagerly_and_validates_through_graphs(tmp_path):
    run_ranks(_fit_validate, WORLD_SIZE, tmp_path, backend=None)
    ranks = load_ranks(tmp_path)
    for result in ranks:
        assert result["training_forwards"] and all(result["training_forwards"])
        assert result["same_weights"]
        graphed, eager = result["val_loss"]
        assert abs(graphed - eager) <= 1e-5 * abs(eager)
    assert_summed([r["stats"] for r in ranks], [r["local"] for r in ranks])
    assert ranks[0]["stats"]["items"] == NUM_ITEMS and ranks[0]["stats"]["hits"] > 0


# ------------------------------------------------------- data-parallel encoder


def _data_parallel_predict(rank: int, world_size: int, out: Path) -> None:
    callback = CUDAGraphCallback(budgets=BUDGETS, encoder_data_parallel=True, capture="first_use")
    # Every rank receives every batch; the items of each are shared out.
    rows = ddp_predict(callback, use_distributed_sampler=False)
    local = callback.manager.stats.as_dict()
    torch.save({"rows": rows, "stats": callback.last_stats, "local": local}, out / f"rank{rank}.pt")


def test_encoder_data_parallel_shares_items_and_gathers_every_row(tmp_path):
    run_ranks(_data_parallel_predict, WORLD_SIZE, tmp_path, backend=None)
    reference = single_process_predictions()
    ranks = load_ranks(tmp_path)
    for result in ranks:
        assert sorted(result["rows"]) == list(range(NUM_ITEMS))
        predicted = torch.stack([result["rows"][index] for index in range(NUM_ITEMS)])
        torch.testing.assert_close(predicted, reference, rtol=1e-5, atol=1e-6)
        assert 0 < result["local"]["items"] < NUM_ITEMS
    assert_summed([r["stats"] for r in ranks], [r["local"] for r in ranks])
    assert ranks[0]["stats"]["items"] == NUM_ITEMS  # each item encoded on one rank


def _data_parallel_on_sharded_data(rank: int, world_size: int, out: Path) -> None:
    callback = CUDAGraphCallback(budgets=BUDGETS, encoder_data_parallel=True, capture="first_use")
    steps = []
    net = model()
    net.predict_step = lambda batch, batch_idx: steps.append(batch_idx)
    try:
        # Lightning's default distributed sampler gives each rank batches of its own.
        ddp_trainer(callback).predict(net, datamodule(NUM_ITEMS), return_predictions=False)
    except ValueError as error:
        torch.save({"error": str(error), "steps": steps}, out / f"rank{rank}.pt")


def test_encoder_data_parallel_refuses_data_sharded_over_ranks_before_any_batch(tmp_path):
    run_ranks(_data_parallel_on_sharded_data, WORLD_SIZE, tmp_path, backend=None)
    for result in load_ranks(tmp_path):
        assert "use_distributed_sampler=False" in result["error"]
        assert "DistributedSampler" in result["error"] and result["steps"] == []


def _data_parallel_fit_on_sharded_data(rank: int, world_size: int, out: Path) -> None:
    callback = CUDAGraphCallback(budgets=BUDGETS, encoder_data_parallel=True, capture="first_use")
    net = RecordingModel()
    try:
        ddp_trainer(callback, max_epochs=1, num_sanity_val_steps=2).fit(net, datamodule(NUM_ITEMS))
    except ValueError as error:
        torch.save({"error": str(error), "steps": net.training_forwards}, out / f"rank{rank}.pt")


def test_encoder_data_parallel_refuses_a_sharding_fit_before_training(tmp_path):
    run_ranks(_data_parallel_fit_on_sharded_data, WORLD_SIZE, tmp_path, backend=None)
    for result in load_ranks(tmp_path):
        assert "use_distributed_sampler=True" in result["error"]
        assert result["steps"] == []  # no training step ran


# ------------------------------------------------------------- agreed fallback


def _capture_fails_on_rank_one(rank: int, world_size: int, out: Path) -> None:
    if rank == 1:

        def capture_inputs(self, spec):
            raise RuntimeError("capture exploded")

        PackedEncoderAdapter.capture_inputs = capture_inputs
    callback = CUDAGraphCallback(budgets=BUDGETS, capture="first_use")
    runs = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rows = ddp_predict(callback)
        messages = [str(warning.message) for warning in caught]
        runs.append({"rows": rows, "stats": dict(callback.last_stats), "warnings": messages})
    torch.save(runs, out / f"rank{rank}.pt")


def test_a_capture_failure_on_one_rank_turns_every_rank_eager_next_run(tmp_path):
    run_ranks(_capture_fails_on_rank_one, WORLD_SIZE, tmp_path, backend=None)
    reference = single_process_predictions()
    first, second = zip(*load_ranks(tmp_path), strict=True)
    for run in (first, second):
        rows = {**run[0]["rows"], **run[1]["rows"]}
        predicted = torch.stack([rows[index] for index in range(NUM_ITEMS)])
        torch.testing.assert_close(predicted, reference, rtol=1e-5, atol=1e-6)
        assert run[0]["stats"] == run[1]["stats"]
    # Run 1: rank 0 replays its graphs, rank 1 falls back alone (and says so).
    assert first[0]["stats"]["hits"] > 0 and first[0]["stats"]["misses"] > 0
    assert any("capturing graphs failed" in m for m in first[1]["warnings"])
    assert not any("capturing graphs failed" in m for m in first[0]["warnings"])
    # Run 2: the ranks agreed at swap-in: everyone runs eagerly.
    assert second[0]["stats"]["hits"] == 0 and second[0]["stats"]["items"] == NUM_ITEMS
    assert any("every rank runs the tower eagerly" in m for m in second[0]["warnings"])


# --------------------------------------------------------------------- scripts


def test_predict_script_runs_with_two_ddp_processes(tmp_path):
    overrides = TINY_TOWER + SMALL_DATA + ["trainer=cpu", "trainer.devices=2"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "predict.py"),
            *overrides,
            "trainer.strategy=ddp",
            f"hydra.run.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # One report, from rank 0, counting both ranks' images.
    assert result.stdout.count("lightning-cg predict") == 1, result.stdout
    assert re.search(r"images\s*│\s*6\s*│", result.stdout), result.stdout


def test_hydra_config_turns_encoder_data_parallel_on():
    from hydra.utils import instantiate
    from test_app import compose_config

    cfg = compose_config("predict", ["cudagraph.encoder_data_parallel=true"])
    assert instantiate(cfg.cudagraph).encoder_data_parallel is True
