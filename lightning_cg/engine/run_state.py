"""What a manager's capture rule learned, as plain values that outlive the process.

:class:`RunState` reads it from the manager's
:class:`~lightning_cg.engine.state.EngineState` (``state_dict``): the capture policy's
records by key identity, the keys sent to eager and why, the faults that changed paths'
plans, and the fingerprint of what was measured. A state of another fingerprint, or one
that cannot be read, is ignored with one warning. Loaded records join the policy when
their key is first sighted (keys hold adapter signatures, which only a call rebuilds).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_cg.core.key_records import KeyRecord
from lightning_cg.core.record_values import (
    path_costs_from_values,
    record_from_values,
    record_values,
)
from lightning_cg.engine.cache import GraphKey
from lightning_cg.engine.encoder import GraphableEncoder
from lightning_cg.engine.routing import Router
from lightning_cg.engine.state import EngineState

#: The layout of a state; another one is ignored.
FORMAT = 1
#: Why a key runs eagerly for good: its graph differed from eager, or was slower.
REPLAY_DIFFERS, MEASURED_SLOWER = "replay_differs", "measured_slower"
#: Why a checked replay sent a key to eager for good: the router's reasons.
CHECK_VERDICTS = (REPLAY_DIFFERS, "changes_state")
#: What a fingerprint's fields name, for the warning of a state that does not match.
FINGERPRINT_FIELDS = {
    "tower": "tower class",
    "parameters": "parameter shapes and dtypes (hash)",
    "adapter": "adapter",
    "compile": "compiled capture",
    "torch": "torch version",
    "device": "device",
}


class UnstableIdentity(ValueError):
    """A part of a key whose text may differ from one process to the next."""


def key_identity(key: GraphKey) -> str | None:
    """A text of ``key`` that the same key has in any process: its graph set (adapter
    signature, autocast state), path and descriptor. A device is written without its
    index (ranks serve one key each on their own device). None: a part of the key (an
    object without a ``repr`` of its own) has no stable text."""
    try:
        return _stable_text(key)
    except UnstableIdentity:
        return None


def _stable_text(value: Any) -> str:
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"device({value.type!r})"
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = (
            f"{f.name}={_stable_text(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if f.repr
        )
        return f"{type(value).__qualname__}({', '.join(parts)})"
    if isinstance(value, tuple | list):
        parts = [_stable_text(part) for part in value]
        if isinstance(value, list):
            return f"[{', '.join(parts)}]"
        return f"({parts[0]},)" if len(parts) == 1 else f"({', '.join(parts)})"
    if isinstance(value, frozenset | set):
        return f"{{{', '.join(sorted(_stable_text(part) for part in value))}}}"
    if type(value).__repr__ is object.__repr__:
        raise UnstableIdentity(f"{type(value).__qualname__} has no repr of its own")
    return repr(value)


def fingerprint(tower: nn.Module | None, adapter: GraphableEncoder, compiled: bool) -> dict:
    """What a state's timings were measured with: tower class, a hash of its parameters'
    names, shapes and dtypes, adapter class, compiled capture, torch version, device."""
    parameters = list(tower.named_parameters()) if tower is not None else []
    digest = hashlib.sha256()
    for name, parameter in parameters:
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
    device = parameters[0][1].device if parameters else None
    return {
        "tower": _qualified_name(type(tower if tower is not None else adapter)),
        "parameters": digest.hexdigest()[:16],
        "adapter": _qualified_name(type(adapter)),
        "compile": compiled,
        "torch": str(torch.__version__),  # a str subclass, which a weights-only load refuses
        "device": _device_name(device),
    }


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _device_name(device: torch.device | None) -> str:
    if device is None:
        return "none (no parameters)"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def read_plan(path: str | os.PathLike) -> Any:
    """The state in the JSON file ``path``; None (with a warning if it exists but cannot
    be read as JSON) when there is none."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError) as error:
        _warn(f"ignoring the plan of file {os.fspath(path)!r}: it cannot be read ({error})")
        return None


