"""GraphStats: a run's counters start from zero at each run; what is held stays."""

from dataclasses import fields

from lightning_cg.core.stats import GraphStats

#: What describes the graphs held, not one run's work (as GraphStats' docstrings say).
HELD = {
    "graphs",
    "capture_seconds",
    "pool_bytes",
    "weight_copy_bytes",
    "held_bytes",
    "compile_seconds",
}


def test_a_new_run_zeroes_the_run_counters_and_keeps_what_is_held():
    stats = GraphStats(**{counter.name: 7 for counter in fields(GraphStats)})
    stats.reset_run()
    kept = {name for name, value in stats.as_dict().items() if value}
    assert kept == HELD
    # A run's own capture and compile time start again; the totals stay.
    assert (stats.capture_seconds_run, stats.compile_seconds_run) == (0, 0)
