"""Compare two Trainer-suite result files of one GPU call: this library against a reference.

Both files come from ``scripts/bench_trainer.py`` run on the same workloads in the same
call (``scripts/device_run.sh`` writes ``NAME.json`` and ``NAME-baseline.json``). For each
row of the current file it prints both vs-eager ratios, their quotient, the graphs
captured and the callback seconds over the reference's, then checks the targets of a
change that must not slow users down:

- every row is at least ``--min-ratio`` (0.97) of the reference's vs-eager ratio;
- no first run is below ``--min-first`` (0.95x) eager;
- a predict workload's later runs capture nothing;
- a multi-scale workload holds a graph of each side by its third run, and each later run
  is at least ``--min-multiscale`` (1.8x) eager.

Exits 1 naming each missed target.

    python scripts/compare_trainer.py out/vit.json out/vit-baseline.json
    python scripts/compare_trainer.py benchmarks/h100-vs-0.1.0-current.json \
        benchmarks/h100-vs-0.1.0-reference.json --table     # BENCHMARKS.md's table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RUNS = ("first", "second", "third", "fourth")
SIDES = 4  # the multi-scale workload cycles through four image sides


def row_key(row: dict) -> tuple[str, int, str]:
    return row["workload"], row["batches"], row["run"]


def compare(current: list[dict], reference: list[dict], args: argparse.Namespace) -> list[str]:
    """Print one line per current row (``--table``: one Markdown table row); return the
    targets it misses."""
    reference_rows = {row_key(row): row for row in reference}
    missed = []
    if args.table:
        print(TABLE_HEADER)
    previous = None
    for row in current:
        old = reference_rows.get(row_key(row))
        if args.table:
            print(table_row(row, old, row["workload"] != previous))
            previous = row["workload"]
        name = "{} {} batches, {} run".format(*row_key(row))
        ratio, graphs = row["vs_eager"], row["callback_stats"]["graphs"]
        old_ratio = None if old is None else old["vs_eager"]
        quotient = None if old_ratio is None else ratio / old_ratio
        if not args.table:
            print(
                f"{name}: {ratio:.2f}x eager, reference "
                + ("-" if old_ratio is None else f"{old_ratio:.2f}x, {quotient:.2f} of it")
                + f"; {row['graphs_captured']} captured, {graphs:.0f} held"
                + callback_seconds(row, old)
            )
        missed += row_targets(row, name, quotient, args)
    return missed


TABLE_HEADER = """\
| workload (batches) | run | current | reference | vs-eager ratio | callback s ratio |
|---|---|---|---|---|---|"""


def table_row(row: dict, old: dict | None, first_of_workload: bool) -> str:
    """One row of BENCHMARKS.md's Trainer table: each engine's eager / callback seconds,
    speed-up and graphs captured, then the current over the reference."""
    name = f"{row['workload']} ({row['batches']})" if first_of_workload else ""
    cells = [name, row["run"], _engine_cell(row), "-", "-", "-"]
    if old is not None:
        cells[3] = _engine_cell(old)
        cells[4] = f"{row['vs_eager'] / old['vs_eager']:.2f}"
        cells[5] = f"{row['callback_tower_s'] / old['callback_tower_s']:.2f}"
    return "| " + " | ".join(cells) + " |"


def _engine_cell(row: dict) -> str:
    return (
        f"{row['eager_tower_s']:.3f} / {row['callback_tower_s']:.3f}, "
        f"{row['vs_eager']:.2f}x, {row['graphs_captured']}"
    )


def callback_seconds(row: dict, old: dict | None) -> str:
    """The callback's tower seconds over the reference's: unlike the vs-eager ratio, free
    of eager's own spread between the two processes."""
    seconds = row.get("callback_tower_s")
    old_seconds = None if old is None else old.get("callback_tower_s")
    if not seconds or not old_seconds:
        return ""
    return f"; callback {seconds:.3f} s, {seconds / old_seconds:.2f} of the reference's"


def row_targets(
    row: dict, name: str, quotient: float | None, args: argparse.Namespace
) -> list[str]:
    missed = []
    ratio, run = row["vs_eager"], row["run"]
    later = run in RUNS and RUNS.index(run) > 0
    multiscale = row["workload"].startswith("multiscale/")
    if quotient is not None and quotient < args.min_ratio:
        missed.append(f"{name}: {quotient:.2f} of the reference, below {args.min_ratio}")
    if run == "first" and ratio < args.min_first:
        missed.append(f"{name}: first run {ratio:.2f}x eager, below {args.min_first}x")
    if later and not multiscale and row["graphs_captured"]:
        missed.append(f"{name}: a later run captured {row['graphs_captured']} graphs")
    if multiscale and run in RUNS and RUNS.index(run) >= 2:
        if row["callback_stats"]["graphs"] < SIDES:
            missed.append(f"{name}: {row['callback_stats']['graphs']:.0f} graphs, not {SIDES}")
        if RUNS.index(run) >= 3 and ratio < args.min_multiscale:
            missed.append(f"{name}: {ratio:.2f}x eager, below {args.min_multiscale}x")
    return missed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("current", type=Path)
    parser.add_argument("reference", type=Path)
    parser.add_argument("--min-ratio", type=float, default=0.97)
    parser.add_argument("--min-first", type=float, default=0.95)
    parser.add_argument("--min-multiscale", type=float, default=1.8)
    parser.add_argument(
        "--table", action="store_true", help="print the rows as BENCHMARKS.md's Markdown table"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    current, reference = (json.loads(path.read_text()) for path in (args.current, args.reference))
    missed = compare(current, reference, args)
    for target in missed:
        print(f"MISSED {target}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
