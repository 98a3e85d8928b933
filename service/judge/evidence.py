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
  shadow/candidate EvaluationRecord: the candidate's answer paired, per record, with the stable asked
                   again (`stable_again`: failures), the live stable answer (`stable_latency_s`,
                   `stable_cost_usd`: latency and cost) and the noise floor (agreement)

Live outcomes of one session are correlated (assignment is sticky): each live arm keeps, besides its
counts, the sums over sessions a clustered variance needs (Σ_j X_j², Σ_j X_j N_j, ...), from the
running sums of the last SESSION_MEMORY sessions (`session_id_hash`; none: the request is its own).

Records are idempotent by request_id (DESIGN §8): a record delivered twice (at least once delivery,
a spool replay after an outage, a shadow worker re-evaluating after a crash, a restarted controller
reading back) counts once. The ids of the last DEDUP_MEMORY accepted records are remembered.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from service.config import RouteConfig
from service.judge import stats
from service.judge.catalog import (
    LIVE_CANDIDATE,
    LIVE_STABLE,
    MODEL_CAUSES,
    POOLED_CANDIDATE,
    SHADOW_CANDIDATE,
    Arm,
    Part,
    route_segments,
)
from service.judge.comparisons import LATENCY_EDGES
from service.judge.shadow_report import ShadowStats
from service.recent import Recent
from service.records import JUDGE_SCORES, PASSTHROUGH_SEGMENT, EvaluationRecord, OutcomeEvent, RolloutState

log = logging.getLogger("modelcanary.judge")

DEDUP_MEMORY = 100_000     # accepted record ids remembered per route (duplicates arrive close together)

_CAUSE_INDEX = {c: i for i, c in enumerate(MODEL_CAUSES)}
_NBINS = len(LATENCY_EDGES) - 1
SESSION_MEMORY = 20_000    # open sessions remembered per route (least recently seen forgotten first)
_MIN_LATENCY_S = 1e-4      # log latency is taken of at least this


_EDGES = LATENCY_EDGES.tolist()  # bisect on a list: a tenth of np.searchsorted's cost on one value


def latency_bin(latency_s: float) -> int:
    return min(max(bisect_right(_EDGES, latency_s) - 1, 0), _NBINS - 1)


# ---- live arms: counters and per-session sums ------------------------------------------------------------
# vector() of a live arm: requests, eleven 0/1 indicators per request (completed, model-blamed failure,
# each model cause, client retry, the client's own cap reached: `max_tokens`), and the sums a
# session-clustered variance needs: Σ_j N_j², then per indicator Σ_j X_j² and Σ_j X_j N_j over
# sessions j; feedback, cost and log latency likewise.
_N = 0
_IND = 1                                   # 11 indicators: completed, model_failed, 7 causes, retry, max_tokens
_NIND = 11
_NN = _IND + _NIND                         # Σ_j N_j²
_XX = _NN + 1                              # Σ_j X_j² per indicator
_XN = _XX + _NIND                          # Σ_j X_j N_j per indicator
_FB = _XN + _NIND                          # feedback: n, successes, Σ N_j², Σ X_j N_j, Σ X_j²
_COST = _FB + 5                            # cost: n, ΣC, Σ_j C_j², ΣD, Σ_j C_j D_j, Σ_j D_j²
_LAT = _COST + 6                           # log latency: n, Σy, Σy², Σ_j Y_j², Σ_j Y_j N_j, Σ_j N_j²
_NSCALARS = _LAT + 6
_COMPLETED, _MODEL_FAILED, _CAUSE0, _RETRY, _MAX_TOKENS = 0, 1, 2, 9, 10     # offsets in the indicators
# A request alone is its own cluster, so every clustered sum is the plain sum (Σx², Σxn → Σx, ...)
# plus, within sessions, cross terms between a session's requests: ArmAcc keeps the plain counters
# (all a request without a session costs) and, in `cross`, only those cross terms (_X_* offsets).
_X_NN, _X_XX, _X_XN, _X_FB, _X_COST, _X_LAT = 0, 1, 12, 23, 26, 29
_X_WIDTH = 32
_NO_CROSS = (0.0,) * _X_WIDTH
_HIT_COMPLETED = (_COMPLETED,)
_HIT_MAX_TOKENS = (_COMPLETED, _MAX_TOKENS)  # completed, at the request's own cap (DESIGN §12)
_HIT_MODEL = (_MODEL_FAILED,)
_HIT_CAUSE = {c: (_MODEL_FAILED, _CAUSE0 + i) for i, c in enumerate(MODEL_CAUSES)}
# A session's running sums, in the per-session list: requests, the 11 indicators, feedback n and
# successes, cost, completions, latency count and Σ log latency, whether it had a cause or retry.
_S_N, _S_IND, _S_FB_N, _S_FB_X, _S_C, _S_D, _S_L, _S_Y, _S_RARE = 0, 1, 12, 13, 14, 15, 16, 17, 18
_S_WIDTH = 19


