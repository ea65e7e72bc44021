"""The callback's one-line run report."""

import logging

import lightning.pytorch as pl
import pytest

from lightning_cg.callback_report import report_run
from lightning_cg.stats import GraphStats


def report(caplog, **counters) -> str:
    stats = GraphStats(hits=90, misses=10, graphs=3, graphs_captured=3, **counters)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, accelerator="cpu")
    with caplog.at_level(logging.INFO):
        report_run(trainer, {**stats.as_dict(), **stats.rates()}, "predict", on_cuda=True)
    return caplog.text


@pytest.mark.parametrize("compiled", [0.0, 5.25])
def test_a_run_that_compiled_says_what_compiling_cost(caplog, compiled):
    text = report(caplog, capture_seconds_run=6.5, compile_seconds_run=compiled)
    assert "90 graph replays" in text and "3 graphs captured in 6.50 s" in text
    assert ("5.25 s of it compiling the graph forward" in text) == bool(compiled)
