"""When a key is worth a graph: capture only what its replays are expected to repay.

A capture costs a few eager runs of the key (two warm-up forwards, the
recorded one, the synchronisation); each replay saves the difference between
the key's eager time and its graph time. :class:`CapturePolicy` captures a key
once it has been seen ``min_sightings`` times and

    expected further sightings x estimated gain per sighting >= estimated capture cost

where the expected sightings are the key's share of its path's sub-batches so
far times the sub-batches of the calls a graph captured now is expected to
serve (:meth:`CapturePolicy.horizon_calls`): the rest of the run (when the
caller knows how many calls the run has; otherwise of a run as long as the last
one, and at least as many calls again as so far) and, as graphs outlive the
run, ``repay_runs - 1`` more runs like it, or the runs known to follow (a fit's
validation runs still to come) when they are more. ``compile="auto"`` weighs
its compile over the same horizon.

A capture repaid over later runs makes the current one slower, so a run also
keeps an allowance: a key is captured only when what its capture costs beyond
what the calls known to come repay (:meth:`CapturePolicy.committed_calls`: the
rest of this run, and the runs known to follow, such as a fit's validation runs
still to come, but not the ``repay_runs`` guess) fits within :data:`RUN_SLACK`
of the run's estimated eager time, plus what this run's graphs have saved, less
what its captures have cost (:meth:`CapturePolicy.run_allowance`). So a run is
not made slower than eager by more than that, by these estimates, for runs that
may never come, and a key that short runs cannot afford stays eager in them.
What the calls known to come repay is counted at a pessimistic gain
(:meth:`~lightning_cg.cost_estimates.CostEstimates.pessimistic_gain`): on a
path of several sizes none of whose graphs is measured, at most the eager time
less the budget times the path's least eager seconds per token, since launches
may hide the GPU's work.
``compile="auto"`` keeps to the same allowance.

The gain is the key's eager time minus its estimated graph time, and the
capture cost its eager time times the path's capture/eager ratio; both ratios
come from :class:`~lightning_cg.cost_estimates.CostEstimates`, from the times
measured on the key's path (its eager calls of several sizes, its measured
graphs and captures) or, before those, from priors.

After capture a key's replays are timed too; a graph measured slower than the
key's eager runs sends the key back to eager. Timings come from the caller
(CUDA events or a clock): this module is pure Python.
"""

from __future__ import annotations

from collections.abc import Hashable

from lightning_cg.cost_estimates import CostEstimates
from lightning_cg.key_record import KeyRecord

#: Timings kept per key and kind; the median of them is used.
SAMPLES = 3
#: The share of a run's estimated eager time that captures (and the compile)
#: repaid only by runs that may never come may cost the run (see
#: :meth:`CapturePolicy.run_allowance`).
RUN_SLACK = 0.03

#: Decisions of :meth:`CapturePolicy.decide`.
CAPTURE, WAIT, NO_GAIN = "capture", "wait", "no_gain"


