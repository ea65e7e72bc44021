"""The callback's one-line run report."""

import re
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from test_callback import trainer
from test_callback_plan import OPTIONS, Classifier, loader

import lightning_cg.callback.report as callback_report
from lightning_cg.callback.graph_callback import CUDAGraphCallback
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.capture import GraphCapturer


def report(monkeypatch, on_cuda: bool = True, **counters) -> str:
    # Lightning's logger does not propagate to the root logger: read the line itself.
    lines = []
    monkeypatch.setattr(callback_report, "rank_zero_info", lines.append)
    stats = GraphStats(hits=90, misses=10, graphs=3, graphs_captured=3, **counters)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu")
    callback_report.report_run(trainer, stats.as_dict(), "predict", on_cuda=on_cuda)
    (line,) = lines
    return line


@pytest.mark.parametrize("compiled", [0.0, 5.25])
def test_a_run_that_compiled_says_what_compiling_cost(monkeypatch, compiled):
    line = report(monkeypatch, capture_seconds_run=6.5, compile_seconds_run=compiled)
    assert "90 graph replays" in line and "3 graphs captured in 6.50 s" in line
    assert ("5.25 s of it compiling the graph forward" in line) == bool(compiled)


def test_the_line_tells_the_graphs_memory_and_its_parts(monkeypatch):
    line = report(
        monkeypatch, pool_bytes=300 * 2**20, weight_copy_bytes=165 * 2**20, held_bytes=489 * 2**20
    )
    assert (
        "3 held; device memory 489 MiB: pool 300 MiB, weight copies 165 MiB, input buffers 24 MiB"
        in line
    )


class TwoRanks:
    """A strategy of two ranks, the other holding ``factor`` times this rank's stats."""

    root_device = torch.device("cpu")

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def reduce(self, values: torch.Tensor, reduce_op: str) -> torch.Tensor:
        ranks = torch.stack([values, self.factor * values])
        return ranks.sum(0) if reduce_op == "sum" else ranks.amax(0)


def test_counters_are_summed_over_ranks_and_memory_is_the_largest_ranks():
    stats = GraphStats(
        hits=90,
        misses=10,
        graphs=3,
        pool_bytes=300 * 2**20,
        weight_copy_bytes=100 * 2**20,
        held_bytes=420 * 2**20,
    )
    trainer = SimpleNamespace(strategy=TwoRanks(factor=2.0))
    reduced = callback_report.reduce_stats(trainer, stats.as_dict())
    assert (reduced["hits"], reduced["misses"], reduced["graphs"]) == (270, 30, 9)
    assert reduced["hit_rate"] == 0.9
    # One device holds one rank's graphs: the larger rank's memory, not the sum.
    assert (reduced["pool_bytes"], reduced["weight_copy_bytes"], reduced["held_bytes"]) == (
        600 * 2**20,
        200 * 2**20,
        840 * 2**20,
    )


def test_the_cpu_line_says_how_sub_batches_ran_without_graphs(monkeypatch):
    line = report(monkeypatch, on_cuda=False, real_tokens=100, padded_tokens=25)
    assert "no CUDA graphs on the CPU" in line
    assert "90 sub-batch paths ran the padded budget path, 10 eagerly" in line
    assert "padding waste 25.0%" in line and "graph replays" not in line


def test_a_capture_costlier_than_the_runs_eager_time_is_named_on_its_own_line(monkeypatch):
    # 40 batches repay a capture from the key's second sighting; the capture is
    # timed at 30 s more than it took (on the CPU it only prepares the budget
    # path), more than the whole run of eager calls of a small tower.
    lines = []
    monkeypatch.setattr(callback_report, "rank_zero_info", lines.append)
    capture = GraphCapturer.capture
    monkeypatch.setattr(GraphCapturer, "capture", lambda self, keys: capture(self, keys) + 30.0)
    callback = CUDAGraphCallback(**OPTIONS)
    trainer(callback).validate(Classifier(), loader(40), verbose=False)
    costly = [line for line in lines if "more than the run's" in line]
    assert len(costly) == 1, lines
    assert re.search(
        r"CUDAGraphCallback \(validate, module='tower'\): capturing the '\w+' graph of 4 "
        r"tokens took 30\.\d\d s, more than the run's \d+\.\d\d s of eager tower time",
        costly[0],
    ), costly[0]
    # A run whose capture costs less names none.
    monkeypatch.setattr(GraphCapturer, "capture", capture)
    lines.clear()
    trainer(CUDAGraphCallback(**OPTIONS)).validate(Classifier(), loader(40), verbose=False)
    assert not [line for line in lines if "more than the run's" in line]
