"""EngineState: what one manager's parts read and change while calls run, in one place.

The manager owns it and hands it whole to the parts that run calls (router, call runner,
capturer, compiled capture) and to :class:`~lightning_cg.engine.run_state.RunState`,
which reads what was learned from it alone: the current plan (immutable, replaced as a
whole when a fault or compiling changes it), the graph cache, the capture rule's records
(the policy), the keys a checked replay sent to eager, and the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_cg.core.capture_policy import CapturePolicy
from lightning_cg.core.stats import GraphStats
from lightning_cg.engine.cache import GraphCache, GraphKey
from lightning_cg.engine.plan import PathPlan, Plan


@dataclass(eq=False)
class EngineState:
    """The run-time state of one manager (see the module)."""

    plan: Plan
    cache: GraphCache = field(default_factory=GraphCache)
    policy: CapturePolicy = field(default_factory=CapturePolicy)
    stats: GraphStats = field(default_factory=GraphStats)
    #: Keys a checked replay sent to eager for good, and why (an ``eager_*`` reason).
    eager_keys: dict[GraphKey, str] = field(default_factory=dict)

    def update(self, path: str, plan: PathPlan) -> None:
        """Plan ``path`` by ``plan`` from now on."""
        self.plan = self.plan.with_paths({**self.plan.paths, path: plan})