class CapturePolicy:
    """Decides per key whether to capture it now, from sightings and measured times.

    Args:
        first_use: capture every key at its first sighting (``capture="first_use"``).
        min_sightings: sightings before a key may be captured.
        drop_slower_graphs: :meth:`slower_than_eager` may send a key back to eager.
        graphs_fuse_work: graphs run fused kernels (compiled capture), so eager's
            cost per token does not bound theirs.
        repay_runs: runs like the current one, counting it, over which a capture
            (and a compile) may be repaid.

    Example:
        >>> policy = CapturePolicy(min_sightings=2)
        >>> policy.begin_run(expected_calls=100)
        >>> policy.sighted("k", path="local", size=256, tokens=200)
        >>> policy.decide("k")
        'wait'
    """

    def __init__(
        self,
        first_use: bool = False,
        min_sightings: int = 2,
        drop_slower_graphs: bool = True,
        graphs_fuse_work: bool = False,
        repay_runs: int = 2,
    ) -> None:
        self.first_use = first_use
        self.repay_runs = repay_runs
        self.min_sightings = min_sightings
        self.drop_slower_graphs = drop_slower_graphs
        self._keys: dict[Hashable, KeyRecord] = {}
        #: The graph and capture cost estimates of the keys.
        self.costs = CostEstimates(self._keys, graphs_fuse_work)
        self._calls = 0
        self._run_calls = 0
        # Calls of the last run that ended: a run of unknown length is expected as long.
        self._last_run_calls = 0
        # This run's eager seconds of the sub-batches seen, replays' savings, captures.
        self._run_eager_seconds = self._run_saved_seconds = self._run_capture_seconds = 0.0
        self._expected_calls: int | None = None
        self._later_runs = repay_runs - 1
        self._known_later_runs = 0

    # ----------------------------------------------------------- observations

    def begin_run(self, expected_calls: int | None, later_runs: int | None = None) -> None:
        """A run starts that will call the tower about ``expected_calls`` times and
        that ``later_runs`` runs like it are known to follow (None: unknown)."""
        if self._run_calls:
            self._last_run_calls = self._run_calls
        self._expected_calls = expected_calls
        self._run_calls = 0
        self._run_eager_seconds = self._run_saved_seconds = self._run_capture_seconds = 0.0
        self._known_later_runs = later_runs or 0
        self._later_runs = max(self.repay_runs - 1, self._known_later_runs)

    def called(self) -> None:
        """The tower was called once."""
        self._calls += 1
        self._run_calls += 1

    def sighted(self, key: Hashable, path: str, size: int, tokens: int) -> None:
        """A sub-batch of ``path`` with ``tokens`` real tokens needs ``key`` (a graph
        of ``size`` tokens), whether or not the key has a graph yet."""
        record = self._keys.setdefault(key, KeyRecord(path, size))
        record.sightings += 1
        record.real_tokens += tokens
        eager = record.eager
        if eager is not None:
            self._run_eager_seconds += eager
            if record.graph is not None and not self._slower(record):
                self._run_saved_seconds += eager - record.graph
        self.costs.saw_tokens(path, tokens)

    def wants_eager_timing(self, key: Hashable) -> bool:
        """Whether an eager run of ``key`` should be timed."""
        record = self._keys.get(key)
        return record is not None and len(record.eager_seconds_per_token) < SAMPLES

    def wants_graph_timing(self, key: Hashable) -> bool:
        """Whether a replay of ``key`` should be timed."""
        record = self._keys.get(key)
        return record is not None and len(record.graph_seconds) < SAMPLES

    def record_eager(self, key: Hashable, seconds: float, tokens: int) -> None:
        """An eager run of a sub-batch of ``key`` with ``tokens`` real tokens took ``seconds``."""
        self._keys[key].add_eager(seconds / max(tokens, 1))

    def record_eager_call(self, path: str, tokens: int, seconds: float) -> None:
        """An eager run of ``path`` on ``tokens`` real tokens (one or more
        sub-batches run together) took ``seconds``."""
        self.costs.record_eager_call(path, tokens, seconds)

    def record_replay(self, key: Hashable, seconds: float) -> None:
        """One replay of ``key``'s graph took ``seconds``."""
        self._keys[key].add_graph(seconds)

    def record_capture(self, key: Hashable, seconds: float, keys: int = 1) -> None:
        """Capturing ``keys`` keys for ``key`` took ``seconds``: ``key``'s capture
        cost is their mean (ignored for a key never sighted); the run paid all of it."""
        self._run_capture_seconds += seconds
        record = self._keys.get(key)
        if record is not None:
            record.capture_seconds = seconds / max(keys, 1)

    def forget_graphs(self) -> None:
        """The graphs are gone (recaptured later): keep sightings and eager times only."""
        for record in self._keys.values():
            record.forget_graph()

    # -------------------------------------------------------------- decisions

    def decide(self, key: Hashable) -> str:
        """:data:`CAPTURE` now, :data:`WAIT` (not yet repaid) or :data:`NO_GAIN`."""
        if self.first_use:
            return CAPTURE
        record = self._keys[key]
        if record.sightings < self.min_sightings or record.eager is None:
            return WAIT
        if self.costs.awaiting_eager_line(record.path):
            return WAIT
        gain = record.eager * (1.0 - self.costs.graph_ratio(record))
        if gain <= 0:
            return NO_GAIN
        cost = record.eager * self.costs.capture_ratio(record.path)
        if self._expected_sightings(record) * gain < cost:
            return WAIT
        # The part of the cost that only runs which may never come repay must
        # fit this run's allowance; so must what the pessimistic gain would
        # leave unpaid of the rest.
        repaid_by = self.costs.pessimistic_gain(record, gain)
        unpaid = cost - self._sightings_per_call(record) * self.committed_calls() * repaid_by
        return CAPTURE if unpaid <= self.run_allowance() else WAIT

    def slower_than_eager(self, key: Hashable) -> bool:
        """Whether ``key``'s graph was measured slower than its eager runs."""
        record = self._keys.get(key)
        return record is not None and self._slower(record)

    def _slower(self, record: KeyRecord) -> bool:
        if not self.drop_slower_graphs or record.eager is None:
            return False
        return len(record.graph_seconds) >= SAMPLES and record.graph > record.eager

    def estimates(self, key: Hashable) -> dict[str, float | None]:
        """What :meth:`decide` weighs for ``key`` (seconds), for logs and tests."""
        record = self._keys[key]
        return {
            "sightings": record.sightings,
            "eager_s": record.eager,
            "graph_s": record.graph,
            "graph_ratio": self.costs.graph_ratio(record),
            "capture_ratio": self.costs.capture_ratio(record.path),
            "expected_sightings": self._expected_sightings(record),
        }

    def remaining_calls(self) -> int:
        """Calls the run still expects. When its length is unknown: the rest of a
        run as long as the last one, and at least as many again as this run has
        made so far; like the horizon, the estimate does not grow with the runs made."""
        if self._expected_calls is None:
            return max(self._last_run_calls - self._run_calls, self._run_calls)
        return max(self._expected_calls - self._run_calls, 0)

    def run_calls(self) -> int:
        """The calls of the whole run: expected, or so far and :meth:`remaining_calls`."""
        if self._expected_calls is None:
            return self._run_calls + self.remaining_calls()
        return max(self._expected_calls, self._run_calls)

    def horizon_calls(self) -> int:
        """Calls a graph captured now is expected to serve: the rest of this run,
        and the later runs like it (``repay_runs - 1``, or the runs known to
        follow when more). Fixed per run: it does not grow with the runs made."""
        return self.remaining_calls() + self._later_runs * self.run_calls()

    def committed_calls(self) -> int:
        """Calls known to come: the rest of this run (as :meth:`remaining_calls`
        estimates it when the run's length is unknown), and the runs known to
        follow (a fit's validation runs still to come). What a capture or the
        compile costs beyond what these repay is paid from :meth:`run_allowance`."""
        return self.remaining_calls() + self._known_later_runs * self.run_calls()

    def run_allowance(self) -> float:
        """Seconds captures or the compile may still cost this run beyond what the
        calls known to come repay (:meth:`committed_calls`):
        :data:`RUN_SLACK` of the run's estimated eager time (the eager time of its
        sub-batches so far, scaled to :meth:`run_calls`), plus what its replays
        saved (eager less measured graph time), less its capture seconds.

        Sub-batches count at the estimates known when they were seen: those of a
        key not timed yet count nothing, nor do replays before their graph is
        timed, which errs on the side of eager.
        """
        run_eager = self._run_eager_seconds * self.run_calls() / max(self._run_calls, 1)
        return RUN_SLACK * run_eager + self._run_saved_seconds - self._run_capture_seconds

    def _expected_sightings(self, record: KeyRecord) -> float:
        return self._sightings_per_call(record) * self.horizon_calls()

    def _sightings_per_call(self, record: KeyRecord) -> float:
        """The key's sightings per call so far, over every run."""
        return record.sightings / max(self._calls, 1)
