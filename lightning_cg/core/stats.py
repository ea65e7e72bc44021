"""Counters of one manager: what ran in graphs, what ran eagerly and why, what capture cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class GraphStats:
    """Counters of one manager: lifetime ones (:attr:`LIFETIME`), the rest since :meth:`reset_run`.

    A hit is one path of one sub-batch served by a graph, a miss one run eagerly: split by
    reason in ``eager_*``, except where graphs are off (mode ``none``) or a capture fault
    turned the path eager, which count as misses alone. Graphs count CUDA graphs held (one
    per key). Pool bytes: device memory the graphs' shared pool holds (the CUDA caching
    allocator's segments of the pool, over every capture: outputs and activations). Weight
    copy bytes: the low-precision weight copies graphs read (held while graphs are). Held
    bytes: all device memory the graphs hold: pool, weight copies and the static input
    buffers outside the pool. Host seconds:
    served replays' host time (nothing waits for the GPU); launch seconds: its
    graph-launch part. Compile seconds: a compiled encoder's first forwards (part of
    capture). Checked replays: replays also run eagerly to compare; check seconds: the
    time those eager runs and comparisons took.
    """

    hits: int = 0
    misses: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    graphs: int = 0
    graphs_captured: int = 0
    capture_seconds: float = 0.0
    capture_seconds_run: float = 0.0
    pool_bytes: int = 0
    weight_copy_bytes: int = 0
    held_bytes: int = 0
    sub_batches: int = 0
    items: int = 0
    tokens: int = 0
    host_seconds: float = 0.0
    launch_seconds: float = 0.0
    compile_seconds: float = 0.0
    compile_seconds_run: float = 0.0
    eager_no_graph_yet: int = 0  # not captured yet: its replays have not yet repaid a capture
    eager_policy: int = 0  # the capture policy expects no gain from a graph of the key
    eager_above_budget: int = 0  # more tokens than the largest budget
    # The mode or ladder holds no graph of the sub-batch's shape: a mixed batch under
    # full_uniform_only, a uniform item count that is not a power of two there, more
    # frames than a graph holds.
    eager_no_graph_for_shape: int = 0
    eager_measured_slower: int = 0  # the key's graph was measured slower than eager
    eager_replay_differs: int = 0  # the key's graph gave other rows than eager on the same items
    eager_changes_state: int = 0  # the tower's forward changes its buffers: no second call
    eager_compiled_mismatch: int = 0  # a compiled graph differed from eager: compiling ended
    eager_grad_enabled: int = 0  # the call needed gradients, which graphs do not hold
    eager_training: int = 0  # the tower was in train mode (dropout, batch statistics)
    checked_replays: int = 0
    checked_tokens: int = 0
    check_seconds: float = 0.0

    #: Counters that describe what is held, not what a run did: kept by reset_run.
    LIFETIME = (
        "graphs",
        "capture_seconds",
        "pool_bytes",
        "weight_copy_bytes",
        "held_bytes",
        "compile_seconds",
    )

    @property
    def hit_rate(self) -> float:
        runs = self.hits + self.misses
        return self.hits / runs if runs else 0.0

    @property
    def padding_waste(self) -> float:
        """Padded tokens per real token served by graphs."""
        return self.padded_tokens / self.real_tokens if self.real_tokens else 0.0

    @property
    def host_us_per_replay(self) -> float:
        """Host microseconds of one graph replay, on average."""
        return 1e6 * self.host_seconds / self.hits if self.hits else 0.0

    @property
    def launch_us_per_replay(self) -> float:
        """Host microseconds of one replay's graph launch, on average."""
        return 1e6 * self.launch_seconds / self.hits if self.hits else 0.0

    def count_eager(self, reason: str) -> None:
        """One path of a sub-batch ran eagerly for ``reason`` (an ``eager_*`` field's suffix)."""
        self.misses += 1
        name = f"eager_{reason}"
        setattr(self, name, getattr(self, name) + 1)

    def rates(self) -> dict[str, float]:
        """The stats derived from the counters (recomputed, not summed, over ranks)."""
        return {
            "hit_rate": self.hit_rate,
            "padding_waste": self.padding_waste,
            "host_us_per_replay": self.host_us_per_replay,
            "launch_us_per_replay": self.launch_us_per_replay,
        }

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), **self.rates()}

    def reset_run(self) -> None:
        """Zero the counters of a run; what is held (graphs, pool, total capture time) stays."""
        for counter in fields(self):
            if counter.name not in self.LIFETIME:
                setattr(self, counter.name, counter.default)
