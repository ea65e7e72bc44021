"""When a key is worth a graph: the capture rule.

A key is captured once a graph is expected to gain and either the calls known to come
repay its capture, or the eager time spent on it reaches its capture cost (ski rental).
A graph measured slower than its key's eager runs sends the key back to eager.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_cg.core.key_records import SAMPLES, KeyRecord, PathCosts
from lightning_cg.core.record_values import path_costs_values, record_values

#: Sightings of a key before it may be captured: the first one's eager time arrives late.
MIN_SIGHTINGS = 2
#: Graph time / eager time of a full budget, assumed before the path tells more.
PRIOR_GRAPH_RATIO = 0.5
#: Capture time / eager time before a capture is measured (warm-ups, record, instantiate).
PRIOR_CAPTURE_RATIO = 5.0
#: How much more than later ones a tower's first capture is expected to cost (its kernels'
#: first use under capture).
FIRST_CAPTURE_FACTOR = 2.0

#: Decisions of :meth:`CapturePolicy.decide`.
CAPTURE, WAIT, NO_GAIN = "capture", "wait", "no_gain"


@dataclass(frozen=True)
class CostlyCapture:
    """A capture that cost more than the eager time of the run that made it."""

    key: Hashable
    seconds: float
    run_eager_seconds: float


class CapturePolicy:
    """Decides per key whether to capture it now, from sightings and measured times.

    In a run of known length only earlier runs' eager time counts toward ski rental, so
    a key this run cannot repay is captured at the next run's start, not late in this one.
    There, eager time spent in an earlier process (a loaded plan) does not count either:
    a plan's key is captured at its first sighting only when the calls known to come repay
    it. A run of unknown length (a serving loop) counts it, as the process's own.

    Args:
        first_use: capture every key at its first sighting (``capture="first_use"``).
        drop_slower_graphs: :meth:`slower_than_eager` may send a key back to eager
            (always in a manager; scripted-timing tests turn it off).

    Example:
        >>> policy = CapturePolicy()
        >>> policy.begin_run(expected_calls=100)
        >>> policy.called(); policy.sighted("k", path="local", size=256, tokens=200)
        >>> policy.decide("k")
        'wait'
    """

    def __init__(
        self,
        first_use: bool = False,
        drop_slower_graphs: bool = True,
    ) -> None:
        self.first_use = first_use
        self.drop_slower_graphs = drop_slower_graphs
        #: Graphs run fused kernels (compiled capture): eager's cost per token
        #: does not bound theirs.
        self.graphs_fuse_work = False
        #: Keys captured by this policy's tower; its first capture pays the kernels' set-up.
        self._captured = 0
        #: Keys captured in the current run, with their capture seconds (a share of a
        #: capture of several keys, as ``upfront`` makes).
        self._run_captures: list[tuple[Hashable, float]] = []
        self._keys: dict[Hashable, KeyRecord] = {}
        self._paths: dict[str, PathCosts] = {}
        self._calls = 0
        self._run_calls = 0
        self._expected_calls: int | None = None
        self._later_runs = 0

    def begin_run(self, expected_calls: int | None, later_runs: int | None = None) -> None:
        """A run of ``expected_calls`` calls (None: unknown) starts, ``later_runs`` to follow."""
        self._expected_calls = expected_calls
        self._run_calls = 0
        self._later_runs = later_runs or 0
        self._run_captures = []
        for record in self._keys.values():
            record.spent_before_run = record.eager_spent

    def called(self) -> None:
        """The tower was called once."""
        self._calls += 1
        self._run_calls += 1

    def sighted(self, key: Hashable, path: str, size: int, tokens: int) -> None:
        """A sub-batch of ``tokens`` real tokens needs ``key`` (a graph of ``size`` tokens)."""
        record = self._keys.setdefault(key, KeyRecord(path, size))
        record.sightings += 1
        record.real_tokens += tokens
        if record.eager is not None:
            record.eager_spent += record.eager
        counts = self._path(path).token_counts
        if len(counts) < 2:
            counts.add(tokens)

    def wants_eager_timing(self, key: Hashable) -> bool:
        """Whether an eager run of ``key`` should be timed."""
        record = self._keys.get(key)
        return record is not None and len(record.eager_seconds_per_token) < SAMPLES

    def wants_graph_timing(self, key: Hashable) -> bool:
        """Whether a replay of ``key`` should be timed."""
        record = self._keys.get(key)
        return record is not None and len(record.graph_seconds) < SAMPLES

    def record_eager(self, key: Hashable, seconds: float, tokens: int) -> None:
        """An eager run of ``key`` on ``tokens`` real tokens took ``seconds``."""
        record = self._keys[key]
        record.eager_seconds_per_token.append(seconds / max(tokens, 1))
        record.median_eager_per_token = statistics.median(record.eager_seconds_per_token)

    def record_eager_call(self, path: str, tokens: int, seconds: float) -> None:
        """An eager run of ``path`` (one or more sub-batches) on ``tokens`` took ``seconds``."""
        self._path(path).add_call(tokens, seconds)

    def record_replay(self, key: Hashable, seconds: float) -> None:
        """One replay of ``key``'s graph took ``seconds``."""
        record = self._keys[key]
        record.graph_seconds.append(seconds)
        record.graph = statistics.median(record.graph_seconds)

    def record_capture(self, key: Hashable, seconds: float, keys: int = 1) -> None:
        """Capturing ``keys`` keys for ``key`` took ``seconds``. The key remembers its own
        capture seconds; the tower's first capture teaches other keys no capture/eager ratio."""
        first = self._captured == 0
        self._captured += keys
        per_key = seconds / max(keys, 1)
        self._run_captures.append((key, per_key))
        record = self._keys.get(key)
        if record is None:
            return
        record.capture_seconds = per_key
        if record.eager and not first:
            record.capture_ratio = record.capture_seconds / record.eager

    def costly_captures(self) -> list[CostlyCapture]:
        """This run's captures that each cost more than the run's eager time (its keys'
        sightings at their eager seconds), so the run was slower than eager."""
        run_eager = sum(r.eager_spent - r.spent_before_run for r in self._keys.values())
        return [
            CostlyCapture(key, seconds, run_eager)
            for key, seconds in self._run_captures
            if seconds > run_eager
        ]

    def forget_graphs(self) -> None:
        """The graphs are gone (recaptured later): keep sightings and eager times only."""
        for record in self._keys.values():
            record.graph_seconds.clear()
            record.graph = None
            record.capture_ratio = None
            record.capture_seconds = None

    def decide(self, key: Hashable) -> str:
        """:data:`CAPTURE` now, :data:`WAIT` (not yet repaid) or :data:`NO_GAIN`."""
        if self.first_use:
            return CAPTURE
        record = self._keys[key]
        if record.sightings < MIN_SIGHTINGS or record.eager is None:
            return WAIT
        gain = record.eager - self.graph_estimate(record)
        if gain <= 0:
            return NO_GAIN
        cost = self.capture_estimate(record)
        if self._expected_calls is None:
            spent = record.eager_spent
        else:
            spent = record.spent_before_run - record.imported_spent
        if self.known_sightings(record) * gain >= cost or spent >= cost:
            return CAPTURE
        return WAIT

    def slower_than_eager(self, key: Hashable) -> bool:
        """Whether ``key``'s graph was measured slower than its eager runs."""
        record = self._keys.get(key)
        if record is None or not self.drop_slower_graphs or record.eager is None:
            return False
        return len(record.graph_seconds) >= SAMPLES and record.graph > record.eager

    def known_sightings(self, record: KeyRecord) -> float:
        """The key's expected sightings in the rest of this run and the runs known to follow."""
        remaining = 0
        run_calls = self._run_calls
        if self._expected_calls is not None:
            remaining = max(self._expected_calls - self._run_calls, 0)
            run_calls = max(self._expected_calls, self._run_calls)
        share = record.sightings / max(self._calls, 1)
        return share * (remaining + self._later_runs * run_calls)

    def graph_estimate(self, record: KeyRecord) -> float:
        """Seconds of one replay of the key's graph.

        Measured, else scaled from the path's nearest measured graph, else
        ``per_token x budget`` of the path's eager cost line (a graph removes launches, not
        work), else :data:`PRIOR_GRAPH_RATIO`. An estimate that promises too much is
        corrected by the graph's measured replays (:meth:`slower_than_eager`).
        """
        if record.graph is not None:
            return record.graph
        measured = [
            (abs(other.size - record.size), other.graph / other.eager / other.padding_factor)
            for other in self._keys.values()
            if other.path == record.path and other.graph is not None and other.eager
        ]
        if measured:
            return min(measured)[1] * record.padding_factor * record.eager
        costs = self._path(record.path)
        if self.graphs_fuse_work or costs.per_token is None:
            return PRIOR_GRAPH_RATIO * record.padding_factor * record.eager
        return costs.per_token * record.size

    def capture_estimate(self, record: KeyRecord) -> float:
        """Seconds the key's capture is expected to cost: as its own capture measured (here
        or in a loaded plan), else its eager time times the path's (else any path's, else
        the prior) capture ratio, :data:`FIRST_CAPTURE_FACTOR` times more for the tower's first."""
        if record.capture_seconds is not None:
            return record.capture_seconds
        measured = [r for r in self._keys.values() if r.capture_ratio is not None]
        ratios = [r.capture_ratio for r in measured if r.path == record.path]
        ratios = ratios or [r.capture_ratio for r in measured]
        cost = record.eager * (statistics.median(ratios) if ratios else PRIOR_CAPTURE_RATIO)
        return cost * FIRST_CAPTURE_FACTOR if self._captured == 0 else cost

    def estimates(self, key: Hashable) -> dict[str, float | None]:
        """What :meth:`decide` weighs for ``key`` (seconds), for logs and tests."""
        record = self._keys[key]
        eager = record.eager
        return {
            "sightings": record.sightings,
            "eager_s": eager,
            "graph_s": None if eager is None else self.graph_estimate(record),
            "capture_s": None if eager is None else self.capture_estimate(record),
            "eager_spent_s": record.eager_spent,
            "known_sightings": self.known_sightings(record),
        }

    def _path(self, path: str) -> PathCosts:
        return self._paths.setdefault(path, PathCosts())

    def export_state(self, identity: Callable[[Hashable], str | None]) -> dict[str, Any]:
        """What the policy learned, as plain values: the calls counted, each path's eager
        calls, each key's record under ``identity(key)`` (None leaves the key out) and the
        keys whose graphs were measured slower than eager (``slower``)."""
        keys, slower = {}, []
        for key, record in self._keys.items():
            if (name := identity(key)) is not None:
                keys[name] = record_values(record)
                if self.slower_than_eager(key):
                    slower.append(name)
        paths = {path: path_costs_values(costs) for path, costs in self._paths.items()}
        return {"calls": self._calls, "paths": paths, "keys": keys, "slower": slower}

    def import_state(self, calls: int, paths: Mapping[str, PathCosts]) -> None:
        """An earlier process's call count and paths' eager calls, as if this process had
        made them; its key records join by :meth:`import_record` at each key's first sighting."""
        self._calls = max(self._calls, calls)
        for path, imported in paths.items():
            costs = self._path(path)
            for tokens, seconds in imported.eager_calls:
                costs.add_call(tokens, seconds)
            for tokens in sorted(imported.token_counts):
                if len(costs.token_counts) < 2:
                    costs.token_counts.add(tokens)

    def import_record(self, key: Hashable, record: KeyRecord) -> None:
        """``key``'s record from an earlier process, unless the key has one here: its
        sightings and measured times count, and the eager time spent on it counts in runs
        of unknown length only (see the class)."""
        if key not in self._keys:
            record.spent_before_run = record.imported_spent = record.eager_spent
            self._keys[key] = record
