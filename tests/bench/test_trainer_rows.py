"""bench.trainer.rows: the median of repeated runs, and the one-line description of a row."""

import pytest

from bench.trainer.module import RunRecord
from bench.trainer.rows import describe, median_runs, repeat_fields
from bench.trainer.runs import PredictRun


def row(**fields):
    return {
        "workload": "packed_vit/mixed_batch_8",
        "batches": 1000,
        "run": "first",
        "eager_tower_s": 74.452,
        "callback_tower_s": 70.157,
        "vs_eager": 1.0612,
        "graphs_captured": 3,
        "capture_s": 6.742,
        **fields,
    }


@pytest.mark.parametrize("compiled", [0.0, 6.03])
def test_a_row_says_what_compiling_cost_of_its_capture(compiled):
    line = describe(row(callback_stats={"compile_seconds_run": compiled}))
    assert "eager 74.452 s; callback 70.157 s; vs_eager 1.06x" in line
    assert "3 graphs, 6.74 s capture" in line
    assert ("(6.03 s of it compiling)" in line) == bool(compiled)


def runs(first_s: float, second_s: float, captured: int) -> dict[str, PredictRun]:
    return {
        name: PredictRun(RunRecord(seconds, seconds, 10, captured, 0.1), seconds, [])
        for name, seconds in (("first", first_s), ("second", second_s))
    }


def test_each_run_is_its_median_repeat_with_that_repeats_own_figures():
    repeats = [runs(0.30, 0.20, 1), runs(0.10, 0.40, 2), runs(0.20, 0.30, 3)]
    chosen = median_runs(repeats)
    assert chosen["first"].record.tower_s == 0.20 and chosen["first"].record.graphs_captured == 3
    assert chosen["second"].record.tower_s == 0.30 and chosen["second"].record.graphs_captured == 3
    # An even count takes the lower middle one: a real run, not an average.
    assert median_runs(repeats[:2])["first"].record.tower_s == 0.10


def test_repeat_fields_list_every_repeat_per_method_in_order():
    repeats = {"eager": [runs(0.5, 0.4, 0), runs(0.6, 0.7, 0)], "callback": [runs(0.3, 0.2, 1)] * 2}
    fields = repeat_fields(repeats, "second")
    assert fields == {
        "repeats": 2,
        "eager_tower_s_repeats": [0.4, 0.7],
        "callback_tower_s_repeats": [0.2, 0.2],
    }
