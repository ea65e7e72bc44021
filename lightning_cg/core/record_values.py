"""Key records and path costs as plain values (a plan's JSON), and back, checked."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from lightning_cg.core.key_records import PATH_SAMPLES, SAMPLES, KeyRecord, PathCosts


def record_values(record: KeyRecord) -> dict[str, Any]:
    """``record`` as plain values (what :func:`record_from_values` reads)."""
    return {
        "path": record.path,
        "size": record.size,
        "sightings": record.sightings,
        "real_tokens": record.real_tokens,
        "eager_spent": record.eager_spent,
        "eager_seconds_per_token": list(record.eager_seconds_per_token),
        "graph_seconds": list(record.graph_seconds),
        "capture_ratio": record.capture_ratio,
        "capture_seconds": record.capture_seconds,
    }


def record_from_values(values: Mapping[str, Any]) -> KeyRecord:
    """The record :func:`record_values` gave; a ValueError names a missing or bad field."""
    record = KeyRecord(
        path=_value(values, "path", str),
        size=_value(values, "size", int, least=1),
        sightings=_value(values, "sightings", int),
        real_tokens=_value(values, "real_tokens", int),
        eager_spent=_value(values, "eager_spent", float),
        eager_seconds_per_token=_samples(values, "eager_seconds_per_token"),
        graph_seconds=_samples(values, "graph_seconds"),
        capture_ratio=_value(values, "capture_ratio", float, none_ok=True),
        capture_seconds=_value(values, "capture_seconds", float, none_ok=True),
    )
    if record.eager_seconds_per_token:
        record.median_eager_per_token = statistics.median(record.eager_seconds_per_token)
    if record.graph_seconds:
        record.graph = statistics.median(record.graph_seconds)
    return record


def path_costs_values(costs: PathCosts) -> dict[str, Any]:
    """A path's eager calls and token counts as plain values."""
    return {
        "eager_calls": [[tokens, seconds] for tokens, seconds in costs.eager_calls],
        "token_counts": sorted(costs.token_counts),
    }


def path_costs_from_values(values: Mapping[str, Any]) -> PathCosts:
    """The path costs :func:`path_costs_values` gave; a ValueError names a bad field."""
    costs = PathCosts()
    calls = _value(values, "eager_calls", list)
    if len(calls) > PATH_SAMPLES:
        raise ValueError(f"eager_calls holds {len(calls)} calls, more than {PATH_SAMPLES}")
    for index, call in enumerate(calls):
        if not isinstance(call, list | tuple) or len(call) != 2:
            raise ValueError(f"eager_calls[{index}] must be [tokens, seconds]; got {call!r}")
        pair = dict(zip(("tokens", "seconds"), call, strict=True))
        costs.add_call(_value(pair, "tokens", int), _value(pair, "seconds", float))
    counts = _value(values, "token_counts", list)
    costs.token_counts = {_value({"token_counts": n}, "token_counts", int) for n in counts}
    return costs


def _samples(values: Mapping[str, Any], name: str) -> list[float]:
    samples = _value(values, name, list)
    if len(samples) > SAMPLES:
        raise ValueError(f"{name} holds {len(samples)} samples, more than {SAMPLES}")
    return [_value({name: sample}, name, float) for sample in samples]


def _value(
    values: Mapping[str, Any], name: str, kind: type, least: int = 0, none_ok: bool = False
) -> Any:
    """``values[name]`` if it is a ``kind`` (a finite number at least ``least``)."""
    if name not in values:
        raise ValueError(f"{name} is missing")
    value = values[name]
    if value is None and none_ok:
        return None
    number = kind in (int, float)
    kinds = (int, float) if kind is float else kind
    if (
        not isinstance(value, kinds)
        or isinstance(value, bool)
        or (number and not (math.isfinite(value) and value >= least))
    ):
        allowed = f"a finite number >= {least}" if number else f"a {kind.__name__}"
        raise ValueError(f"{name} must be {allowed}; got {name}={value!r}")
    return float(value) if kind is float else value
