"""The detection rule, pure (spec/loss-guard.md §2): robust z-score over a window of
accepted losses, plus non-finite detection. Plain binary64 arithmetic in a fixed order,
so equal losses give equal verdicts on every machine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Verdict", "judge", "median", "MAD_TO_SIGMA", "SCALE_FLOOR"]

#: 1.4826 * MAD estimates the standard deviation of normal data
MAD_TO_SIGMA = 1.4826
SCALE_FLOOR = 1e-12


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the rule saw and decided. ``rule`` is ``robust_z``, ``nonfinite`` or ``""``
    (accepted); the statistics are 0.0 when the window was too short to compute them."""

    anomalous: bool
    rule: str
    value: float
    median: float
    mad: float
    scale: float
    score: float
    threshold: float
    window: tuple[float, ...]


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def judge(value: float, window: Sequence[float], *, min_history: int, z_threshold: float, min_scale: float) -> Verdict:
    """The verdict on one step's loss ``value`` given the accepted ``window`` (oldest first)."""
    w = tuple(float(x) for x in window)
    m = mad = scale = score = 0.0
    if w and len(w) >= min_history:
        m = median(w)
        mad = median([abs(x - m) for x in w])
        scale = max(MAD_TO_SIGMA * mad, min_scale * abs(m), SCALE_FLOOR)
        if math.isfinite(value):
            score = (value - m) / scale
    if not math.isfinite(value):
        return Verdict(True, "nonfinite", value, m, mad, scale, score, z_threshold, w)
    if len(w) < min_history:
        return Verdict(False, "", value, m, mad, scale, score, z_threshold, w)
    tripped = score > z_threshold
    return Verdict(tripped, "robust_z" if tripped else "", value, m, mad, scale, score, z_threshold, w)
