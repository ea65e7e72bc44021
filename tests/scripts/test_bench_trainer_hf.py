"""scripts/bench_trainer.py's transformers towers on the CPU: tiny CLIP and Qwen2-VL towers.

The user-style module calls them as transformers users do (``pixel_values=``;
``visual(hidden_states, grid_thw=...)``) and reads their ``pooler_output``;
through the callback it must get eager's outputs.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the top-level bench package, however pytest was started

from bench.trainer.rows import ROW_KEYS  # noqa: E402
from bench.trainer.runs import TrainerSettings, predict_runs  # noqa: E402
from bench.trainer.suite import BenchSettings, run_benchmark  # noqa: E402
from bench.trainer.workloads import (  # noqa: E402
    HF_WORKLOADS,
    TINY_SIZES,
    SyntheticBatches,
    Workload,
    make_tower,
)

pytest.importorskip("transformers")

#: first_use: the graph path from the first batch, whatever the run's length.
FIRST_USE = {"capture": "first_use"}


def test_every_transformers_workload_runs_through_the_trainer(tmp_path, one_thread):
    settings = BenchSettings(
        workloads=[Workload.parse(name) for name in HF_WORKLOADS],
        batches=[2],
        methods=["eager", "callback"],
        trainer=TrainerSettings("cpu", "32-true", FIRST_USE),
        sizes=TINY_SIZES,
        output=tmp_path / "trainer.json",
    )
    rows = run_benchmark(settings, echo=lambda line: None)

    keys = [(row["workload"], row["run"]) for row in rows]
    assert keys == [(name, run) for name in HF_WORKLOADS for run in ("first", "second")]
    for row in rows:
        images = 2 * (1 if row["workload"].endswith("batch_1") else 8)
        assert set(ROW_KEYS) <= set(row)
        assert row["eager_tower_s"] > 0 and row["callback_tower_s"] > 0
        assert row["images"] == row["callback_stats"]["items"] == images
        assert row["callback_max_abs_diff"] < 1e-4


@pytest.mark.parametrize("name", ["clip_vit_b16/batch_8", "qwen2_vl_vision/mixed_batch_8"])
def test_callback_outputs_equal_eager_outputs(name, one_thread):
    workload = Workload.parse(name)
    tower = make_tower(workload, TINY_SIZES, seed=0)
    batches = SyntheticBatches(workload, tower, 2, TINY_SIZES, seed=0, device=torch.device("cpu"))
    eager = predict_runs(tower, batches, "eager", TrainerSettings("cpu", "32-true"))
    graphed = predict_runs(tower, batches, "callback", TrainerSettings("cpu", "32-true", FIRST_USE))
    for run in ("first", "second"):
        stats = graphed[run].record.stats
        # Every image went the graph path (padded into budgets for the packed tower).
        assert stats["items"] == batches.images() and stats["hit_rate"] == 1.0
        if workload.mixed:
            assert stats["padded_tokens"] > 0
        for graph_out, eager_out in zip(graphed[run].outputs, eager[run].outputs, strict=True):
            # One pooled embedding per image, the tower's width.
            assert graph_out.shape == (8, tower.config.hidden_size)
            torch.testing.assert_close(graph_out, eager_out, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.slow  # torch.compile of transformers towers: minutes
def test_every_method_on_cuda(tmp_path):
    settings = BenchSettings(
        workloads=[Workload.parse(name) for name in HF_WORKLOADS],
        batches=[3],
        methods=["eager", "callback", "compile"],
        trainer=TrainerSettings("cuda", "bf16-mixed", FIRST_USE),
        sizes=TINY_SIZES,
        output=tmp_path / "trainer.json",
    )
    rows = run_benchmark(settings, echo=lambda line: None)
    assert len(rows) == 2 * len(HF_WORKLOADS)
    for row in rows:
        assert row["callback_tower_s"] > 0 and row["compile_tower_s"] > 0
        assert row["callback_max_abs_diff"] < 0.1 and row["compile_max_abs_diff"] < 0.1
    assert all(row["graphs_captured"] > 0 for row in rows if row["run"] == "first")
