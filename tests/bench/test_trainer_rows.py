"""bench.trainer.rows: the one-line description of a Trainer benchmark row."""

import pytest

from bench.trainer.rows import describe


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
