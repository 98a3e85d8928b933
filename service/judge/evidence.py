"""Sufficient statistics per route, evidence window, source, arm and segment.

A *window* is a stretch of time with one traffic split: it opens whenever the
rollout's phase, step or `since` changes (a step, a pause, a resume). Records
go to the window that contains their timestamp, so stable and candidate
outcomes are only ever compared with data of the same window (concurrent
data); the judge combines windows with per-window weights (stats.py), never by
pooling an arm across windows. Everything resets when a new rollout starts
(a new stable/candidate pair).

Sources and arms:
  live/stable      OutcomeEvent role=stable (requests; feedback via kind=feedback)
  live/candidate   OutcomeEvent role=canary
  shadow/candidate EvaluationRecord.candidate (+ agreement counts)
  shadow/stable    the same records' live stable answer (stable_latency_s, stable_cost_usd)
  shadow/replay    the stable asked again on the same request (`stable_again`, when records carry it)

Records are idempotent by request_id (DESIGN §8): a record delivered twice (at least once delivery,
a spool replay after an outage, a shadow worker re-evaluating after a crash, a restarted controller
reading back) counts once. The ids of the last DEDUP_MEMORY accepted records are remembered.
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np

from service.config import RouteConfig
from service.judge import stats
from service.judge.catalog import MODEL_CAUSES, Arm, MetricSpec, route_segments
from service.judge.comparisons import LATENCY_EDGES
from service.recent import Recent
from service.records import EvaluationRecord, OutcomeEvent, RolloutState

log = logging.getLogger("modelcanary.judge")

DEDUP_MEMORY = 100_000     # accepted record ids remembered per route (duplicates arrive close together)

_CAUSE_INDEX = {c: i for i, c in enumerate(MODEL_CAUSES)}
_NBINS = len(LATENCY_EDGES) - 1


_EDGES = LATENCY_EDGES.tolist()  # bisect on a list: a tenth of np.searchsorted's cost on one value


def latency_bin(latency_s: float) -> int:
    return min(max(bisect_right(_EDGES, latency_s) - 1, 0), _NBINS - 1)


@dataclass
class ArmAcc:
    """Counters of one arm in one window and segment."""

    n: int = 0                 # requests with an outcome
    completed: int = 0
    model_failed: int = 0
    causes: np.ndarray = field(default_factory=lambda: np.zeros(len(MODEL_CAUSES)))
    retries: int = 0
    latency: np.ndarray = field(default_factory=lambda: np.zeros(_NBINS))  # completed requests only
    cost_n: int = 0
    sum_c: float = 0.0
    sum_c2: float = 0.0
    sum_d: float = 0.0
    sum_cd: float = 0.0
    fb_n: int = 0
    fb_success: int = 0
    agree_n: int = 0
    agree_x: int = 0
    floor_n: int = 0
    floor_x: int = 0

    def add_request(self, outcome: str, cause: str | None, blame: str | None, latency_s: float | None,
                    cost_usd: float | None, client_retry: bool = False) -> None:
        self.n += 1
        done = outcome == "completed"
        if done:
            self.completed += 1
            if latency_s is not None and latency_s >= 0:
                self.latency[latency_bin(latency_s)] += 1
        elif blame == "model":
            self.model_failed += 1
            if cause in _CAUSE_INDEX:
                self.causes[_CAUSE_INDEX[cause]] += 1
        if client_retry:
            self.retries += 1
        if cost_usd is not None:
            c = float(cost_usd)
            d = 1.0 if done else 0.0
            self.cost_n += 1
            self.sum_c += c
            self.sum_c2 += c * c
            self.sum_d += d
            self.sum_cd += c * d

    def fields(self, key: str) -> np.ndarray:
        if key == "completed":
            return np.array([self.n, self.completed], dtype=float)
        if key == "model_failed":
            return np.array([self.n, self.model_failed], dtype=float)
        if key.startswith("cause:"):
            return np.array([self.n, self.causes[_CAUSE_INDEX[key[6:]]]], dtype=float)
        if key == "retry":
            return np.array([self.n, self.retries], dtype=float)
        if key == "feedback":
            return np.array([self.fb_n, self.fb_success], dtype=float)
        if key == "latency":
            return self.latency
        if key == "cost":
            return np.array([self.cost_n, self.sum_c, self.sum_c2, self.sum_d, self.sum_cd], dtype=float)
        if key == "agree":
            return np.array([self.agree_n, self.agree_x], dtype=float)
        if key == "floor":
            return np.array([self.floor_n, self.floor_x], dtype=float)
        raise KeyError(key)

    @staticmethod
    def width(key: str) -> int:
        return {"latency": _NBINS, "cost": 5}.get(key, 2)


@dataclass
class Window:
    key: tuple
    start: float
    accs: dict[tuple[str, str, str], ArmAcc] = field(default_factory=dict)
    candidate_requests: int = 0    # live canary outcomes (min_samples_per_step counts these)
    shadow_records: int = 0        # evaluation records (min_shadow_samples counts these)

    def acc(self, arm: Arm, segment: str) -> ArmAcc:
        k = (arm[0], arm[1], segment)
        a = self.accs.get(k)
        if a is None:
            a = self.accs[k] = ArmAcc()
        return a


def window_key(state: RolloutState) -> tuple:
    return (state.phase, state.step_index, round(state.since, 6))


class RouteEvidence:
    """Evidence of one rollout (one stable/candidate pair) of one route."""

    def __init__(self, route: str, rc: RouteConfig, stable: str, candidate: str | None):
        self.route = route
        self.rc = rc
        self.stable = stable
        self.candidate = candidate
        self.segments = route_segments(rc)
        self._known = set(self.segments)
        self.windows: list[Window] = []
        self.dropped = 0  # records older than the rollout (or of another model pair)
        self.duplicates = 0  # records already counted (same request_id)
        self._seen = Recent(DEDUP_MEMORY)
        self.shadow_stats = _make_shadow_stats()

    # ---- windows ----------------------------------------------------------------------------
    def sync(self, state: RolloutState) -> None:
        """Open a new window when the phase, step or `since` changed."""
        key = window_key(state)
        if self.windows and self.windows[-1].key == key:
            return
        start = state.since if not self.windows else max(state.since, self.windows[-1].start)
        self.windows.append(Window(key=key, start=start))

    def _window_for(self, ts: float) -> Window | None:
        for w in reversed(self.windows):
            if ts >= w.start:
                return w
        return None

    @property
    def current(self) -> Window | None:
        return self.windows[-1] if self.windows else None

    # ---- records ----------------------------------------------------------------------------
    def _first(self, key: tuple) -> bool:
        """Remember `key`; False (a duplicate, counted) when it was seen already."""
        if self._seen.add(key):
            return True
        self.duplicates += 1
        return False

    def _segments_of(self, segment: str) -> tuple[str, ...]:
        # Unknown segment names count towards `overall` only (the comparison budget is fixed).
        return ("overall", segment) if segment in self._known and segment != "overall" else ("overall",)

    def add_outcome(self, ev: OutcomeEvent) -> bool:
        if ev.role == "stable" and ev.model == self.stable:
            arm: Arm = ("live", "stable")
        elif ev.role == "canary" and ev.model == self.candidate:
            arm = ("live", "candidate")
        else:
            return False
        w = self._window_for(ev.ts)
        if w is None:
            self.dropped += 1
            return False
        segs = self._segments_of(ev.segment)
        if ev.kind == "feedback":
            # feedback by session shares its id with the session's other feedback: its time tells them apart
            if ev.success is None or not self._first(("feedback", ev.request_id, ev.ts)):
                return False
            for s in segs:
                a = w.acc(arm, s)
                a.fb_n += 1
                a.fb_success += int(bool(ev.success))
            return True
        if ev.outcome is None or not self._first(("request", ev.request_id)):
            return False
        for s in segs:
            w.acc(arm, s).add_request(ev.outcome, ev.cause, ev.blame, ev.latency_s, ev.cost_usd, ev.client_retry)
        if arm[1] == "candidate":
            w.candidate_requests += 1
        return True

    def add_evaluation(self, rec: EvaluationRecord) -> bool:
        if rec.candidate_model != self.candidate or rec.stable_model != self.stable:
            return False
        w = self._window_for(rec.ts)
        if w is None:
            self.dropped += 1
            return False
        if not self._first(("evaluation", rec.request_id)):
            return False
        cand = rec.candidate
        for s in self._segments_of(rec.segment):
            a = w.acc(("shadow", "candidate"), s)
            a.add_request(cand.outcome, cand.cause, cand.blame, cand.latency_s, cand.cost_usd)
            ag = rec.agreement
            if ag.candidate_vs_stable is not None:
                a.agree_n += 1
                a.agree_x += int(ag.candidate_vs_stable)
            if ag.stable_vs_stable is not None:
                a.floor_n += 1
                a.floor_x += int(ag.stable_vs_stable)
            again = rec.stable_again
            if again is not None:
                w.acc(("shadow", "replay"), s).add_request(again.outcome, again.cause, again.blame, None, None)
            if rec.stable_latency_s is not None or rec.stable_cost_usd is not None:
                # Only requests the stable served successfully are shadowed: its side completed.
                w.acc(("shadow", "stable"), s).add_request("completed", None, None, rec.stable_latency_s,
                                                           rec.stable_cost_usd)
        w.shadow_records += 1
        if self.shadow_stats is not None:
            try:
                self.shadow_stats.add(rec)
            except Exception:  # the report must never stop the judge
                log.exception("shadow report failed on %s", rec.request_id)
        return True

    # ---- arrays for the tests -------------------------------------------------------------------
    def arms(self, spec: MetricSpec, segments: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(stable, candidate) arrays shaped (segments, windows, fields) for one spec."""
        segs = segments or self.segments
        ws, wc = ArmAcc.width(spec.stable_field), ArmAcc.width(spec.candidate_field)
        nw = max(len(self.windows), 1)
        s_arr = np.zeros((len(segs), nw, ws))
        c_arr = np.zeros((len(segs), nw, wc))
        for j, w in enumerate(self.windows):
            for i, seg in enumerate(segs):
                a = w.accs.get((spec.stable_arm[0], spec.stable_arm[1], seg))
                if a is not None:
                    s_arr[i, j] = a.fields(spec.stable_field)
                b = w.accs.get((spec.candidate_arm[0], spec.candidate_arm[1], seg))
                if b is not None:
                    c_arr[i, j] = b.fields(spec.candidate_field)
        return s_arr, c_arr

    def step_samples(self, phase: str) -> int:
        w = self.current
        if w is None:
            return 0
        return w.shadow_records if phase == "shadow" else w.candidate_requests

    def totals(self, arm: Arm, segment: str) -> ArmAcc:
        """One arm's counters summed over all windows (for display only)."""
        out = ArmAcc()
        for w in self.windows:
            a = w.accs.get((arm[0], arm[1], segment))
            if a is None:
                continue
            for name in ("n", "completed", "model_failed", "retries", "cost_n", "sum_c", "sum_c2", "sum_d",
                         "sum_cd", "fb_n", "fb_success", "agree_n", "agree_x", "floor_n", "floor_x"):
                setattr(out, name, getattr(out, name) + getattr(a, name))
            out.causes = out.causes + a.causes
            out.latency = out.latency + a.latency
        return out

    # ---- display ----------------------------------------------------------------------------------
    def live_summary(self) -> dict:
        """Per segment and arm: the live canary comparison's raw numbers with 95 % (Wilson) intervals."""
        segments = {}
        for seg in self.segments:
            arms = {}
            for name, arm in (("stable", ("live", "stable")), ("candidate", ("live", "candidate"))):
                t = self.totals(arm, seg)
                if t.n == 0 and t.fb_n == 0:
                    continue
                arms[name] = arm_summary(t)
            if arms:
                segments[seg] = arms
        return {"windows": len(self.windows), "segments": segments}


