"""Rows of the Trainer benchmark: built from runs, merged into a JSON file, printed.

A row holds every method's figures for one workload, run length and run:
``{"workload", "batches", "run", "eager_tower_s", "callback_tower_s",
"vs_eager", "graphs_captured", "capture_s"}`` and extra fields (see
:data:`EXTRA_KEYS`; fit rows :data:`FIT_KEYS` too, multiscale rows ``sides``:
the image sides their batches cycle through, in order). Ratios are speed-ups of
the callback: ``vs_eager`` is eager tower seconds over the callback's,
``vs_compile`` compiled over the callback's; above 1 the callback is faster.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.trainer.module import RunRecord
from bench.trainer.runs import CALLBACK, COMPILE, EAGER, PredictRun

ROW_KEYS = (
    "workload",
    "batches",
    "run",
    "eager_tower_s",
    "callback_tower_s",
    "vs_eager",
    "graphs_captured",
    "capture_s",
)
#: Extra fields, None where a method did not run.
EXTRA_KEYS = (
    "trainer",  # predict rows: "reused" (the first run's Trainer) or "fresh" (a new one)
    "compile_tower_s",
    "vs_compile",
    "eager_wall_s",  # predict: around trainer.predict; fit: the validation runs
    "callback_wall_s",
    "compile_wall_s",
    "callback_max_abs_diff",  # largest |output - eager output| of the run
    "compile_max_abs_diff",
    "callback_max_rel_diff",  # largest |output - eager output| / |eager output| of a batch
    "compile_max_rel_diff",
    "callback_replays",  # graph replays of the run (callback_stats' hits)
    "images",
    "callback_stats",  # callback.last_stats after the run (fit: after the last epoch)
    "repeats",  # predict rows: times each method ran the pair of runs; figures of the median
    "eager_tower_s_repeats",  # every repeat's tower seconds, in order
    "callback_tower_s_repeats",
    "compile_tower_s_repeats",
    # predict rows: the run's first tower call, and its median call (per method)
    "eager_first_call_s",
    "callback_first_call_s",
    "compile_first_call_s",
    "eager_median_call_s",
    "callback_median_call_s",
    "compile_median_call_s",
    # predict rows: peak device memory allocated during the run, MiB (CUDA only)
    "eager_peak_mib",
    "callback_peak_mib",
    "compile_peak_mib",
)
#: Extra fields of fit rows: per-epoch figures and the whole fit's wall time.
FIT_KEYS = (
    "epochs",
    "val_batches_per_epoch",
    "eager_epoch_tower_s",
    "callback_epoch_tower_s",
    "callback_epoch_graphs_captured",
    "eager_fit_wall_s",
    "callback_fit_wall_s",
    "eager_train_peak_mib",
    "callback_train_peak_mib",
)
_ROW_ID = ("workload", "batches", "run", "trainer")
_RUNS = {
    "first": ("first", "reused"),
    "second": ("second", "reused"),
    "second_fresh": ("second", "fresh"),
    "third": ("third", "reused"),
    "fourth": ("fourth", "reused"),
}


def predict_rows(
    workload: str,
    batches: int,
    images: int,
    repeats: Mapping[str, Sequence[Mapping[str, PredictRun]]],
) -> list[dict[str, Any]]:
    """One row per run name (``first``, ``second``, ...), from each method's
    median repeat (:func:`median_runs`); with more than one repeat, the row
    lists every repeat's seconds too (:func:`repeat_fields`).

    Args:
        workload: the workload's name.
        batches: batches of each run.
        images: images of each run.
        repeats: per method, what :func:`~bench.trainer.runs.predict_runs`
            returned, once per repeat.
    """
    results = {method: median_runs(runs) for method, runs in repeats.items()}
    several = len(next(iter(repeats.values()))) > 1
    rows = []
    for name in next(iter(results.values())):
        run, trainer = _RUNS[name]
        by_method = {method: runs[name] for method, runs in results.items()}
        row = _predict_row(_empty_row(workload, batches, run), by_method)
        row |= {"trainer": trainer, "images": images}
        rows.append(row | repeat_fields(repeats, name) if several else row)
    return rows


def multiscale_rows(
    workload: str,
    batches: int,
    images: int,
    sides: Sequence[int],
    repeats: Mapping[str, Sequence[Mapping[str, PredictRun]]],
) -> list[dict[str, Any]]:
    """The rows of a multiscale workload, one per validation run (``first``,
    ``second``, ``third``): :func:`predict_rows` of the runs of
    :func:`~bench.trainer.runs.validate_runs`, with the sides its batches cycle through.
    """
    rows = predict_rows(workload, batches, images, repeats)
    return [row | {"sides": list(sides)} for row in rows]


def median_runs(repeats: Sequence[Mapping[str, PredictRun]]) -> dict[str, PredictRun]:
    """Per run name, the repeat whose tower seconds are the median (the lower of the
    two middle ones for an even count): its record, outputs and capture figures
    stand for the run.

    Args:
        repeats: what :func:`~bench.trainer.runs.predict_runs` returned, once per repeat.
    """
    chosen = {}
    for name in repeats[0]:
        runs = sorted((runs[name] for runs in repeats), key=lambda run: run.record.tower_s)
        chosen[name] = runs[(len(runs) - 1) // 2]
    return chosen


def repeat_fields(repeats: Mapping[str, Sequence[Mapping[str, PredictRun]]], name: str) -> dict:
    """The ``repeats`` fields of run ``name``'s row: per method, every repeat's tower seconds."""
    fields: dict[str, Any] = {"repeats": len(next(iter(repeats.values())))}
    for method, runs in repeats.items():
        fields[f"{method}_tower_s_repeats"] = [run[name].record.tower_s for run in runs]
    return fields


def _predict_row(row: dict[str, Any], by_method: Mapping[str, PredictRun]) -> dict[str, Any]:
    eager, callback = by_method.get(EAGER), by_method.get(CALLBACK)
    for method, result in by_method.items():
        row[f"{method}_tower_s"] = result.record.tower_s
        row[f"{method}_wall_s"] = result.call_s
        row[f"{method}_first_call_s"] = result.record.first_call_s
        row[f"{method}_median_call_s"] = result.record.median_call_s
        row[f"{method}_peak_mib"] = result.record.peak_mib
        if eager is not None and method != EAGER:
            row[f"{method}_max_abs_diff"] = max_abs_difference(result.outputs, eager.outputs)
            row[f"{method}_max_rel_diff"] = max(
                relative_differences(result.outputs, eager.outputs), default=0.0
            )
    if callback is not None:
        _add_capture(row, callback.record)
    return with_ratios(row)


def fit_row(
    workload: str,
    images: int,
    epochs: int,
    val_batches: int,
    results: Mapping[str, tuple[Sequence[RunRecord], float, Sequence[float]]],
) -> dict[str, Any]:
    """The row of a fit: validation tower time summed over the epochs, and each training
    epoch's peak memory allocated, per method.

    Args:
        workload: the fit workload's name.
        images: validation images per epoch.
        epochs: epochs of the fit.
        val_batches: validation batches per epoch.
        results: per method, the validation runs' records, the fit's wall time and the
            training epochs' peak memory allocated (MiB).
    """
    row = _empty_row(workload, epochs * val_batches, f"epochs_1-{epochs}")
    row.update(
        dict.fromkeys(FIT_KEYS),
        epochs=epochs,
        val_batches_per_epoch=val_batches,
        images=epochs * images,
    )
    for method, (records, fit_s, train_peaks) in results.items():
        row[f"{method}_train_peak_mib"] = list(train_peaks)
        row[f"{method}_tower_s"] = sum(record.tower_s for record in records)
        row[f"{method}_wall_s"] = sum(record.wall_s for record in records)
        row[f"{method}_epoch_tower_s"] = [record.tower_s for record in records]
        row[f"{method}_fit_wall_s"] = fit_s
    if CALLBACK in results:
        records = results[CALLBACK][0]
        row["callback_epoch_graphs_captured"] = [record.graphs_captured for record in records]
        row["callback_stats"] = records[-1].stats
        row["graphs_captured"] = sum(record.graphs_captured for record in records)
        row["capture_s"] = sum(record.capture_s for record in records)
        row["callback_replays"] = sum(int(record.stats.get("hits", 0)) for record in records)
    return with_ratios(row)


def _empty_row(workload: str, batches: int, run: str) -> dict[str, Any]:
    row = dict.fromkeys((*ROW_KEYS, *EXTRA_KEYS))
    row.update(workload=workload, batches=batches, run=run)
    return row


def _add_capture(row: dict[str, Any], record: RunRecord) -> None:
    row["graphs_captured"], row["capture_s"] = record.graphs_captured, record.capture_s
    row["callback_stats"] = record.stats
    if "hits" in record.stats:
        row["callback_replays"] = int(record.stats["hits"])


def with_ratios(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``vs_eager`` and ``vs_compile`` recomputed from its tower seconds."""
    callback = row.get("callback_tower_s")
    for key, other in (("vs_eager", "eager_tower_s"), ("vs_compile", "compile_tower_s")):
        value = row.get(other)
        row[key] = value / callback if callback and value is not None else None
    return row


