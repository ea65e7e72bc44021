"""The callback's one-line run report."""

import lightning.pytorch as pl
import pytest

import lightning_cg.callback.report as callback_report
from lightning_cg.core.stats import GraphStats


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


def test_the_line_tells_the_graphs_memory(monkeypatch):
    line = report(monkeypatch, pool_bytes=300 * 2**20, weight_copy_bytes=165 * 2**20)
    assert "3 held; memory: pool 300 MiB, weight copies 165 MiB" in line


def test_the_cpu_line_says_how_sub_batches_ran_without_graphs(monkeypatch):
    line = report(monkeypatch, on_cuda=False, real_tokens=100, padded_tokens=25)
    assert "no CUDA graphs on the CPU" in line
    assert "90 sub-batch paths ran the padded budget path, 10 eagerly" in line
    assert "padding waste 25.0%" in line and "graph replays" not in line
