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
(:meth:`CapturePolicy._pessimistic_gain`): on a path of several sizes none of
whose graphs is measured, at most the eager time less the budget times the
path's least eager seconds per token, since launches may hide the GPU's work.
``compile="auto"`` keeps to the same allowance.

The gain is the key's eager time minus its estimated graph time, and the
capture cost is its eager time times the capture/eager ratio measured so far. A
graph computes its whole budget, eager only the real tokens, and a key's
sub-batches differ in real tokens: its eager time is the measured eager time
per real token times the mean real tokens of its sightings, and its graph time,
until measured, is the eager time of its whole budget times the graph's cost
per padded token relative to eager's per real token, measured on the
nearest-sized captured key of its path. Before any graph of the path is
measured, the path's eager calls of different sizes tell launch cost from GPU
work: fitted as ``fixed + per_token x tokens``, a graph is expected to cost
``per_token x budget`` (it removes the launches, not the work, and computes its
padding); with too few sizes to fit, :data:`PRIOR_GRAPH_RATIO` per padded token
stands in. So a key whose sub-batches fill the GPU and are partly padding is
not captured, while one whose eager time is mostly launches is. A path whose
sub-batches differ in real tokens waits for that fit before its first capture
(for at most :data:`FIT_PATIENCE` timed eager calls), even while they all need
one key. Compiled graphs (``graphs_fuse_work``) are the exception: inductor
fuses the tower's kernels, so a graph may do less work than eager and the line
does not bound it; the prior stands in until a graph of the path is measured.
Before anything is measured, :data:`PRIOR_GRAPH_RATIO` and
:data:`PRIOR_CAPTURE_RATIO` stand in.

After capture a key's replays are timed too; a graph measured slower than the
key's eager runs sends the key back to eager. Timings come from the caller
(CUDA events or a clock): this module is pure Python.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable

from lightning_cg.key_record import KeyRecord

