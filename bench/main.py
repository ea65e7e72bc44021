"""The benchmark's entry point: every method on every workload, then the report.

Example:
    ``python scripts/bench.py quick=true workloads=[vit_b_16]``, or from Python
    ``main(OmegaConf.to_container(compose("bench", overrides)))``.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.methods import Method, expand_methods
from bench.report import (
    add_ratios,
    format_value,
    load_rows,
    plot_speedups,
    print_table,
    write_json,
)
from bench.settings import BenchSettings, resolve_settings
from bench.timing import empty_row, measure
from bench.workloads import STREAM, Workload, build_tower, stream_workload, tower_workloads

log = logging.getLogger(__name__)


def run_benchmarks(settings: BenchSettings) -> list[dict[str, Any]]:
    """Every configured method on every configured workload; rows with ratios.

    One tower is alive at a time; methods run one after another on its workloads.
    """
    rows = []
    methods = expand_methods(settings)
    for name in settings.workloads:
        tower_name = settings.stream["tower"] if name == STREAM else name
        tower = build_tower(tower_name, settings.sizes["towers"][tower_name], settings)
        if name == STREAM:
            workloads = [stream_workload(tower_name, tower, settings)]
        else:
            workloads = tower_workloads(tower_name, tower, settings)
        for workload in workloads:
            for method in methods:
                row = _measure_safely(method, tower, workload, settings)
                rows.append(row)
                log.info(
                    "%s %s: %s ms/batch (%s)",
                    row["workload"],
                    row["method"],
                    format_value(row["ms_per_batch"]),
                    row["status"],
                )
        del tower, workloads
        _free_memory()
    return add_ratios(rows)


def _measure_safely(
    method: Method, tower: nn.Module, workload: Workload, settings: BenchSettings
) -> dict[str, Any]:
    try:
        return measure(method, tower, workload, settings)
    except Exception as error:
        if settings.fail_fast:
            raise
        log.exception("%s %s failed", workload.name, method.name)
        row = empty_row(workload, method.name, settings)
        row["status"] = f"error: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return row
    finally:
        _free_memory()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict[str, Any]:
    """Versions and device of this process, for the ``.meta.json`` file."""
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "python": sys.version.split()[0],
        "argv": sys.argv,
    }


def main(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Run (or, with ``from_json``, re-render) the benchmark and write its report.

    Args:
        config: the fields of ``conf/bench.yaml`` as plain Python values.

    Returns:
        The rows written to ``config["output"]``.
    """
    sources = list(config.get("from_json") or [])
    if sources:
        rows = load_rows(sources)
        meta: dict[str, Any] = {"from_json": sources}
    else:
        settings = resolve_settings(config)
        rows = run_benchmarks(settings)
        meta = {**environment(), "config": dict(config)}
    output = Path(config["output"])
    write_json(rows, output, meta)
    plot = plot_speedups(rows, Path(config["plot"])) if config.get("plot") else None
    print_table(rows)
    log.info("wrote %s%s", output, f" and {plot}" if plot else "")
    return rows
