"""Prediction intervals: where a predicted iteration may land, from the trace's own iterations.

A trace holds several iterations of one job, and they differ: the same step of the same process
takes more or less time as caches, the allocator, the operating system and the data loader
have it. Every prediction simulates all of them (``sim/engine.py`` runs the whole trace, and a
cluster simulation every traced iteration on every worker), so each configuration has one
predicted time per traced iteration: a sample of how long the predicted job's step takes. The
central value is their steady median (``report.iterations.steady_median``); the interval is the
normal-theory prediction interval for one more iteration (Hahn, Meeker and Escobar,
*Statistical Intervals*, 2nd ed., 2017, section 4.6), on the logarithm of the times, so that it
stays positive and may be asymmetric:

    central * exp(-h) .. central * exp(+h),   h = t((1 + level) / 2; n - 1) * s * sqrt(1 + 1/n)

with ``s`` the standard deviation of the log times of the ``n`` steady iterations (the first and
last left out, as the central value leaves them out) and ``t`` Student's quantile with ``n - 1``
degrees of freedom, which widens the interval where a trace has few iterations to tell the
spread from (with three steady iterations, ``t`` is 2.92 at 90 %, against 1.64 with many). It
is centred on the central value, which stays what it was.

No extra simulation is run: the interval costs a few arithmetic operations per configuration.
A trace of fewer than three steady iterations gives no interval (``nan``): with one nothing
tells the spread, and with two ``t`` is 6.3 and the interval mostly says how little two samples
tell (a capture whose two steady steps differ 2x got 0.07x to 15x its central value). The
pipeline widens it (:func:`widened`) to hold the same prediction made on each run of a links
file's calibration and on each other process that captured the job (``whatif/pipeline.py``):
whole processes run at different speeds on a shared machine. What it does not hold is the
model's own error; ``bench/interval_coverage.py`` measures how often it covers real runs.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Sequence

import numpy as np
import pandas as pd

from .iterations import steady_median, steady_values

#: The interval's level: the share of iterations it should hold
LEVEL = 0.90
#: The fewest steady iterations an interval is drawn from
MIN_ITERATIONS = 3


@lru_cache(maxsize=None)
def student_t_two_sided(level: float, dof: int) -> float:
    """``t`` with ``P(|T| <= t) = level`` for Student's ``T`` with ``dof`` degrees of freedom
    (``dof`` a positive integer): bisection on the distribution's closed form for integer degrees
    of freedom (Abramowitz and Stegun, *Handbook of Mathematical Functions*, 26.7.3 and 26.7.4),
    exact to 1e-10, without scipy's import time."""
    if not 0.0 < level < 1.0 or dof < 1:
        raise ValueError(f"level must be in (0, 1) and dof at least 1, not {level} and {dof}")
    low, high = 0.0, 1.0
    while _within(high, dof) < level:
        high *= 2.0
    while high - low > 1e-10 * high:
        middle = (low + high) / 2.0
        low, high = (middle, high) if _within(middle, dof) < level else (low, middle)
    return (low + high) / 2.0


def _within(t: float, dof: int) -> float:
    """``P(|T| <= t)`` for Student's ``T`` with ``dof`` (integer) degrees of freedom."""
    theta = math.atan(t / math.sqrt(dof))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if dof % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, total = 1.0, 1.0 if dof > 1 else 0.0
        for k in range(1, (dof - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + sin * math.cos(theta) * total)
    term, total = 1.0, 1.0  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for k in range(1, dof // 2):
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return sin * total


def prediction_interval(steady_ms: Sequence[float], central_ms: float, level: float = LEVEL) -> tuple[float, float]:
    """``(low, high)`` around ``central_ms`` for one more iteration, from the steady iterations'
    predicted times ``steady_ms`` (see the module's docstring); ``(nan, nan)`` with fewer than
    ``MIN_ITERATIONS`` finite ones, or a central value that is not a positive number."""
    times = np.asarray(steady_ms, dtype=float)
    times = times[np.isfinite(times) & (times > 0)]
    if len(times) < MIN_ITERATIONS or not (np.isfinite(central_ms) and central_ms > 0):
        return math.nan, math.nan
    n = len(times)
    spread = float(np.std(np.log(times), ddof=1))
    half = student_t_two_sided(level, n - 1) * spread * math.sqrt(1.0 + 1.0 / n)
    return central_ms * math.exp(-half), central_ms * math.exp(half)


def steady_interval(predicted_ms: pd.Series, level: float = LEVEL) -> tuple[float, float]:
    """The interval around the steady median of iterations predicted ``predicted_ms``
    (``report.iterations.steady_median``), from the same steady iterations."""
    return prediction_interval(steady_values(predicted_ms), steady_median(predicted_ms), level)


def relative_interval(central_ms: float, reference_ms: float, reference: tuple[float, float]) -> tuple[float, float]:
    """The interval of a prediction that has no iterations of its own (a pipeline's step, which
    its pass builds anew from the capture's units): the ``reference``'s (the traced worker's, of
    central value ``reference_ms``) relative to its central value, applied to ``central_ms``. It
    takes the step's spread to be the compute's, as a pipeline on CPU workers mostly is."""
    low, high = reference
    if not (np.isfinite(low) and np.isfinite(high) and reference_ms > 0):
        return math.nan, math.nan
    return central_ms * low / reference_ms, central_ms * high / reference_ms


def describe(central_ms: float, low_ms: float, high_ms: float, level: float = LEVEL) -> str:
    """``193.2 ms (90 % interval 181.0-207.5)``, or the central value alone without an interval."""
    if not (np.isfinite(low_ms) and np.isfinite(high_ms)):
        return f"{central_ms:.1f} ms (no interval: fewer than {MIN_ITERATIONS} steady iterations)"
    return f"{central_ms:.1f} ms ({100 * level:g} % interval {low_ms:.1f}-{high_ms:.1f})"


def widened(row: dict, calibrated: Sequence[dict]) -> dict:
    """``row`` (a configuration's results) with its interval widened to hold the same
    configuration predicted on each run of its links' calibration (``calibrated``, their rows):
    from the lowest of all their intervals' low ends to the highest high end (a prediction
    without an interval counts as its central value). The central value stays the one the
    calibration's medians give."""
    if not calibrated:
        return row
    every = [row, *calibrated]
    lows = [r["iteration_ms_low"] if np.isfinite(r["iteration_ms_low"]) else r["iteration_ms"] for r in every]
    highs = [r["iteration_ms_high"] if np.isfinite(r["iteration_ms_high"]) else r["iteration_ms"] for r in every]
    return {**row, "iteration_ms_low": float(min(lows)), "iteration_ms_high": float(max(highs))}
