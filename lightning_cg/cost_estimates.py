"""What a key's graph and its capture are expected to cost, from measured times.

The capture policy (:mod:`lightning_cg.capture_policy`) weighs a key's gain per
sighting, its eager time less its graph time, against its capture cost, its
eager time times the capture/eager ratio measured on the path so far.
:class:`CostEstimates` gives both ratios.

A graph computes its whole budget, eager only the real tokens, and a key's
sub-batches differ in real tokens: a key's eager time is the measured eager
time per real token times the mean real tokens of its sightings, and its graph
time, until measured, is the eager time of its whole budget times the graph's
cost per padded token relative to eager's per real token, measured on the
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

The line's slope can be far too low: CUDA events time the longer of an eager
call's launches and its GPU work, so launches can hide the work a padded graph
would do. What the current run counts on is therefore a pessimistic gain
(:meth:`CostEstimates.pessimistic_gain`). Pure Python: the times come from the
caller.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping

from lightning_cg.key_record import KeyRecord

#: Graph time / eager time of a full budget, assumed for a path none of whose
#: keys is measured.
PRIOR_GRAPH_RATIO = 0.5
#: Capture time / eager time assumed before a capture of the path is measured:
#: two warm-up forwards, the recorded one, graph instantiation and a sync.
PRIOR_CAPTURE_RATIO = 5.0
#: Eager calls per path kept for the fit of fixed and per-token cost.
PATH_SAMPLES = 32
#: Eager calls after which a path whose sizes vary stops waiting for the fit.
FIT_PATIENCE = 8


class CostEstimates:
    """Graph and capture cost of keys, estimated from their path's measured times.

    Args:
        records: the capture policy's records by key, read as they change.
        graphs_fuse_work: graphs run fused kernels (compiled capture), so eager's
            cost per token does not bound theirs.
    """

    def __init__(
        self, records: Mapping[Hashable, KeyRecord], graphs_fuse_work: bool = False
    ) -> None:
        self.graphs_fuse_work = graphs_fuse_work
        self._records = records
        # Up to two real-token counts per path: two tell that its sizes vary.
        self._path_token_counts: dict[str, set[int]] = {}
        self._path_eager_calls: dict[str, list[tuple[int, float]]] = {}
        # Each path's fitted line and the sample count it was fitted on: the
        # policy decides on every eager call, the samples change on few of them.
        self._fitted_lines: dict[str, tuple[int, tuple[float, float] | None]] = {}

    def saw_tokens(self, path: str, tokens: int) -> None:
        """A sub-batch of ``path`` held ``tokens`` real tokens."""
        counts = self._path_token_counts.setdefault(path, set())
        if len(counts) < 2:
            counts.add(tokens)

    def record_eager_call(self, path: str, tokens: int, seconds: float) -> None:
        """An eager run of ``path`` on ``tokens`` real tokens (one or more
        sub-batches run together) took ``seconds``."""
        samples = self._path_eager_calls.setdefault(path, [])
        if len(samples) < PATH_SAMPLES:
            samples.append((tokens, seconds))

    def graph_ratio(self, record: KeyRecord) -> float:
        """Graph / eager time of ``record``'s key at its mean real tokens: measured,
        or estimated from the nearest-sized measured key of the path (or the prior)
        as cost per padded token, scaled by this key's padding."""
        if record.graph is not None and record.eager:
            return record.graph / record.eager
        measured = [
            (abs(other.size - record.size), other.graph / other.eager / other.padding_factor)
            for other in self._records.values()
            if other.path == record.path and other.graph is not None and other.eager
        ]
        if measured:
            return min(measured)[1] * record.padding_factor
        line = None if self.graphs_fuse_work else self._eager_line(record.path)
        if line is not None and record.eager:
            _, per_token = line
            return per_token * record.size / record.eager
        return PRIOR_GRAPH_RATIO * record.padding_factor

    def capture_ratio(self, path: str) -> float:
        """Capture / eager time of the path's captured keys (median), or the prior."""
        ratios = [
            other.capture_seconds / other.eager
            for other in self._records.values()
            if other.path == path and other.capture_seconds is not None and other.eager
        ]
        return statistics.median(ratios) if ratios else PRIOR_CAPTURE_RATIO

    def pessimistic_gain(self, record: KeyRecord, gain: float) -> float:
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
        # A measured graph of the path (this key's among them) decides instead.
        from_eager_calls = (
            not self.graphs_fuse_work
            and samples
            and len({tokens for tokens, _ in samples}) > 1
            and not self._has_measured_graph(path)
        )
        if not from_eager_calls:
            return gain
        per_token = min(seconds / tokens for tokens, seconds in samples if tokens)
        return min(gain, max(record.eager - per_token * record.size, 0.0))

    def awaiting_eager_line(self, path: str) -> bool:
        """Whether the path's first capture should wait for its eager cost line:
        its sub-batches differ in real tokens (a line can be fitted; keys of one
        budget differ too), nothing of it is measured as a graph, the line
        cannot be fitted yet, and fewer than :data:`FIT_PATIENCE` eager calls are
        timed (their timings arrive a call late, and the prior would decide)."""
        if self.graphs_fuse_work or len(self._path_token_counts.get(path, ())) < 2:
            return False
        if self._has_measured_graph(path):
            return False
        samples = self._path_eager_calls.get(path, [])
        return self._eager_line(path) is None and len(samples) < FIT_PATIENCE

    def _has_measured_graph(self, path: str) -> bool:
        return any(
            record.path == path and record.graph is not None for record in self._records.values()
        )

    def _eager_line(self, path: str) -> tuple[float, float] | None:
        """``(fixed, per_token)`` seconds of the path's eager calls, fitted by least
        squares; None with fewer than two sizes or a slope the noise made negative."""
        samples = self._path_eager_calls.get(path, [])
        fitted = self._fitted_lines.get(path)
        if fitted is None or fitted[0] != len(samples):
            fitted = len(samples), _fit_line(samples)
            self._fitted_lines[path] = fitted
        return fitted[1]


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
