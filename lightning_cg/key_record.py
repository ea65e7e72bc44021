"""One key's record in the capture policy: sightings, real tokens and timings."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class KeyRecord:
    """What the capture policy knows of one key: its path and budget, its
    sightings and their real tokens, and its measured eager, graph and capture
    times."""

    path: str
    size: int
    sightings: int = 0
    real_tokens: int = 0
    eager_seconds_per_token: list[float] = field(default_factory=list)
    graph_seconds: list[float] = field(default_factory=list)
    capture_seconds: float | None = None
    # The medians of the two lists, kept as samples arrive: every sighting reads them.
    median_eager_per_token: float | None = None
    graph: float | None = None

    @property
    def eager(self) -> float | None:
        """Eager seconds of a sub-batch of the key's mean real tokens."""
        if self.median_eager_per_token is None or not self.sightings:
            return None
        return self.median_eager_per_token * self.real_tokens / self.sightings

    def add_eager(self, seconds_per_token: float) -> None:
        self.eager_seconds_per_token.append(seconds_per_token)
        self.median_eager_per_token = statistics.median(self.eager_seconds_per_token)

    def add_graph(self, seconds: float) -> None:
        self.graph_seconds.append(seconds)
        self.graph = statistics.median(self.graph_seconds)

    def forget_graph(self) -> None:
        self.graph_seconds.clear()
        self.graph = None
        self.capture_seconds = None

    @property
    def padding_factor(self) -> float:
        """Budget / mean real tokens: how much more a graph computes than eager."""
        return self.size * self.sightings / max(self.real_tokens, 1)
