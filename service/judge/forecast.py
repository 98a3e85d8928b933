"""A forecast for each comparison that blocks promotion: how many more samples, and how long (DESIGN §12).

Promotion waits until a comparison's interval end towards "better" (the one-sided confidence
sequence at the full alpha, mixing scale at the margin) clears the margin. At the current effect
θ̂ that happens once the variance falls to V*, where the radius equals the distance from θ̂ to
the bound (`stats.variance_for_radius`). Information (1 / variance) grows with every sample at
the rate the current window shows (its own estimate's information per observation and per
second), so `needed_n` = (1/V* − 1/V) / information per observation, counted in the comparison's own
unit (catalog.sample_unit), and `eta_s` = the same over the information per second. A rate needs
a window at least RATE_MIN_AGE_S old with a candidate record in the last RATE_QUIET_S: otherwise
`eta_s` is None and `no_eta` says why. When θ̂ itself is on the wrong side of the margin no
amount of data shows non-inferiority at that effect: `needed_n` is None, and the user's choices
are a wider margin or a better candidate. Without an estimate's variance yet (an arm of one session,
whose clustered variance is infinite) there is nothing to forecast from: `needed_n` and `eta_s` are
None and `no_eta` says so. The forecast assumes the effect stays where it is; the estimate moves as data
come in, so the forecast does too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from service.judge import stats

RATE_MIN_AGE_S = 10.0   # a younger window (a step, a resume just now) gives no rate
RATE_QUIET_S = 60.0     # nor one without a candidate record for this long (no traffic)


NO_ESTIMATE = "no forecast yet: an arm has too few samples or sessions for an interval"


@dataclass(frozen=True, slots=True)
class Forecast:
    needed_n: int | None     # more observations in the comparison's unit (sample_unit); None: not at this effect
    eta_s: float | None      # how long at this step's average traffic; None when unknown or not reachable
    no_eta: str | None = None  # why eta_s is None (NO_ESTIMATE: and needed_n, as there is no estimate yet)


def rate_gap(age_s: float, quiet_s: float) -> str | None:
    """Why the current window gives no rate (None: it does), from its age and the time since its
    latest candidate record."""
    if quiet_s > RATE_QUIET_S:
        return f"no ETA: no candidate traffic in the last {RATE_QUIET_S:g} s"
    if age_s < RATE_MIN_AGE_S:
        return f"no ETA yet: the current window is {age_s:.0f} s old, a rate needs {RATE_MIN_AGE_S:g} s"
    return None


def forecast(effect: np.ndarray, var: np.ndarray, bound: np.ndarray, above: np.ndarray, alpha_within: float,
             scale: np.ndarray, info_now: np.ndarray, n_now: np.ndarray, age_s: float, quiet_s: float,
             n_total: np.ndarray) -> list[Forecast]:
    """Per row: the forecast from the estimate (effect, var), its bound and side, the within-side
    level and mixing scale, and the current window's information and count over `age_s`, its
    latest candidate record `quiet_s` ago."""
    distance = np.where(above, bound - effect, effect - bound)
    v_star = stats.variance_for_radius(distance, stats.one_sided(alpha_within), scale)
    gap = rate_gap(age_s, quiet_s)
    with np.errstate(divide="ignore", invalid="ignore"):
        more = np.maximum(1.0 / v_star - 1.0 / var, 0.0)
        per_sample = np.where(n_now > 0, info_now / n_now, (1.0 / var) / n_total)
        needed = more / per_sample
        eta = np.where(n_now > 0, more / (info_now / age_s), np.nan) if gap is None else np.full(len(more), np.nan)
    out = []
    for d, v, n, e in zip(distance, var, needed, eta):
        if not np.isfinite(v):  # no estimate's variance to grow from (an arm of one session, no samples)
            out.append(Forecast(None, None, NO_ESTIMATE))
        elif not (np.isfinite(d) and d > 0 and np.isfinite(n)):
            out.append(Forecast(None, None))
        elif np.isfinite(e):
            out.append(Forecast(int(math.ceil(n)), float(e)))
        else:
            out.append(Forecast(int(math.ceil(n)), None, gap or "no ETA: none of its samples in the current window"))
    return out


def count_text(n: int) -> str:
    """11234 → '11k', 1234 → '1.2k', 850 → '850', 1.25e6 → '1.2M'."""
    for div, suffix in ((1e6, "M"), (1e3, "k")):
        if n >= div:
            x = n / div
            return f"{x:.1f}{suffix}" if x < 10 else f"{x:.0f}{suffix}"
    return f"{n}"


def duration_text(s: float) -> str:
    """'40 s', '25 min', '1 h 50 min', '3 d 4 h'."""
    if s < 90:
        return f"{max(s, 1):.0f} s"
    m = round(s / 60)
    if m < 90:
        return f"{m} min"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def describe(where: str, label: str, f: Forecast, unit: str, effect_text: str, margin_text: str) -> str:
    """'segment tools: completion rate non-inferiority needs ~11k more canary samples (~1 h 50 min at
    current traffic)', in the comparison's own `unit`."""
    if f.needed_n is None and f.no_eta is not None:
        return f"{where}: {label} non-inferiority: {f.no_eta}"
    if f.needed_n is None:
        return (f"{where}: {label} non-inferiority cannot be shown at the current effect ({effect_text}, "
                f"margin {margin_text}): widen the margin or fix the candidate")
    if f.eta_s is not None:
        when = f" (~{duration_text(f.eta_s)} at this step's average traffic)"
    else:
        when = f" ({f.no_eta})" if f.no_eta else ""
    return f"{where}: {label} non-inferiority needs ~{count_text(f.needed_n)} more {unit}{when}"
