"""What a path's eager calls cost the GPU alone: a graph's time, told before capturing it.

CUDA events around an eager call time its launches when the host launches more
slowly than the GPU runs, and the GPU's work otherwise; the two read alike. A
graph removes the launches and runs the kernels back to back over its whole
budget, padding included, so its time is the GPU's work per token times the
budget. A path whose eager calls are launch-bound but whose GPU work is close
behind then gets a graph slower than eager: on the H200, packed_vit_small on
mixed batches of 8 captured a 4096-token graph in a 100-batch run, measured it
slower than eager and sent it back, the run 0.81x eager for the capture alone.

A probe tells the two apart. The call runner holds the GPU with a spin kernel
for longer than the host takes to launch one eager call
(:meth:`~lightning_cg.call_timer.CallTimer.timed`'s hold), so the call's kernels
queue up behind it and then run back to back, and CUDA events around them time
the GPU's work alone. Keys are probed on their own sub-batches, whose real
tokens lie close below the key's budget: the GPU's work per token differs
with the size (a small sub-batch pays each kernel's fixed cost on few
tokens), so one key's probe would misjudge another's budget.

A probe costs about its hold, :data:`HOLD_MARGIN` eager calls at most, which
the capture policy charges to the run's allowance. It measures nothing when
the launches outlast the hold: when they vary more than the margin, or when
the call launches more kernels than CUDA queues (about a thousand) and the
host waits for the held GPU. A path whose probe measured nothing is not
probed again. :class:`GpuWork` keeps which keys the capture policy wants
probed, what the probes measured, and the paths that cannot be probed. Pure
Python.
"""

from __future__ import annotations

from collections.abc import Hashable

#: A probe holds the GPU this many times the launch time of an eager call of
#: its path (launches vary from call to call); it costs at most as many eager calls.
HOLD_MARGIN = 1.5


class GpuWork:
    """The GPU's seconds per real token of each key's eager sub-batches, measured by probes.

    Example:
        >>> work = GpuWork()
        >>> work.want("key", path="local")
        True
        >>> work.record("key", tokens=1000, seconds=0.002)
        >>> work.per_token("key")
        2e-06
    """

    def __init__(self) -> None:
        self._per_token: dict[Hashable, float] = {}
        self._wanted: dict[Hashable, str] = {}
        self._unprobeable: set[str] = set()

    def per_token(self, key: Hashable) -> float | None:
        """The GPU's seconds per real token of ``key``, or None before a probe measured it."""
        return self._per_token.get(key)

    def want(self, key: Hashable, path: str) -> bool:
        """Ask for a probe of ``key`` (of ``path``); whether one may come: not yet
        measured, and ``path`` not found unprobeable."""
        if key in self._per_token or path in self._unprobeable:
            return False
        self._wanted[key] = path
        return True

    def wanted(self, key: Hashable) -> bool:
        """Whether the next eager sub-batch of ``key`` should be probed."""
        return key in self._wanted

    def record(self, key: Hashable, tokens: int, seconds: float) -> None:
        """A probe measured ``seconds`` of GPU work for ``tokens`` real tokens of ``key``."""
        self._per_token[key] = seconds / max(tokens, 1)
        self._wanted.pop(key, None)

    def unmeasured(self, key: Hashable) -> None:
        """A probe of ``key`` measured nothing: its path is not probed again."""
        path = self._wanted.pop(key, None)
        if path is not None:
            self._unprobeable.add(path)
            for other in [other for other, of in self._wanted.items() if of == path]:
                del self._wanted[other]
