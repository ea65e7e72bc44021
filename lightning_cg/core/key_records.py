"""What the capture rule knows of a key and of a path: sightings and measured times."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

#: Timings kept per key and kind; the median of them is used.
SAMPLES = 3
#: Eager calls per path kept for its cost line.
PATH_SAMPLES = 32


@dataclass
class KeyRecord:
    """One key's path, budget, sightings and measured times (medians of the first samples)."""

    path: str
    size: int
    sightings: int = 0
    real_tokens: int = 0
    #: Eager seconds spent on the key's sightings, as estimated when each was seen.
    eager_spent: float = 0.0
    #: ``eager_spent`` when the current run began.
    spent_before_run: float = 0.0
    #: The part of ``eager_spent`` spent in earlier processes (a loaded plan).
    imported_spent: float = 0.0
    eager_seconds_per_token: list[float] = field(default_factory=list)
    graph_seconds: list[float] = field(default_factory=list)
    #: Capture seconds / eager seconds, once a capture after the tower's first is timed.
    capture_ratio: float | None = None
    #: Seconds the key's last capture took.
    capture_seconds: float | None = None
    median_eager_per_token: float | None = None
    graph: float | None = None

    @property
    def eager(self) -> float | None:
        """Eager seconds of a sub-batch of the key's mean real tokens."""
        if self.median_eager_per_token is None or not self.sightings:
            return None
        return self.median_eager_per_token * self.real_tokens / self.sightings

    @property
    def padding_factor(self) -> float:
        """Budget / mean real tokens: how much more a graph computes than eager."""
        return self.size * self.sightings / max(self.real_tokens, 1)


@dataclass
class PathCosts:
    """A path's eager calls (real tokens, seconds) and the token counts it has seen."""

    eager_calls: list[tuple[int, float]] = field(default_factory=list)
    token_counts: set[int] = field(default_factory=set)
    #: Seconds per token of the eager calls' least-squares line (None: not yet positive).
    per_token: float | None = None

    def add_call(self, tokens: int, seconds: float) -> None:
        if len(self.eager_calls) < PATH_SAMPLES:
            self.eager_calls.append((tokens, seconds))
            self.per_token = slope(self.eager_calls)


def slope(samples: list[tuple[int, float]]) -> float | None:
    """Least-squares seconds per token of ``(tokens, seconds)``; None with fewer than two
    sizes or a non-positive slope."""
    if len({tokens for tokens, _ in samples}) < 2:
        return None
    mean_tokens = statistics.fmean(tokens for tokens, _ in samples)
    mean_seconds = statistics.fmean(seconds for _, seconds in samples)
    spread = sum((tokens - mean_tokens) ** 2 for tokens, _ in samples)
    covariance = sum((t - mean_tokens) * (s - mean_seconds) for t, s in samples)
    return slope if (slope := covariance / spread) > 0 else None