def _live_fields() -> dict[str, np.ndarray]:
    names = ["completed", "model_failed", *[f"cause:{c}" for c in MODEL_CAUSES], "retry", "max_tokens"]
    out = {name: np.array([_N, _IND + i, _NN, _XN + i, _XX + i]) for i, name in enumerate(names)}
    out["feedback"] = np.arange(_FB, _FB + 5)
    out["cost"] = np.arange(_COST, _COST + 6)
    out["latency"] = np.r_[np.arange(_NSCALARS, _NSCALARS + _NBINS), np.arange(_LAT, _LAT + 6)]
    return out


class ArmAcc:
    """Counters of one live arm in one window and segment, its latency histogram (completed requests
    only) and the cross terms of its sessions (None until a request with a session arrives)."""

    FIELDS = _live_fields()   # field set → columns of vector()
    __slots__ = ("n", "ind", "latency", "lat_n", "lat_y", "lat_yy", "cost_n", "sum_c", "sum_c2", "sum_d",
                 "sum_cd", "fb_n", "fb_success", "cross")

    def __init__(self) -> None:
        self.n = 0
        self.ind = [0] * _NIND
        self.latency = np.zeros(_NBINS)
        self.lat_n = 0
        self.lat_y = self.lat_yy = 0.0
        self.cost_n = 0
        self.sum_c = self.sum_c2 = self.sum_d = self.sum_cd = 0.0
        self.fb_n = self.fb_success = 0
        self.cross: list[float] | None = None

    completed = property(lambda self: self.ind[_COMPLETED])
    model_failed = property(lambda self: self.ind[_MODEL_FAILED])
    retries = property(lambda self: self.ind[_RETRY])
    causes = property(lambda self: np.array(self.ind[_CAUSE0:_CAUSE0 + len(MODEL_CAUSES)], dtype=float))

    def add_request(self, s: list[float] | None, outcome: str, cause: str | None, blame: str | None,
                    latency_s: float | None, cost_usd: float | None, client_retry: bool = False) -> None:
        """One request; `s` is its session's running sums (updated here), None without a session."""
        self.n += 1
        done = outcome == "completed"
        hits: tuple[int, ...]
        if done:
            hits = _HIT_MAX_TOKENS if cause == "max_tokens" else _HIT_COMPLETED
        elif blame == "model":
            hits = _HIT_CAUSE.get(cause, _HIT_MODEL) if cause else _HIT_MODEL
        else:
            hits = ()
        if client_retry:
            hits = (*hits, _RETRY)
        ind = self.ind
        for i in hits:
            ind[i] += 1
        y = None
        if done and latency_s is not None and latency_s >= 0:
            self.latency[latency_bin(latency_s)] += 1
            y = math.log(latency_s if latency_s > _MIN_LATENCY_S else _MIN_LATENCY_S)
            self.lat_n += 1
            self.lat_y += y
            self.lat_yy += y * y
        c = None
        d = 1.0 if done else 0.0
        if cost_usd is not None:
            c = float(cost_usd)
            self.cost_n += 1
            self.sum_c += c
            self.sum_c2 += c * c
            self.sum_d += d
            self.sum_cd += c * d
        if s is not None:
            self._session_terms(s, hits, y, c, d)

    def _session_terms(self, s: list[float], hits: tuple[int, ...], y: float | None, c: float | None,
                       d: float) -> None:
        """Cross terms of this request with its session's earlier ones; then the session's sums grow."""
        x = self.cross
        if x is None:
            x = self.cross = [0.0] * _X_WIDTH
        n_old = s[_S_N]
        if n_old:
            x[_X_NN] += 2 * n_old
            # (X + x)(N + 1) − XN − x = X + xN for every indicator; causes and retries are rare, so
            # they are looked at only once the session had one
            x[_X_XN + _COMPLETED] += s[_S_IND + _COMPLETED]
            x[_X_XN + _MODEL_FAILED] += s[_S_IND + _MODEL_FAILED]
            if s[_S_RARE]:
                for i in range(_CAUSE0, _NIND):
                    x[_X_XN + i] += s[_S_IND + i]
            for i in hits:
                x[_X_XX + i] += 2 * s[_S_IND + i]
                x[_X_XN + i] += n_old
        for i in hits:
            s[_S_IND + i] += 1
            if i >= _CAUSE0:
                s[_S_RARE] = 1
        s[_S_N] = n_old + 1
        if y is not None:
            y_old, l_old = s[_S_Y], s[_S_L]
            x[_X_LAT] += 2 * y_old * y
            x[_X_LAT + 1] += y_old + y * l_old
            x[_X_LAT + 2] += 2 * l_old
            s[_S_Y], s[_S_L] = y_old + y, l_old + 1
        if c is not None:
            c_old, d_old = s[_S_C], s[_S_D]
            x[_X_COST] += 2 * c_old * c
            x[_X_COST + 1] += c_old * d + c * d_old
            x[_X_COST + 2] += 2 * d_old * d
            s[_S_C], s[_S_D] = c_old + c, d_old + d

    def add_feedback(self, s: list[float] | None, success: bool) -> None:
        x_new = 1 if success else 0
        self.fb_n += 1
        self.fb_success += x_new
        if s is None:
            return
        x = self.cross
        if x is None:
            x = self.cross = [0.0] * _X_WIDTH
        n_old, x_old = s[_S_FB_N], s[_S_FB_X]
        x[_X_FB] += 2 * n_old
        x[_X_FB + 1] += x_old + x_new * n_old
        x[_X_FB + 2] += 2 * x_old * x_new
        s[_S_FB_N], s[_S_FB_X] = n_old + 1, x_old + x_new

    def vector(self) -> np.ndarray:
        """All field sets in one vector (layout above): the plain sums plus the sessions' cross terms."""
        x = self.cross or _NO_CROSS
        ind, n = self.ind, self.n
        fb_n, fb_x = self.fb_n, self.fb_success
        scalars = [n, *ind, n + x[_X_NN],
                   *[a + b for a, b in zip(ind, x[_X_XX:_X_XX + _NIND])],
                   *[a + b for a, b in zip(ind, x[_X_XN:_X_XN + _NIND])],
                   fb_n, fb_x, fb_n + x[_X_FB], fb_x + x[_X_FB + 1], fb_x + x[_X_FB + 2],
                   self.cost_n, self.sum_c, self.sum_c2 + x[_X_COST], self.sum_d, self.sum_cd + x[_X_COST + 1],
                   self.sum_d + x[_X_COST + 2],
                   self.lat_n, self.lat_y, self.lat_yy, self.lat_yy + x[_X_LAT], self.lat_y + x[_X_LAT + 1],
                   self.lat_n + x[_X_LAT + 2]]
        return np.concatenate((np.array(scalars, dtype=float), self.latency))

    def merge(self, other: ArmAcc) -> None:
        """Add another window's counters (display totals; the cross terms are not needed there)."""
        self.n += other.n
        self.ind = [a + b for a, b in zip(self.ind, other.ind)]
        self.latency = self.latency + other.latency
        for name in ("lat_n", "lat_y", "lat_yy", "cost_n", "sum_c", "sum_c2", "sum_d", "sum_cd", "fb_n",
                     "fb_success"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


# ---- shadow records: the candidate paired with the stable --------------------------------------------
# ShadowAcc.v: records and the candidate's outcome counts (its shadow outcomes join the live canary ones
# when records carry no replay); then pairs with the stable asked again, per indicator (Σd, Σd², Σc, Σs)
# with d = c − s; agreement pairs likewise; cost pairs (candidate, live stable answer, their products).
_R_N = 0
_R_X = 1                                   # 9 indicators: completed, model_failed, 7 causes
_P_N = _R_X + 9                            # records with a replay
_P = _P_N + 1                              # 9 × (Σd, Σd², Σc, Σs)
_A_N = _P + 36                             # agreement pairs
_A = _A_N + 1                              # (Σd, Σd², Σc, Σs)
_K_N = _A + 4                              # cost pairs
_K_C = _K_N + 1                            # candidate: Σc, Σc², Σd, Σcd, Σd²
_K_S = _K_C + 5                            # live stable answer: the same
_K_X = _K_S + 5                            # Σc·c_s, Σc·d_s, Σd·c_s, Σd·d_s
_SH_NSCALARS = _K_X + 4
_LAT_PAIRS = 4                             # histograms: the stable's, the candidate's, each pair's min, max


def _shadow_fields() -> dict[str, np.ndarray]:
    names = ["completed", "model_failed", *[f"cause:{c}" for c in MODEL_CAUSES]]
    out = {}
    for i, name in enumerate(names):
        out[f"replay:{name}"] = np.array([_P_N, *range(_P + 4 * i, _P + 4 * i + 4)])
        out[f"cand:{name}"] = np.array([_R_N, _R_X + i, _R_N, _R_X + i, _R_X + i])  # each record its own session
    out["agreement"] = np.arange(_A_N, _A_N + 5)
    out["cost_pairs:stable"] = np.r_[_K_N, np.arange(_K_S, _K_S + 5)]
    out["cost_pairs"] = np.r_[_K_N, np.arange(_K_C, _K_C + 5), np.arange(_K_X, _K_X + 4)]
    hist = _SH_NSCALARS
    out["latency_pairs:stable"] = np.arange(hist, hist + _NBINS)
    out["latency_pairs"] = np.arange(hist + _NBINS, hist + _LAT_PAIRS * _NBINS)
    return out


def _indicators(outcome: str, cause: str | None, blame: str | None) -> list[int]:
    if outcome == "completed":
        return [_COMPLETED]
    if blame != "model":
        return []
    return [_MODEL_FAILED, _CAUSE0 + _CAUSE_INDEX[cause]] if cause in _CAUSE_INDEX else [_MODEL_FAILED]


class ShadowAcc:
    """Shadow records of one window and segment: pairs of the candidate's answer with the stable's."""

    FIELDS = _shadow_fields()
    __slots__ = ("v", "latency", "pairs")

    def __init__(self) -> None:
        self.v = [0.0] * _SH_NSCALARS
        self.latency = np.zeros((_LAT_PAIRS, _NBINS))
        # paired shadow scores (catalog._paired): name -> [n, Σd, Σd², Σcandidate, Σstable]
        self.pairs: dict[str, list[float]] = {}

    def add_pair(self, name: str, candidate: float, stable: float) -> None:
        acc = self.pairs.get(name)
        if acc is None:
            acc = self.pairs[name] = [0.0] * 5
        d = candidate - stable
        acc[0] += 1
        acc[1] += d
        acc[2] += d * d
        acc[3] += candidate
        acc[4] += stable

    def add_record(self, rec: EvaluationRecord, cand_hits: list[int], again_hits: list[int] | None) -> None:
        v = self.v
        cand = rec.candidate
        v[_R_N] += 1
        for i in cand_hits:
            v[_R_X + i] += 1
        if again_hits is not None:
            v[_P_N] += 1
            for i in set(cand_hits) | set(again_hits):
                c = 1.0 if i in cand_hits else 0.0
                s = 1.0 if i in again_hits else 0.0
                b = _P + 4 * i
                v[b] += c - s
                v[b + 1] += (c - s) * (c - s)
                v[b + 2] += c
                v[b + 3] += s
        ag = rec.agreement
        if ag.candidate_vs_stable is not None and ag.stable_vs_stable is not None:
            c = 1.0 if ag.candidate_vs_stable else 0.0
            s = 1.0 if ag.stable_vs_stable else 0.0
            v[_A_N] += 1
            v[_A] += c - s
            v[_A + 1] += (c - s) * (c - s)
            v[_A + 2] += c
            v[_A + 3] += s
        done = cand.outcome == "completed"
        if done and cand.latency_s is not None and cand.latency_s >= 0 and rec.stable_latency_s is not None \
                and rec.stable_latency_s >= 0:
            # only requests the stable served successfully are shadowed: its live answer completed
            b_s, b_c = latency_bin(rec.stable_latency_s), latency_bin(cand.latency_s)
            h = self.latency
            h[0, b_s] += 1
            h[1, b_c] += 1
            h[2, min(b_s, b_c)] += 1
            h[3, max(b_s, b_c)] += 1
        if rec.stable_cost_usd is not None:
            c, d = float(cand.cost_usd), 1.0 if done else 0.0
            cs = float(rec.stable_cost_usd)
            v[_K_N] += 1
            for base, cc, dd in ((_K_C, c, d), (_K_S, cs, 1.0)):
                v[base] += cc
                v[base + 1] += cc * cc
                v[base + 2] += dd
                v[base + 3] += cc * dd
                v[base + 4] += dd * dd
            v[_K_X] += c * cs
            v[_K_X + 1] += c
            v[_K_X + 2] += d * cs
            v[_K_X + 3] += d

    def vector(self) -> np.ndarray:
        return np.concatenate([np.array(self.v), self.latency.ravel()])

    def fields(self, key: str) -> np.ndarray:
        """A field set outside vector(): the paired scores by name ("pair:<name>")."""
        return np.array(self.pairs.get(key[5:], _NO_PAIRS), dtype=float)


_NO_PAIRS = (0.0,) * 5
_WIDTH = {ArmAcc: _NSCALARS + _NBINS, ShadowAcc: _SH_NSCALARS + _LAT_PAIRS * _NBINS}


def paired_values(rec: EvaluationRecord, rc: RouteConfig) -> list[tuple[str, float, float]]:
    """(metric, candidate side, stable side) of each paired shadow metric the record measured.

    similarity_gap: candidate-vs-live similarity against stable-again-vs-live; judge_preference: the
    judge's verdict for the candidate against its verdict for the stable asked again (against 0
    without a noise floor); stability_gap: the candidate's k-answer stability against the stable's.
    """
    out = []
    sim = rec.similarity
    if sim.candidate_vs_stable is not None and sim.stable_vs_stable is not None:
        out.append(("similarity_gap", sim.candidate_vs_stable, sim.stable_vs_stable))
    verdict = rec.judge
    if verdict.result is not None and (verdict.noise is not None or not rc.shadow.noise_floor):
        noise = JUDGE_SCORES[verdict.noise] if verdict.noise is not None else 0.0
        out.append(("judge_preference", JUDGE_SCORES[verdict.result], noise))
    stab = rec.stability
    if stab.candidate is not None and stab.stable is not None:
        out.append(("stability_gap", stab.candidate, stab.stable))
    return out


@dataclass
class Window:
    key: tuple
    start: float
    index: int = 0
    accs: dict[tuple[str, str, str], ArmAcc | ShadowAcc] = field(default_factory=dict)
    candidate_requests: int = 0    # live canary outcomes (min_samples_per_step counts these)
    shadow_records: int = 0        # evaluation records (min_shadow_samples counts these)
    version: int = 0               # bumped by every record: arrays built from this window are stale
    last_candidate_ts: float | None = None   # the latest canary request or shadow record (its ts)

    def took_candidate(self, ts: float) -> None:
        if self.last_candidate_ts is None or ts > self.last_candidate_ts:
            self.last_candidate_ts = ts

    def acc(self, arm: Arm, segment: str) -> ArmAcc | ShadowAcc:
        k = (arm[0], arm[1], segment)
        a = self.accs.get(k)
        if a is None:
            a = self.accs[k] = ShadowAcc() if arm[0] == "shadow" else ArmAcc()
        return a

    def live_acc(self, arm: Arm, segment: str) -> ArmAcc:
        """`acc` of a live arm (always an ArmAcc)."""
        a = self.acc(arm, segment)
        assert isinstance(a, ArmAcc)
        return a

    def shadow_acc(self, segment: str) -> ShadowAcc:
        """`acc` of the shadow candidate (always a ShadowAcc)."""
        a = self.acc(SHADOW_CANDIDATE, segment)
        assert isinstance(a, ShadowAcc)
        return a


def window_key(state: RolloutState) -> tuple:
    return (state.phase, state.step_index, round(state.since, 6))


def step_began(state: RolloutState) -> float:
    """When the current step (or shadow) began. A pause and its resume open windows of their own but
    keep the step (DESIGN §5), so this is the first of the trailing windows at the same step, the
    paused ones included; `since` when the state's own window is not last in `windows`."""
    own = state.paused_from if state.phase == "paused" else state.phase
    windows = state.windows
    if not windows or (windows[-1][0], windows[-1][1], round(windows[-1][2], 6)) != window_key(state):
        return state.since
    began = state.since
    for phase, step, since in reversed(windows):
        if step != state.step_index or phase not in (own, "paused"):
            break
        began = since
    return began


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
        self._sessions: OrderedDict[tuple, list[float]] = OrderedDict()
        self._blocks: dict[tuple, tuple[int, np.ndarray]] = {}   # (arm, window) → (version, segments × vector)
        self._stacks: dict[Arm, tuple[tuple, np.ndarray]] = {}   # arm → (versions, segments × windows × vector)
        self.shadow_stats = ShadowStats()

    # ---- windows ----------------------------------------------------------------------------
    def sync(self, state: RolloutState) -> None:
        """Open a new window when the phase, step or `since` changed."""
        key = window_key(state)
        if self.windows and self.windows[-1].key == key:
            return
        start = state.since if not self.windows else max(state.since, self.windows[-1].start)
        self.windows.append(Window(key=key, start=start, index=len(self.windows)))

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

    def _segments_of(self, segment: str | None) -> tuple[str, ...]:
        # Unknown segment names count towards `overall` only (the comparison budget is fixed).
        return ("overall", segment) if segment in self._known and segment != "overall" else ("overall",)

    def _session(self, w: Window, role: str, segment: str, sid: str | None) -> list[float] | None:
        """The running sums of a session in a window, arm and segment (None: no session, its own cluster).
        A session forgotten (SESSION_MEMORY) and seen again counts as a new one."""
        if sid is None:
            return None
        key = (w.index, role, segment, sid)
        s = self._sessions.get(key)
        if s is None:
            s = self._sessions[key] = [0.0] * _S_WIDTH
            if len(self._sessions) > SESSION_MEMORY:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(key)
        return s

    def _arm_of(self, ev: OutcomeEvent) -> Arm | None:
        """The live arm an outcome counts for; none for another rollout's models, or for a call passed
        through (embeddings, files: the stable model always serves them, so they compare nothing)."""
        if ev.segment == PASSTHROUGH_SEGMENT:
            return None
        if ev.role == "stable" and ev.model == self.stable:
            return LIVE_STABLE
        if ev.role == "canary" and ev.model == self.candidate:
            return LIVE_CANDIDATE
        return None

    def add_outcome(self, ev: OutcomeEvent) -> bool:
        arm = self._arm_of(ev)
        if arm is None:
            return False
        w = self._window_for(ev.ts)
        if w is None:
            self.dropped += 1
            return False
        segs = self._segments_of(ev.segment)
        sid = ev.session_id_hash
        if ev.kind == "feedback":
            # A request's feedback counts once, the first (a client's retry or a repeat must not outweigh
            # other requests'). Feedback by session is keyed by the session (its id is the session's
            # hash), and each one counts: its time tells them apart.
            by_session = ev.request_id == sid
            if ev.success is None or not self._first(("feedback", ev.request_id) + ((ev.ts,) if by_session else ())):
                return False
            for seg in segs:
                w.live_acc(arm, seg).add_feedback(self._session(w, arm[1], seg, sid), bool(ev.success))
            w.version += 1
            return True
        if ev.outcome is None or not self._first(("request", ev.request_id)):
            return False
        for seg in segs:
            w.live_acc(arm, seg).add_request(self._session(w, arm[1], seg, sid), ev.outcome, ev.cause, ev.blame,
                                        ev.latency_s, ev.cost_usd, ev.client_retry)
        if arm is LIVE_CANDIDATE:
            w.candidate_requests += 1
            w.took_candidate(ev.ts)
        w.version += 1
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
        cand, again = rec.candidate, rec.stable_again
        cand_hits = _indicators(cand.outcome, cand.cause, cand.blame)
        again_hits = _indicators(again.outcome, again.cause, again.blame) if again is not None else None
        pairs = paired_values(rec, self.rc)
        for s in self._segments_of(rec.segment):
            a = w.shadow_acc(s)
            a.add_record(rec, cand_hits, again_hits)
            for name, candidate, stable in pairs:
                a.add_pair(name, candidate, stable)
        w.shadow_records += 1
        w.took_candidate(rec.ts)
        w.version += 1
        try:
            self.shadow_stats.add(rec)
        except Exception:  # the report must never stop the judge
            log.exception("shadow report failed on %s", rec.request_id)
        return True

    # ---- arrays for the tests -------------------------------------------------------------------
    def arms(self, part: Part) -> tuple[np.ndarray, np.ndarray]:
        """(stable, candidate) arrays shaped (segments, windows, fields) for one part of a metric."""
        return self.arm(part.stable_arm, part.stable_field), self.arm(part.candidate_arm, part.candidate_field)

    def arms_of(self, parts: list[Part]) -> tuple[np.ndarray, np.ndarray]:
        """`arms` of several parts of one test, concatenated: (parts × segments, windows, fields).
        Parts that share their arms are sliced out of the arms' vectors in one step each."""
        first = parts[0]
        if any(p.stable_arm != first.stable_arm or p.candidate_arm != first.candidate_arm
               or p.stable_field.startswith("pair:") or first.candidate_arm == POOLED_CANDIDATE for p in parts):
            arrays = [self.arms(p) for p in parts]
            return np.concatenate([a[0] for a in arrays]), np.concatenate([a[1] for a in arrays])
        return (self._many(first.stable_arm, [p.stable_field for p in parts]),
                self._many(first.candidate_arm, [p.candidate_field for p in parts]))

    def _many(self, arm: Arm, keys: list[str]) -> np.ndarray:
        fields = (ShadowAcc if arm[0] == "shadow" else ArmAcc).FIELDS
        cols = np.concatenate([fields[k] for k in keys])
        block = self._stack(arm)[..., cols]                      # (segments, windows, parts × width)
        n_seg, n_win = block.shape[:2]
        width = len(cols) // len(keys)
        out: np.ndarray = block.reshape(n_seg, n_win, len(keys), width).transpose(2, 0, 1, 3).reshape(-1, n_win, width)
        return out

    def arm(self, arm: Arm, key: str) -> np.ndarray:
        if arm == POOLED_CANDIDATE:
            pooled: np.ndarray = self.arm(LIVE_CANDIDATE, key) + self.arm(SHADOW_CANDIDATE, f"cand:{key}")
            return pooled
        if key.startswith("pair:"):
            out = np.zeros((len(self.segments), max(len(self.windows), 1), len(_NO_PAIRS)))
            for j, w in enumerate(self.windows):
                for i, seg in enumerate(self.segments):
                    a = w.accs.get((arm[0], arm[1], seg))
                    if a is not None:
                        assert isinstance(a, ShadowAcc)  # paired scores are shadow fields
                        out[i, j] = a.fields(key)
            return out
        return self._stack(arm)[..., (ShadowAcc if arm[0] == "shadow" else ArmAcc).FIELDS[key]]

    def _stack(self, arm: Arm) -> np.ndarray:
        """Every window's vectors of one arm, (segments, windows, vector); rebuilt where a window changed."""
        versions = tuple(w.version for w in self.windows)
        cached = self._stacks.get(arm)
        if cached is not None and cached[0] == versions:
            return cached[1]
        kind = ShadowAcc if arm[0] == "shadow" else ArmAcc
        blocks = []
        for w in self.windows:
            block = self._blocks.get((arm, w.index))
            if block is None or block[0] != w.version:
                accs = [w.accs.get((arm[0], arm[1], seg)) for seg in self.segments]
                vectors = [a.vector() if a is not None else None for a in accs]
                width = _WIDTH[kind]
                block = self._blocks[arm, w.index] = (w.version, np.stack(
                    [v if v is not None else np.zeros(width) for v in vectors]))
            blocks.append(block[1])
        if not blocks:
            blocks = [np.zeros((len(self.segments), _WIDTH[kind]))]
        full = np.stack(blocks, axis=1)
        self._stacks[arm] = (versions, full)
        return full

    def step_samples(self, phase: str, since: float | None = None) -> int:
        """Shadow records (`phase` shadow) or live canary outcomes in the windows opened since `since`
        (when the step began: `step_began`); without it, in the current window."""
        windows = self.windows[-1:] if since is None else [w for w in self.windows if w.start >= since - 1e-6]
        return sum(w.shadow_records if phase == "shadow" else w.candidate_requests for w in windows)

    def segment_samples(self, segment: str, shadow: bool, since: float) -> int:
        """One segment's shadow records (`shadow`) or live canary outcomes in the windows opened since
        `since` (rollout.scope segment: the segment's own step began then)."""
        arm = SHADOW_CANDIDATE if shadow else LIVE_CANDIDATE
        total = 0.0
        for w in self.windows:
            a = w.accs.get((arm[0], arm[1], segment)) if w.start >= since - 1e-6 else None
            if a is not None:
                total += a.v[_R_N] if isinstance(a, ShadowAcc) else a.n  # shadow: ShadowAcc, live: ArmAcc
        return int(total)

    def totals(self, arm: Arm, segment: str) -> ArmAcc:
        """One live arm's counters summed over all windows (for display only)."""
        out = ArmAcc()
        for w in self.windows:
            a = w.accs.get((arm[0], arm[1], segment))
            if a is not None:
                assert isinstance(a, ArmAcc)  # a live arm
                out.merge(a)
        return out

    # ---- display ----------------------------------------------------------------------------------
    def live_summary(self) -> dict:
        """Per segment and arm: the live canary comparison's raw numbers with 95 % (Wilson) intervals."""
        segments = {}
        for seg in self.segments:
            arms = {}
            for name, arm in (("stable", LIVE_STABLE), ("candidate", LIVE_CANDIDATE)):
                t = self.totals(arm, seg)
                if t.n == 0 and t.fb_n == 0:
                    continue
                arms[name] = arm_summary(t)
            if arms:
                segments[seg] = arms
        return {"windows": len(self.windows), "segments": segments}


def _rates(pairs: Mapping[str, tuple[float, float]]) -> dict[str, dict]:
    """(count, n) per name as rates with 95 % Wilson intervals, in one vectorised call."""
    x = np.array([c for c, _ in pairs.values()], dtype=float)
    n = np.array([m for _, m in pairs.values()], dtype=float)
    lo, hi = stats.wilson_interval(x, n)
    return {name: {"value": (c / m) if m else None, "count": int(c), "n": int(m),
                   "interval": [float(lo[i]), float(hi[i])] if m else None}
            for i, (name, (c, m)) in enumerate(pairs.items())}


def arm_summary(t: ArmAcc) -> dict:
    pairs = {"completion_rate": (t.completed, t.n), "model_failure_rate": (t.model_failed, t.n),
             "client_retry_rate": (t.retries, t.n)}
    pairs |= {"cause:" + c: (t.causes[i], t.n) for i, c in enumerate(MODEL_CAUSES) if t.causes[i] > 0}
    if t.fb_n:
        pairs["task_success_rate"] = (t.fb_success, t.fb_n)
    rates = _rates(pairs)
    out: dict = {"n": t.n, "completion_rate": rates["completion_rate"],
                 "model_failure_rate": rates["model_failure_rate"], "client_retry_rate": rates["client_retry_rate"]}
    causes = {name.removeprefix("cause:"): r for name, r in rates.items() if name.startswith("cause:")}
    if causes:
        out["failures_by_cause"] = causes
    if t.latency.sum() > 0:
        out["latency_p50_s"] = float(stats.histogram_quantile(t.latency, LATENCY_EDGES, 0.5))
        out["latency_p95_s"] = float(stats.histogram_quantile(t.latency, LATENCY_EDGES, 0.95))
    if t.sum_d > 0 and t.sum_c > 0:
        out["cost_per_completion_usd"] = t.sum_c / t.sum_d
    if t.fb_n:
        out["task_success_rate"] = rates["task_success_rate"]
    return out
