"""``--check``: what a workload's runs must show, or the benchmark stops.

After each workload (and run length) of a benchmark with ``--check``:

- graphs are kept across runs: the graphs the callback holds after a run are
  those it held before plus those the run captured. A later run may capture a
  key that earlier runs paid for in eager time (the capture rule), never one
  captured before;
- the callback's outputs equal eager's, batch
  by batch, within :func:`tolerance` of the precision: the relative difference
  is the norm of the difference over the norm of eager's output
  (:func:`~bench.trainer.rows.relative_differences`).

Each repeat's runs are checked against eager's runs of the same repeat. A
failed check raises :class:`SystemExit` with a message naming the workload,
the run and the value; a passed one gives one line, e.g.
``check ok: vit_b_16/batch_8 10 batches: graphs captured per run 1/0, largest
difference 0.0e+00``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bench.trainer.rows import relative_differences
from bench.trainer.runs import CALLBACK, EAGER, PredictRun

#: Relative tolerance of the callback's outputs per precision family; see :func:`tolerance`.
TOLERANCES = {"bf16": 2e-2, "16": 1e-2, "32": 1e-4, "64": 1e-4}
#: The Lightning precisions a benchmark runs, each of a family with a tolerance.
PRECISIONS = ("bf16-mixed", "bf16-true", "16-mixed", "16-true", "32-true", "64-true")


def tolerance(precision: str) -> float:
    """The relative difference allowed between the callback's and eager's outputs:
    2e-2 under bf16 (``bf16-mixed``, ``bf16-true``), 1e-2 under float16, 1e-4
    in float32 and float64 (``32-true``).

    Raises:
        ValueError: a precision of no known family.
    """
    family = str(precision).split("-")[0]
    if family not in TOLERANCES:
        raise ValueError(f"no check tolerance for precision {precision!r}; pass --check-tolerance")
    return TOLERANCES[family]


@dataclass
class CheckResult:
    """The check of one workload and run length.

    Attributes:
        failures: what failed, one message each (empty when the check passed).
        line: the line that reports it: ``check ok: ...`` or ``check failed: ...``.
    """

    failures: list[str]
    line: str

    @property
    def ok(self) -> bool:
        return not self.failures


def check_runs(
    workload: str,
    batches: int,
    repeats: Mapping[str, Sequence[Mapping[str, PredictRun]]],
    tol: float,
) -> CheckResult:
    """Check the callback's runs of one workload and run length.

    Args:
        workload: the workload's name, for the messages.
        batches: batches of each run, for the messages.
        repeats: per method, each repeat's runs (run name to run), as the
            suite gathers them for the rows.
        tol: the largest relative difference allowed per batch.
    """
    where = f"{workload} {batches} batches"
    callback_repeats = repeats.get(CALLBACK)
    if not callback_repeats:
        return CheckResult([], f"check skipped: {where}: the callback did not run")
    failures: list[str] = []
    captured: dict[str, int] = {}  # per run, the most graphs a repeat captured
    for index, runs in enumerate(callback_repeats):
        held = 0
        for name, run in runs.items():
            graphs = int(run.record.graphs_captured or 0)
            captured[name] = max(captured.get(name, 0), graphs)
            after = int(run.record.stats.get("graphs", held + graphs))
            if after != held + graphs:
                failures.append(
                    f"{where}, {_run(name, index, len(callback_repeats))}: the callback held "
                    f"{after} graphs after it, {held} before and captured {graphs}; graphs "
                    "must be kept across runs"
                )
            held = after
    largest, compared = 0.0, EAGER in repeats
    # Without eager there is nothing to compare: the zip is empty.
    eager_repeats = repeats.get(EAGER, [])
    for index, (runs, eager_runs) in enumerate(zip(callback_repeats, eager_repeats, strict=False)):
        for name, run in runs.items():
            expected = eager_runs[name].outputs
            if len(run.outputs) != len(expected):
                failures.append(
                    f"{where}, {_run(name, index, len(callback_repeats))}: the callback gave "
                    f"{len(run.outputs)} batches of outputs, eager {len(expected)}"
                )
                continue
            for batch, difference in enumerate(relative_differences(run.outputs, expected)):
                if not difference <= tol:  # NaN fails too
                    failures.append(
                        f"{where}, {_run(name, index, len(callback_repeats))}, batch {batch}: "
                        f"relative difference {difference:.1e} of the callback's outputs to "
                        f"eager's, above the tolerance {tol:.0e}"
                    )
                    break  # one batch per run says enough
                largest = max(largest, difference)
    if failures:
        return CheckResult(failures, "check failed: " + "; ".join(failures))
    parts = ["graphs captured per run " + "/".join(str(n) for n in captured.values())]
    if compared:
        parts.append(f"largest difference {largest:.1e}")
    else:
        parts.append("outputs not compared (eager did not run)")
    return CheckResult([], f"check ok: {where}: " + ", ".join(parts))


def _run(name: str, index: int, repeats: int) -> str:
    return f"{name} run" + (f" of repeat {index + 1}" if repeats > 1 else "")