#: Graph time / eager time of a full budget, assumed for a path none of whose
#: keys is measured.
PRIOR_GRAPH_RATIO = 0.5
#: Capture time / eager time assumed before a capture of the path is measured:
#: two warm-up forwards, the recorded one, graph instantiation and a sync.
PRIOR_CAPTURE_RATIO = 5.0
#: Timings kept per key and kind; the median of them is used.
SAMPLES = 3
#: Eager calls per path kept for the fit of fixed and per-token cost.
PATH_SAMPLES = 32
#: Eager calls after which a path whose sizes vary stops waiting for the fit.
FIT_PATIENCE = 8
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
        self.graphs_fuse_work = graphs_fuse_work
        self._keys: dict[Hashable, KeyRecord] = {}
        # Up to two real-token counts per path: two tell that its sizes vary.
        self._path_token_counts: dict[str, set[int]] = {}
        self._path_eager_calls: dict[str, list[tuple[int, float]]] = {}
        # Each path's fitted line and the sample count it was fitted on: decide
        # runs on every eager call, the samples change on few of them.
        self._fitted_lines: dict[str, tuple[int, tuple[float, float] | None]] = {}
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
        counts = self._path_token_counts.setdefault(path, set())
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
        """An eager run of a sub-batch of ``key`` with ``tokens`` real tokens took ``seconds``."""
        self._keys[key].add_eager(seconds / max(tokens, 1))

    def record_eager_call(self, path: str, tokens: int, seconds: float) -> None:
        """An eager run of ``path`` on ``tokens`` real tokens (one or more
        sub-batches run together) took ``seconds``."""
        samples = self._path_eager_calls.setdefault(path, [])
        if len(samples) < PATH_SAMPLES:
            samples.append((tokens, seconds))

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
        if self._awaiting_eager_line(record.path):
            return WAIT
        gain = record.eager * (1.0 - self._graph_ratio(record))
        if gain <= 0:
            return NO_GAIN
        cost = record.eager * self._capture_ratio(record.path)
        if self._expected_sightings(record) * gain < cost:
            return WAIT
        # The part of the cost that only runs which may never come repay must
        # fit this run's allowance; so must what the pessimistic gain would
        # leave unpaid of the rest (see _pessimistic_gain).
        repaid_by = self._pessimistic_gain(record, gain)
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
            "graph_ratio": self._graph_ratio(record),
            "capture_ratio": self._capture_ratio(record.path),
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

    def _graph_ratio(self, record: KeyRecord) -> float:
        """Graph / eager time of ``record``'s key at its mean real tokens: measured,
        or estimated from the nearest-sized measured key of the path (or the prior)
        as cost per padded token, scaled by this key's padding."""
        if record.graph is not None and record.eager:
            return record.graph / record.eager
        measured = [
            (abs(other.size - record.size), other.graph / other.eager / other.padding_factor)
            for other in self._keys.values()
            if other.path == record.path and other.graph is not None and other.eager
        ]
        if measured:
            return min(measured)[1] * record.padding_factor
        line = None if self.graphs_fuse_work else self._eager_line(record.path)
        if line is not None and record.eager:
            _, per_token = line
            return per_token * record.size / record.eager
        return PRIOR_GRAPH_RATIO * record.padding_factor

    def _pessimistic_gain(self, record: KeyRecord, gain: float) -> float:
        """The part of the estimated ``gain`` per sighting counted on within the
        run: all of it, unless the path's eager calls (of several sizes, no
        graph of the path measured yet) made the estimate.

        A launch-bound eager call hides the GPU's work behind its launches (CUDA
        events time the longer of the two), so the eager line's slope may be far
        below the work a padded graph would do. No eager call did more GPU work
        per real token than its seconds per token, so were that work the same
        per token in every call, the graph would cost at most the path's least
        eager seconds per token times its budget: the estimate used here. It is
        pessimistic, not a bound: attention's work grows with the square of a
        frame, so a sub-batch of large frames can cost more per token. (A path
        of one size keeps its estimate: its graphs hold about the same tokens
        as its eager calls, so they do no more GPU work.)
        """
        path = record.path
        samples = self._path_eager_calls.get(path)
        from_eager_calls = (
            not self.graphs_fuse_work
            and record.graph is None
            and samples
            and len({tokens for tokens, _ in samples}) > 1
            and not any(other.path == path and other.graph for other in self._keys.values())
        )
        if not from_eager_calls:
            return gain
        per_token = min(seconds / tokens for tokens, seconds in samples if tokens)
        return min(gain, max(record.eager - per_token * record.size, 0.0))

    def _awaiting_eager_line(self, path: str) -> bool:
        """Whether the path's first capture should wait for its eager cost line:
        its sub-batches differ in real tokens (a line can be fitted; keys of one
        budget differ too), nothing of it is measured as a graph, the line
        cannot be fitted yet, and fewer than :data:`FIT_PATIENCE` eager calls are
        timed (their timings arrive a call late, and the prior would decide)."""
        if self.graphs_fuse_work or len(self._path_token_counts.get(path, ())) < 2:
            return False
        records = [record for record in self._keys.values() if record.path == path]
        if any(record.graph is not None for record in records):
            return False
        samples = self._path_eager_calls.get(path, [])
        return self._eager_line(path) is None and len(samples) < FIT_PATIENCE

    def _eager_line(self, path: str) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds of the path's eager calls, fitted by least
        squares; None with fewer than two sizes or a slope the noise made negative."""
        samples = self._path_eager_calls.get(path, [])
        fitted = self._fitted_lines.get(path)
        if fitted is None or fitted[0] != len(samples):
            fitted = len(samples), _fit_line(samples)
            self._fitted_lines[path] = fitted
        return fitted[1]

    def _capture_ratio(self, path: str) -> float:
        ratios = [
            other.capture_seconds / other.eager
            for other in self._keys.values()
            if other.path == path and other.capture_seconds is not None and other.eager
        ]
        return statistics.median(ratios) if ratios else PRIOR_CAPTURE_RATIO


def _fit_line(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``(fixed, per_token)`` of ``(tokens, seconds)`` samples; None
    with fewer than two sizes or a negative slope."""
    if len({tokens for tokens, _ in samples}) < 2:
        return None
    mean_tokens = statistics.fmean(tokens for tokens, _ in samples)
    mean_seconds = statistics.fmean(seconds for _, seconds in samples)
    spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in samples)
    per_token = (
        sum((tokens - mean_tokens) * (seconds - mean_seconds) for tokens, seconds in samples)
        / spread
    )
    if per_token <= 0:
        return None
    return max(mean_seconds - per_token * mean_tokens, 0.0), per_token
