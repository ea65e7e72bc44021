"""When to compile: ``compile="auto"`` compiles once the calls expected repay it.

A compiled graph forward runs the tower's kernels fused: on the packed towers'
GPU-bound batches of mixed sizes, where graphs alone are only as fast as eager,
compiled graphs took 25-36% off each call (BENCHMARKS.md, eighth and eleventh
sessions). The compile costs seconds once per process, and the graphs captured
until then are captured again over the compiled forward. With ``cost`` the
estimated compile seconds plus the capture seconds so far and ``saved(calls)``
= calls x median call time x :data:`COMPILE_GAIN_PRIOR`, :class:`CompilePolicy`
compiles when both

    saved(horizon calls) >= cost
    cost - saved(committed calls) <= the run's allowance

where the call times are the tower's whole calls (graphs and eager), timed on
the GPU. The horizon calls are those a graph captured now is expected to serve,
the capture policy's
(:meth:`~lightning_cg.capture_policy.CapturePolicy.horizon_calls`): the rest
of the run, and ``repay_runs - 1`` more runs like it (``repay_runs``, 2 by
default) or the runs known to follow (a fit's validation runs still to come)
when they are more. Compiled code, like a graph, outlives the run, so later
runs may make the compile worth it; but like a capture, the compile is paid
only from what the calls known to come repay (the rest of this run and the runs
known to follow:
:meth:`~lightning_cg.capture_policy.CapturePolicy.committed_calls`) and the
run's allowance (:meth:`~lightning_cg.capture_policy.CapturePolicy.run_allowance`:
a few percent of its eager time and what its graphs saved). So a ``predict``
does not end slower than eager for the sake of a next ``predict`` that may
never come, while a fit's first validation run may compile for the validation
runs that follow it. ``compile=True`` compiles from the start, for a user who
knows the runs ahead. Short runs, and calls too quick for fusion to matter,
stay uncompiled. The horizon does not grow with the runs a process has made,
so a repeated short run does not compile in its third or tenth run. The
compile seconds are estimated by what is compiled
(:data:`COMPILE_SECONDS_PRIOR`, measured cold on the H200). The decision is
taken once: a process compiles at most once. Pure Python: the timings come from the caller.
"""

from __future__ import annotations

import statistics
from collections import deque

#: Fraction of a call's time a compiled graph is expected to save: about the
#: mean of the packed towers' measured 25% (packed_vit) and 36%
#: (packed_vit_small), H200, bf16, mixed-size batches of 8, fine ladders.
COMPILE_GAIN_PRIOR = 0.3
#: Seconds of a cold compile, by what is compiled (H200, torch 2.11): the
#: repeated block of a packed tower once, with the first compiled forward of
#: each budget of its fine compiled ladder (packed_vit_small: 8.8 s since
#: compiled calls fix the tower's floats, 11.7-12.5 s before, when dynamo
#: traced the block twice; 8.4-12.8 s through 1000-batch Trainer runs before),
#: a batch-first tower's whole forward at static shapes (8.5-13 s), a whole
#: forward with dynamic shapes (20-60 s).
COMPILE_SECONDS_PRIOR = {"blocks": 9.0, "whole_static": 12.0, "whole_dynamic": 45.0}
#: Timed calls before the policy decides.
MIN_SAMPLES = 8
#: Timed calls kept; later ones replace the oldest, so a run's data decides.
WINDOW = 16
#: After the first :data:`MIN_SAMPLES`, one call in this many is timed.
TIMING_STRIDE = 8


class CompilePolicy:
    """Decides when a manager with ``compile="auto"`` starts compiling.

    Args:
        compile_seconds: the estimated seconds of the compile.
        gain: the fraction of a call's time compiling is expected to save.

    Example:
        >>> policy = CompilePolicy(compile_seconds=6.0)
        >>> for _ in range(8):
        ...     policy.record_call(0.075)
        >>> policy.decide(horizon_calls=2000, capture_seconds=1.0, committed_calls=1000,
        ...               allowance=0.0)
        True
    """

    def __init__(self, compile_seconds: float, gain: float = COMPILE_GAIN_PRIOR) -> None:
        self.compile_seconds = compile_seconds
        self.gain = gain
        #: Whether the policy has decided to compile (it never goes back).
        self.compiling = False
        #: At the last decision, the seconds by which the compile overran the
        #: run's allowance although the horizon repays it (later runs may come);
        #: None when it did not come to that.
        self.overrun_seconds: float | None = None
        self._call_seconds: deque[float] = deque(maxlen=WINDOW)
        # decide() runs before every call; the median changes only with a sample.
        self._median: float | None = None
        self._calls = 0

    def wants_call_timing(self) -> bool:
        """Whether the next call should be timed (counts the call)."""
        if self.compiling:
            return False
        self._calls += 1
        return len(self._call_seconds) < MIN_SAMPLES or self._calls % TIMING_STRIDE == 0

    def record_call(self, seconds: float) -> None:
        """One whole call of the tower took ``seconds``."""
        self._call_seconds.append(seconds)
        self._median = None

    def decide(
        self, horizon_calls: float, capture_seconds: float, committed_calls: float, allowance: float
    ) -> bool:
        """True once: when the ``horizon_calls`` a graph captured now is expected
        to serve repay the compile and the recapture of what is captured
        (``capture_seconds``), and what the ``committed_calls`` (the calls known
        to come) leave unpaid fits the run's ``allowance`` (seconds)."""
        if self.compiling or len(self._call_seconds) < MIN_SAMPLES:
            return False
        if self._median is None:
            self._median = statistics.median(self._call_seconds)
        saved_per_call = self._median * self.gain
        cost = self.compile_seconds + capture_seconds
        repaid = horizon_calls * saved_per_call >= cost
        unpaid = cost - committed_calls * saved_per_call
        self.overrun_seconds = unpaid - allowance if repaid and unpaid > allowance else None
        self.compiling = repaid and unpaid <= allowance
        return self.compiling

    def estimates(self) -> dict[str, float | None]:
        """What :meth:`decide` weighs (seconds), for logs and tests."""
        timed = len(self._call_seconds)
        return {
            "timed_calls": timed,
            "call_s": statistics.median(self._call_seconds) if timed else None,
            "gain": self.gain,
            "compile_s": self.compile_seconds,
        }
