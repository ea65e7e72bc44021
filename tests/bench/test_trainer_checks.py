"""bench.trainer.checks: graphs are kept across runs, outputs equal eager's within the tolerance."""

import pytest
import torch

from bench.trainer.checks import check_runs, tolerance
from bench.trainer.module import RunRecord
from bench.trainer.runs import PredictRun


def run(captured: int, held: int, outputs: list[torch.Tensor]) -> PredictRun:
    record = RunRecord(0.1, 0.1, len(outputs), captured, 0.0, stats={"graphs": held})
    return PredictRun(record, 0.1, outputs)


def runs(
    captured: list[int], outputs: list[torch.Tensor], held: list[int] | None = None
) -> dict[str, PredictRun]:
    """Runs that captured ``captured`` graphs each, holding ``held`` after each
    (default: every graph captured so far)."""
    names = ("first", "second", "third")
    held = held or [sum(captured[: index + 1]) for index in range(len(captured))]
    return {
        name: run(graphs, after, outputs)
        for name, graphs, after in zip(names, captured, held, strict=False)
    }


OUTPUTS = [torch.ones(2, 4), torch.arange(8.0).reshape(2, 4)]


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("bf16-mixed", 2e-2),
        ("bf16-true", 2e-2),
        ("16-mixed", 1e-2),
        ("32-true", 1e-4),
        ("64", 1e-4),
    ],
)
def test_the_tolerance_follows_the_precision(precision, expected):
    assert tolerance(precision) == expected


def test_an_unknown_precision_has_no_tolerance():
    with pytest.raises(ValueError, match="--check-tolerance"):
        tolerance("transformer-engine")


def test_outputs_within_the_tolerance_pass_and_report_the_largest_difference():
    near = [output * (1 + 1e-3) for output in OUTPUTS]
    repeats = {"eager": [runs([0, 0], OUTPUTS)], "callback": [runs([3, 0], near)]}
    result = check_runs("vit_b_16/batch_8", 2, repeats, tol=2e-2)
    assert result.ok
    assert result.line == (
        "check ok: vit_b_16/batch_8 2 batches: graphs captured per run 3/0, "
        "largest difference 1.0e-03"
    )


def test_later_runs_may_capture_new_keys_but_must_keep_the_graphs_they_hold():
    repeats = {"eager": [runs([0, 0, 0], OUTPUTS)], "callback": [runs([2, 1, 1], OUTPUTS)]}
    result = check_runs("multiscale/resnet50/batch_16", 48, repeats, 2e-2)
    assert result.ok and "graphs captured per run 2/1/1, largest difference 0.0e+00" in result.line
    # The second run captured again the two graphs the first left it: they were lost.
    lost = {"eager": [runs([0, 0], OUTPUTS)], "callback": [runs([2, 2], OUTPUTS, held=[2, 2])]}
    result = check_runs("vit_b_16/batch_8", 2, lost, 2e-2)
    assert not result.ok
    assert "second run: the callback held 2 graphs after it, 2 before and captured 2" in result.line


def test_nan_outputs_and_missing_batches_fail():
    broken = [OUTPUTS[0], torch.full((2, 4), float("nan"))]
    repeats = {"eager": [runs([0, 0], OUTPUTS)], "callback": [runs([0, 0], broken)]}
    result = check_runs("vit_b_16/batch_8", 2, repeats, tol=2e-2)
    assert "first run, batch 1: relative difference nan" in result.line
    assert "second run, batch 1" in result.line
    short = {"eager": [runs([0, 0], OUTPUTS)], "callback": [runs([0, 0], OUTPUTS[:1])]}
    assert "the callback gave 1 batches of outputs, eager 2" in check_runs("w", 2, short, 1.0).line


def test_repeats_are_named_and_a_run_without_eager_is_not_compared():
    off = [output * 2 for output in OUTPUTS]
    repeats = {
        "eager": [runs([0, 0], OUTPUTS)] * 2,
        "callback": [runs([0, 0], OUTPUTS), runs([0, 0], off)],
    }
    assert "first run of repeat 2, batch 0" in check_runs("w", 2, repeats, 2e-2).line
    alone = check_runs("w", 2, {"callback": [runs([0, 0], off)]}, 2e-2)
    assert alone.ok and "outputs not compared (eager did not run)" in alone.line
    assert check_runs("w", 2, {"eager": [runs([0, 0], OUTPUTS)]}, 2e-2).line.startswith(
        "check skipped"
    )
