"""A path's eager cost line: ``fixed + per_token x tokens`` seconds, fitted by least squares.

The capture policy fits it to a path's timed eager calls of different sizes to
tell launch cost (``fixed``) from GPU work (``per_token``); see
:mod:`lightning_cg.capture_policy`. Pure Python.
"""

from __future__ import annotations

import statistics


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float] | None:
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