def _rate(x: float, n: float) -> dict:
    lo, hi = stats.wilson_interval(x, n)
    return {"value": (x / n) if n else None, "count": int(x), "n": int(n),
            "interval": [float(lo), float(hi)] if n else None}


def arm_summary(t: ArmAcc) -> dict:
    out: dict = {"n": t.n, "completion_rate": _rate(t.completed, t.n),
                 "model_failure_rate": _rate(t.model_failed, t.n),
                 "client_retry_rate": _rate(t.retries, t.n)}
    causes = {c: _rate(t.causes[i], t.n) for i, c in enumerate(MODEL_CAUSES) if t.causes[i] > 0}
    if causes:
        out["failures_by_cause"] = causes
    if t.latency.sum() > 0:
        out["latency_p50_s"] = float(stats.histogram_quantile(t.latency, LATENCY_EDGES, 0.5))
        out["latency_p95_s"] = float(stats.histogram_quantile(t.latency, LATENCY_EDGES, 0.95))
    if t.sum_d > 0 and t.sum_c > 0:
        out["cost_per_completion_usd"] = t.sum_c / t.sum_d
    if t.fb_n:
        out["task_success_rate"] = _rate(t.fb_success, t.fb_n)
    return out


def _make_shadow_stats():
    """service.judge.shadow_report.ShadowStats when that module is installed, else None."""
    try:
        from service.judge.shadow_report import ShadowStats
    except ImportError:
        return None
    try:
        return ShadowStats()
    except Exception:
        log.exception("cannot create ShadowStats; the report goes without its shadow part")
        return None
