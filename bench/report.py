"""The benchmark's report: ratios, the JSON rows, the speed-up plot and the table."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``vs_eager`` (eager time / time: speed-up) and ``vs_exact`` (time / exact
    time: cost over the limit) from the rows of the same workload."""
    reference: dict[tuple[str, str], float] = {
        (row["workload"], row["method"]): row["ms_per_batch"]
        for row in rows
        if row["method"] in ("eager", "exact") and row["ms_per_batch"]
    }
    for row in rows:
        ms = row["ms_per_batch"]
        eager = reference.get((row["workload"], "eager"))
        exact = reference.get((row["workload"], "exact"))
        row["vs_eager"] = eager / ms if ms and eager else None
        row["vs_exact"] = ms / exact if ms and exact else None
    return rows


def write_json(rows: list[dict[str, Any]], path: Path, meta: Mapping[str, Any]) -> None:
    """The rows as a JSON list at ``path``; run metadata beside it as ``<stem>.meta.json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    path.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Bars of speed-up over eager per workload and method; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (render it later with from_json=[...])")
        return None
    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    speedups = {(row["workload"], row["method"]): row["vs_eager"] for row in rows}
    methods = list(
        dict.fromkeys(row["method"] for row in rows if row["method"] != "eager" and row["vs_eager"])
    )
    height = 0.8 / max(1, len(methods))
    # Horizontal bars: workload names read level however many rows a suite has.
    fig, ax = plt.subplots(figsize=(8.0, 1.5 + 0.22 * len(workloads) * max(1, len(methods))))
    for offset, method in enumerate(methods):
        values = [speedups.get((name, method)) or float("nan") for name in workloads]
        positions = [
            index + (offset - (len(methods) - 1) / 2) * height for index in range(len(workloads))
        ]
        ax.barh(positions, values, height, label=method)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(workloads)), workloads)
    ax.invert_yaxis()  # the first workload on top, as in the tables
    ax.set_xlabel("speed-up over eager (x)")
    devices = ", ".join(sorted({f"{row['device']} {row['dtype']}" for row in rows}))
    fig.suptitle(f"lightning-cg benchmark: {devices}")
    if methods:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


TABLE_COLUMNS = (
    ("workload", "workload"),
    ("method", "method"),
    ("ms_per_batch", "ms/batch"),
    ("images_per_s", "img/s"),
    ("vs_eager", "vs eager"),
    ("vs_exact", "vs exact"),
    ("padding_waste", "pad"),
    ("host_us_per_replay", "host us"),
    ("launch_us_per_replay", "launch us"),
    ("capture_s", "capture s"),
    ("total_s", "total s"),
    ("pool_bytes", "pool MiB"),
    ("peak_mem_bytes", "peak MiB"),
    ("status", "status"),
)


def format_table(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The printed table's cells: a header, then one line per row."""
    lines = [[title for _, title in TABLE_COLUMNS]]
    for row in rows:
        cells = []
        for key, _ in TABLE_COLUMNS:
            value = row.get(key)
            if key.endswith("_bytes") and value is not None:
                value = value / 2**20
            cells.append(
                format_value(value) if key not in ("workload", "method", "status") else value
            )
        lines.append(cells)
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    """The rows as a rich table (plain text without rich)."""
    header, *lines = format_table(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(line[i])) for line in [header, *lines]) for i in range(len(header))]
        for line in [header, *lines]:
            print(
                "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths, strict=True))
            )
        return
    table = Table(
        title="lightning-cg benchmark (vs eager: speed-up; vs exact: time over the limit)"
    )
    for index, title in enumerate(header):
        table.add_column(
            title, justify="left" if index < 2 or index == len(header) - 1 else "right"
        )
    for line in lines:
        table.add_row(*line)
    Console(width=200).print(table)


def format_value(value: Any) -> str:
    """A cell of the table: ``-`` for nothing, floats to 3 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def load_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of earlier runs, later files replacing rows of the same workload and method."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            rows[(row["workload"], row["method"])] = row
    return add_ratios(list(rows.values()))