def write_plan(path: str | os.PathLike, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` as JSON, atomically (a temporary file, then a rename); a
    failure warns and leaves an earlier file as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=folder, suffix=".tmp", delete=False, encoding="utf-8"
        ) as file:
            temporary = file.name
            json.dump(state, file, indent=1, allow_nan=False)
        os.replace(temporary, path)
    except (OSError, ValueError) as error:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
        _warn(f"cannot write plan {os.fspath(path)!r} ({error}); this run's learning is not saved")


@dataclasses.dataclass
class _Loaded:
    """A state read and checked, before anything is applied."""

    fingerprint: dict
    calls: int
    paths: dict
    records: dict[str, KeyRecord]
    eager_keys: dict[str, str]
    faults: dict[str, tuple[str | None, int | None]]


class RunState:
    """Gathers and restores what one manager's capture rule learned.

    Args:
        tower: the module whose parameters the fingerprint hashes (None: the adapter's class).
        adapter: the adapter (not its compiling wrapper).
    """

    def __init__(
        self,
        state: EngineState,
        router: Router,
        tower: nn.Module | None,
        adapter: GraphableEncoder,
        compiled: bool,
    ) -> None:
        self._state = state
        self._router = router
        self._tower = tower
        self._adapter = adapter
        self._compiled = compiled
        #: Each path's largest budget as planned: a smaller one was dropped for memory.
        self._planned_tops = {path: plan.budgets[-1] for path, plan in state.plan.paths.items()}
        #: Loaded records and eager keys whose key has not been sighted yet, by identity.
        self._records: dict[str, KeyRecord] = {}
        self._eager_keys: dict[str, str] = {}
        #: The fingerprint at the last run's start, where the tower sits on its device.
        self._fingerprint: dict | None = None

    def begin_run(self) -> None:
        """Note what this run measures with."""
        self._fingerprint = self._current_fingerprint()

    def forget_graphs(self) -> None:
        """The graphs are gone and their timings no longer hold (as the policy's)."""
        for record in self._records.values():
            record.graph_seconds.clear()
            record.graph = None
            record.capture_ratio = None

    def state_dict(self) -> dict[str, Any]:
        """What the capture rule learned, in JSON's types (see :class:`RunState`)."""
        learned = self._state.policy.export_state(key_identity)
        keys = {name: record_values(r) for name, r in self._records.items()} | learned["keys"]
        eager_keys = dict(self._eager_keys)
        for key, reason in self._state.eager_keys.items():
            if (name := key_identity(key)) is not None:
                eager_keys[name] = reason
        for name in learned["slower"]:
            eager_keys.setdefault(name, MEASURED_SLOWER)
        return {
            "format": FORMAT,
            "fingerprint": self._fingerprint or self._current_fingerprint(),
            "calls": learned["calls"],
            "paths": learned["paths"],
            "keys": keys,
            "eager_keys": eager_keys,
            "faults": self._faults(),
        }

    def load_state_dict(self, state: Any, source: str) -> bool:
        """Take ``state`` (from :meth:`state_dict`, read from ``source``) if it was measured
        with this tower, adapter, torch and device; whether it was taken. One that cannot be
        read or does not match warns once and changes nothing. What this manager already
        learned wins over the state."""
        try:
            loaded = _parse(state)
        except (KeyError, TypeError, ValueError) as error:
            why = f"it has no field {error}" if isinstance(error, KeyError) else str(error)
            _warn(f"ignoring the plan of {source}: it cannot be read ({why})")
            return False
        differences = self._differences(loaded.fingerprint)
        if differences:
            _warn(
                f"ignoring the plan of {source}: it was measured with another "
                f"{'; another '.join(differences)}. Every key is learned anew"
            )
            return False
        self._state.policy.import_state(loaded.calls, loaded.paths)
        for name, record in loaded.records.items():
            self._records.setdefault(name, record)
        for name, reason in loaded.eager_keys.items():
            self._eager_keys.setdefault(name, reason)
        self._apply_faults(loaded.faults, source)
        if self._records or self._eager_keys:
            self._router.on_first_sighting = self._adopt
        return True

    def _adopt(self, key: GraphKey) -> None:
        """``key``'s loaded record and eager verdict, at its first sighting."""
        name = key_identity(key)
        record = self._records.pop(name, None)
        if record is not None:
            self._state.policy.import_record(key, record)
        if (reason := self._eager_keys.pop(name, None)) in CHECK_VERDICTS:
            self._router.serve_eagerly(key, reason)
        if not self._records and not self._eager_keys:
            self._router.on_first_sighting = None

    def _current_fingerprint(self) -> dict:
        return fingerprint(self._tower, self._adapter, self._compiled)

    def _differences(self, saved: Mapping[str, Any]) -> list[str]:
        current = self._current_fingerprint()
        return [
            f"{what}: {saved.get(field)!r} there, {current[field]!r} here"
            for field, what in FINGERPRINT_FIELDS.items()
            if saved.get(field) != current[field]
        ]

    def _faults(self) -> dict[str, dict[str, Any]]:
        """The paths a capture fault made eager, or whose larger budgets ran out of memory."""
        faults = {}
        for path, plan in self._state.plan.paths.items():
            top = plan.budgets[-1]
            if plan.eager_reason is not None or top < self._planned_tops[path]:
                dropped = top < self._planned_tops[path]
                faults[path] = {
                    "eager_reason": plan.eager_reason,
                    "max_budget": top if dropped else None,
                }
        return faults

    def _apply_faults(self, faults: Mapping[str, tuple], source: str) -> None:
        applied = []
        for path, (eager_reason, max_budget) in faults.items():
            plan = self._state.plan.paths.get(path)
            if plan is None or plan.eager_reason is not None:
                continue
            if eager_reason is not None:
                plan = plan.eager(eager_reason)
                self._state.cache.drop([path])
                applied.append(f"path {path!r} runs eagerly ({eager_reason})")
            elif max_budget is not None and plan.budgets[-1] > max_budget:
                dropped = min(budget for budget in plan.budgets if budget > max_budget)
                plan = plan.below(dropped)
                self._state.cache.drop([path], from_budget=dropped)
                applied.append(f"path {path!r} keeps budgets up to {max_budget} (out of memory)")
            else:
                continue
            self._state.update(path, plan)
        if applied:
            _warn(
                f"the plan of {source} holds capture faults of an earlier run: "
                f"{'; '.join(applied)}. Delete the plan to try them again."
            )


def _parse(state: Any) -> _Loaded:
    """``state`` checked field by field; a KeyError, TypeError or ValueError says what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a plan is a mapping; got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"format {state.get('format')!r}, this version reads {FORMAT}")
    fingerprint = _mapping(state, "fingerprint")
    calls = state["calls"]
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
        raise ValueError(f"calls must be a count; got {calls!r}")
    paths = {path: path_costs_from_values(v) for path, v in _mapping(state, "paths").items()}
    records = {}
    for name, values in _mapping(state, "keys").items():
        try:
            records[name] = record_from_values(_mapping({"key": values}, "key"))
        except ValueError as error:
            raise ValueError(f"key {name!r}: {error}") from None
    eager_keys = dict(_mapping(state, "eager_keys"))
    for name, reason in eager_keys.items():
        if reason not in (*CHECK_VERDICTS, MEASURED_SLOWER):
            raise ValueError(f"eager key {name!r} has unknown reason {reason!r}")
    faults = {}
    for path, fault in _mapping(state, "faults").items():
        fault = _mapping({"fault": fault}, "fault")
        reason, top = fault["eager_reason"], fault["max_budget"]
        if not isinstance(reason, str | None) or not (
            top is None or (isinstance(top, int) and not isinstance(top, bool) and top > 0)
        ):
            raise ValueError(f"fault of path {path!r} is not a reason and a budget: {fault!r}")
        faults[path] = (reason, top)
    return _Loaded(dict(fingerprint), calls, paths, records, eager_keys, faults)


def _mapping(values: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = values[name]
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} must be a mapping by name; got {type(value).__name__}")
    return value


def _warn(message: str) -> None:
    warnings.warn(f"lightning-cg: {message}", RuntimeWarning, stacklevel=3)
