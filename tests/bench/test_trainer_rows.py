"""bench.trainer.rows: the median of repeated runs, and the one-line description of a row."""

from types import SimpleNamespace

import pytest
import torch

from bench.trainer.module import RunClock, RunRecord
from bench.trainer.rows import (
    describe,
    markdown_table,
    median_runs,
    predict_rows,
    repeat_fields,
)
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


def test_a_run_clock_records_the_first_and_the_median_tower_call():
    clock = RunClock()
    module = SimpleNamespace(device=torch.device("cpu"))
    clock.on_predict_start(None, module)
    # What UserModule's timed tower calls leave behind: a slow first call.
    module.tower_seconds, module.tower_calls = 0.9, 4
    module.tower_call_seconds = [0.6, 0.1, 0.05, 0.15]
    clock.on_predict_end(None, module)
    (record,) = clock.records
    assert (record.tower_s, record.calls) == (0.9, 4)
    assert (record.first_call_s, record.median_call_s) == (0.6, 0.125)
    clock.on_predict_start(None, module)
    clock.on_predict_end(None, module)  # a run without tower calls
    assert clock.records[1].first_call_s is None and clock.records[1].median_call_s is None
    assert record.peak_mib is None  # measured on CUDA only


def test_predict_rows_carry_each_methods_peak_memory():
    def runs_peaking_at(peak_mib: float) -> dict[str, PredictRun]:
        record = RunRecord(0.5, 0.6, 10, 0, 0.0, peak_mib=peak_mib)
        return {"first": PredictRun(record, 0.6, []), "second": PredictRun(record, 0.6, [])}

    repeats = {"eager": [runs_peaking_at(193.0)], "callback": [runs_peaking_at(448.5)]}
    first, _ = predict_rows("vit_b_16/batch_8", 10, 80, repeats)
    assert (first["eager_peak_mib"], first["callback_peak_mib"]) == (193.0, 448.5)
    assert first["compile_peak_mib"] is None
    assert "peak MiB eager/callback 193/448" in describe(first)


def test_predict_rows_carry_each_methods_first_and_median_call():
    def timed_runs(first_call: float, median_call: float) -> dict[str, PredictRun]:
        record = RunRecord(0.5, 0.6, 10, 0, 0.0, first_call_s=first_call, median_call_s=median_call)
        return {"first": PredictRun(record, 0.6, []), "second": PredictRun(record, 0.6, [])}

    repeats = {"eager": [timed_runs(0.07, 0.05)], "callback": [timed_runs(0.3, 0.02)]}
    first, _ = predict_rows("vit_b_16/batch_8", 10, 80, repeats)
    assert (first["eager_first_call_s"], first["eager_median_call_s"]) == (0.07, 0.05)
    assert (first["callback_first_call_s"], first["callback_median_call_s"]) == (0.3, 0.02)
    assert first["compile_first_call_s"] is None
    assert "calls (first / median): eager 70.00 / 50.00 ms, callback 300.00 / 20.00 ms" in describe(
        first
    )


def test_the_markdown_table_names_each_workload_once_and_marks_what_did_not_run():
    first = {
        "workload": "vit_b_16/batch_8",
        "batches": 100,
        "run": "first",
        "eager_tower_s": 0.9,
        "callback_tower_s": 0.3,
        "compile_tower_s": 15.0,
        "vs_eager": 3.0,
        "vs_compile": 50.0,
        "graphs_captured": 1,
        "capture_s": 0.125,
        "callback_max_rel_diff": 0.0,
    }
    second = first | {
        "run": "second",
        "compile_tower_s": None,
        "vs_compile": None,
        "graphs_captured": 0,
        "capture_s": 0.0,
        "callback_max_rel_diff": 3.3e-3,
    }
    fit = {"workload": "fit/vit_b_16/batch_8", "batches": 250, "run": "epochs_1-5"}
    header, rule, *lines = markdown_table([first, second, fit]).splitlines()
    assert header.count("|") == rule.count("|") == 10
    assert lines == [
        "| vit_b_16/batch_8 (100) | first | 0.900 | 0.300 | 15.000 | 3.00x | 50.00x "
        "| 1 (0.12) | 0 |",
        "|  | second | 0.900 | 0.300 | - | 3.00x | - | 0 | 3.3e-03 |",
        "| fit/vit_b_16/batch_8 (250) | epochs 1-5 | - | - | - | - | - | 0 | - |",
    ]
