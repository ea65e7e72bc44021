"""The benchmark's settings: ``conf/bench.yaml`` resolved and checked as :class:`BenchSettings`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.methods import GRAPH_METHOD, METHODS, graph_config
from bench.workloads import BATCHED_TOWERS, PACKED_TOWERS, SCENARIOS, WORKLOADS
from lightning_cg.core.dispatcher import GraphMode

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class BenchSettings:
    """One run, resolved from ``conf/bench.yaml`` by :func:`resolve_settings`.

    Attributes:
        device: where towers and inputs live.
        dtype: towers and inputs are cast to it.
        seed: seeds the weights, the image sizes and the pixels.
        workloads: tower names and/or ``stream``, in run order.
        batch_sizes: batches of the batch-first towers.
        scenarios: packed-tower scenarios, names of :data:`SCENARIOS`.
        methods: ``eager``, ``lightning-cg``, ``exact``, ``compile`` (or any
            other name in :data:`METHODS`).
        modes: graph modes of the ``lightning-cg`` rows.
        skip_methods: methods reported as skipped instead of run.
        warmup: untimed passes before timing.
        repeats: timed passes; the median is reported.
        stream: the stream workload: ``tower``, ``shapes``, ``max_images``,
            ``warmup``, ``repeats``.
        sizes: tower constructor overrides and image side ranges.
        packed: batches per pass of the packed scenarios.
        manager: keyword arguments of the manager (budgets as dicts).
        profile: ``quick`` or ``full``, for the notes of skipped rows.
        fail_fast: raise the first error instead of recording it in its row.
    """

    device: torch.device
    dtype: torch.dtype
    seed: int
    workloads: list[str]
    batch_sizes: list[int]
    scenarios: list[str]
    methods: list[str]
    modes: list[str]
    skip_methods: list[str]
    warmup: int
    repeats: int
    stream: dict[str, Any]
    sizes: dict[str, Any]
    packed: dict[str, int]
    manager: dict[str, Any]
    profile: str = "full"
    fail_fast: bool = False


def resolve_settings(config: Mapping[str, Any]) -> BenchSettings:
    """Apply the profile (``quick``) and ``tiny`` to a plain config dict and check it.

    Fields left null take the value of ``profiles.quick`` or ``profiles.full``;
    ``tiny=true`` takes ``tiny_sizes`` instead of ``sizes``.

    Raises:
        ValueError: a field has a value outside what it allows; the message names it.
    """
    profile = "quick" if _flag(config, "quick") else "full"
    defaults = config["profiles"][profile]

    def pick(name: str) -> Any:
        value = config.get(name)
        return defaults[name] if value is None else value

    settings = BenchSettings(
        device=_resolve_device(config["device"]),
        dtype=_choice("dtype", config["dtype"], DTYPES),
        seed=_integer("seed", config["seed"]),
        workloads=list(pick("workloads")),
        batch_sizes=[_integer("batch_sizes[]", size) for size in pick("batch_sizes")],
        scenarios=list(pick("scenarios")),
        methods=list(config["methods"]),
        modes=list(config["modes"]),
        skip_methods=list(pick("skip_methods")),
        warmup=_integer("warmup", pick("warmup")),
        repeats=_integer("repeats", pick("repeats")),
        stream=dict(config["stream"]),
        sizes=dict(config["tiny_sizes"] if _flag(config, "tiny") else config["sizes"]),
        packed=dict(config["packed"]),
        manager=dict(config["manager"]),
        profile=profile,
        fail_fast=_flag(config, "fail_fast"),
    )
    _check(settings)
    return settings


def _check(settings: BenchSettings) -> None:
    _check_names("workloads", settings.workloads, WORKLOADS)
    _check_names("scenarios", settings.scenarios, tuple(SCENARIOS))
    _check_names("methods", settings.methods, (*METHODS, GRAPH_METHOD))
    _check_names("skip_methods", settings.skip_methods, (*METHODS, GRAPH_METHOD))
    _check_names("stream.tower", [settings.stream["tower"]], (*BATCHED_TOWERS, *PACKED_TOWERS))
    _check_names("modes", settings.modes, tuple(mode.value for mode in GraphMode))
    if settings.warmup < 0 or settings.repeats < 1:
        raise ValueError(
            f"need warmup >= 0 and repeats >= 1; got warmup={settings.warmup}, "
            f"repeats={settings.repeats}"
        )
    if any(size < 1 for size in settings.batch_sizes):
        raise ValueError(f"batch_sizes must be positive; got {settings.batch_sizes}")
    stream = settings.stream
    if min(stream["shapes"], stream["repeats"], stream["max_images"]) < 1:
        raise ValueError(
            "stream.shapes, stream.repeats and stream.max_images must be >= 1; got "
            f"{stream['shapes']}, {stream['repeats']}, {stream['max_images']}"
        )
    graph_config(settings.manager, "full")


def _flag(config: Mapping[str, Any], name: str) -> bool:
    value = config.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {name}={value!r}")
    return value


def _integer(name: str, value: Any) -> int:
    # int() would truncate 1.5 and take True as 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer; got {name}={value!r}")
    return value


def _check_names(field_name: str, names: Sequence[str], allowed: Sequence[str]) -> None:
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"{field_name} has unknown {unknown}; allowed: {', '.join(allowed)}")


def _choice(field_name: str, value: str, allowed: Mapping[str, Any]) -> Any:
    if value not in allowed:
        raise ValueError(f"{field_name} is {value!r}; allowed: {', '.join(allowed)}")
    return allowed[value]


def _resolve_device(name: str) -> torch.device:
    _choice("device", name, {"auto": None, "cuda": None, "cpu": None})
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available; use device=auto or cpu")
    return torch.device(name)