def max_abs_difference(outputs: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> float:
    """Largest absolute difference between two runs' outputs, batch by batch."""
    if len(outputs) != len(expected):
        raise ValueError(f"runs gave {len(outputs)} and {len(expected)} batches of outputs")
    return max(
        (
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(outputs, expected, strict=True)
        ),
        default=0.0,
    )


def relative_differences(
    outputs: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
) -> list[float]:
    """Per batch, the norm of ``output - expected`` over the norm of ``expected``
    (the difference's norm itself where ``expected`` is all zeros)."""
    if len(outputs) != len(expected):
        raise ValueError(f"runs gave {len(outputs)} and {len(expected)} batches of outputs")
    differences = []
    for output, reference in zip(outputs, expected, strict=True):
        if output.shape != reference.shape:
            differences.append(float("inf"))
            continue
        reference = reference.double()
        norm = torch.linalg.vector_norm(output.double() - reference).item()
        scale = torch.linalg.vector_norm(reference).item()
        differences.append(norm / scale if scale > 0 else norm)
    return differences


def merge_rows(
    rows: Iterable[Mapping[str, Any]], new_rows: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """``rows`` with ``new_rows`` merged in, in first-seen order.

    A new row of the same workload, batches, run and trainer as an old one
    replaces the fields it has a value for (the methods it ran); the ratios are
    then recomputed. A new row of another key is appended.
    """
    merged = {_row_id(row): dict(row) for row in rows}
    for row in new_rows:
        old = merged.get(_row_id(row))
        if old is None:
            merged[_row_id(row)] = dict(row)
        else:
            old.update({key: value for key, value in row.items() if value is not None})
            with_ratios(old)
    return list(merged.values())


def _row_id(row: Mapping[str, Any]) -> tuple:
    return tuple(row.get(key) for key in _ROW_ID)


def read_rows(path: Path, check: bool = False) -> list[dict[str, Any]]:
    """The rows of a JSON file, or none if it does not exist.

    Raises:
        ValueError: with ``check``, a row lacks one of :data:`ROW_KEYS`.
    """
    rows = json.loads(path.read_text()) if path.exists() else []
    for row in rows if check else []:
        missing = [key for key in ROW_KEYS if key not in row]
        if missing:
            raise ValueError(f"{path} holds a row without {missing}: {str(row)[:200]}")
    return rows


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def describe(row: Mapping[str, Any]) -> str:
    """One line of a row: tower seconds per method, speed-ups, capture."""
    parts = [f"{row['workload']} {row['batches']} batches, {row['run']} run"]
    if row.get("trainer"):
        parts[0] += f" ({row['trainer']} trainer)"
    for method in (EAGER, CALLBACK, COMPILE):
        seconds = row.get(f"{method}_tower_s")
        if seconds is not None:
            parts.append(f"{method} {seconds:.3f} s")
    for key in ("vs_eager", "vs_compile"):
        if row.get(key) is not None:
            parts.append(f"{key} {row[key]:.2f}x")
    calls = [_calls_ms(row, method) for method in (EAGER, CALLBACK, COMPILE)]
    if any(calls):
        parts.append("calls (first / median): " + ", ".join(filter(None, calls)))
    peaks = [row.get(f"{method}_peak_mib") for method in (EAGER, CALLBACK)]
    if all(peaks):
        parts.append("peak MiB eager/callback {:.0f}/{:.0f}".format(*peaks))
    if row.get("graphs_captured") is not None:
        parts.append(f"{row['graphs_captured']:.0f} graphs, {row['capture_s']:.2f} s capture")
        compiling = (row.get("callback_stats") or {}).get("compile_seconds_run")
        if compiling:
            parts[-1] += f" ({compiling:.2f} s of it compiling)"
    if row.get("callback_replays") is not None:
        parts.append(f"{row['callback_replays']} replays")
    if row.get("sides"):
        parts.append("sides " + "/".join(str(side) for side in row["sides"]))
    if row.get("callback_epoch_tower_s"):
        epochs = [f"{s * 1000:.0f}" for s in row["callback_epoch_tower_s"]]
        parts.append("callback epochs ms " + "/".join(epochs))
    peaks = [row.get(f"{method}_train_peak_mib") for method in (EAGER, CALLBACK)]
    if all(peaks):
        parts.append(
            "training peak MiB eager/callback "
            + ", ".join(f"{e:.0f}/{c:.0f}" for e, c in zip(*peaks, strict=True))
        )
    return "; ".join(parts)


def _calls_ms(row: Mapping[str, Any], method: str) -> str | None:
    """``method``'s first and median tower call in a row, in milliseconds, or None."""
    first, median = row.get(f"{method}_first_call_s"), row.get(f"{method}_median_call_s")
    if first is None or median is None:
        return None
    return f"{method} {first * 1e3:.2f} / {median * 1e3:.2f} ms"


#: The columns of :func:`markdown_table`.
TABLE_HEADER = (
    "| workload (batches) | run | eager s | callback s | reduce-overhead s | vs eager "
    "| vs reduce-overhead | graphs (capture s) | rel. diff |"
)


def markdown_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """The rows as BENCHMARKS.md's Trainer table: one line per run, the workload named
    on its first; ``-`` where a method did not run."""
    lines = [TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    previous = None
    for row in rows:
        workload = row["workload"]
        name = f"{workload} ({row['batches']})" if workload != previous else ""
        previous = workload
        captured = row.get("graphs_captured") or 0
        cells = [
            name,
            row["run"].replace("_", " "),  # epochs_1-5: the epochs a fit row sums
            *(_seconds(row.get(f"{method}_tower_s")) for method in (EAGER, CALLBACK, COMPILE)),
            _ratio(row.get("vs_eager")),
            _ratio(row.get("vs_compile")),
            f"{captured:.0f} ({row['capture_s']:.2f})" if captured else "0",
            _difference(row.get("callback_max_rel_diff")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _difference(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.1e}"


def speedup_bars(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows as :func:`bench.report.plot_speedups` draws them: per workload, batches
    and run, the callback's and torch.compile's speed-up over eager."""
    bars = []
    for row in rows:
        name = f"{row['workload']} {row['batches'] or ''} {row['run']}".replace("  ", " ")
        eager, compiled = row.get("eager_tower_s"), row.get("compile_tower_s")
        for method, speedup in (
            ("lightning-cg", row.get("vs_eager")),
            ("torch.compile reduce-overhead", eager / compiled if eager and compiled else None),
        ):
            bars.append(
                {
                    "workload": name,
                    "method": method,
                    "vs_eager": speedup,
                    "device": "Trainer",
                    "dtype": "tower seconds per run",
                }
            )
    return bars
