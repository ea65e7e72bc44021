"""Reading :attr:`CUDAGraphCallback.last_stats`: where one run's capture is reported.

Callbacks that report per-run capture have :data:`RUN_CAPTURE_KEYS`; older
ones only :data:`HELD_CAPTURE_KEYS`, the graphs held and every capture second
since the manager was built. Kept apart from the apps so benchmarks read it
without Hydra.
"""

from __future__ import annotations

from collections.abc import Mapping

#: ``last_stats`` keys of one run's capture: graphs captured and seconds spent in it.
RUN_CAPTURE_KEYS = ("graphs_captured", "capture_seconds_run")
#: What callbacks without per-run keys report: graphs held, capture seconds since built.
HELD_CAPTURE_KEYS = ("graphs", "capture_seconds")


def run_capture(stats: Mapping[str, float]) -> tuple[int, float, str]:
    """Graphs captured and capture seconds of the run ``stats`` describe, and the keys read.

    Reads :data:`RUN_CAPTURE_KEYS`, or :data:`HELD_CAPTURE_KEYS` where they are
    missing (then the figures are held totals, not this run's); the third value
    names the keys read as ``"graphs_captured/capture_seconds_run"`` or
    ``"graphs/capture_seconds"`` (``"none"`` for empty stats).
    """
    for keys in (RUN_CAPTURE_KEYS, HELD_CAPTURE_KEYS):
        if all(key in stats for key in keys):
            return int(stats[keys[0]]), stats[keys[1]], "/".join(keys)
    return 0, 0.0, "none"
