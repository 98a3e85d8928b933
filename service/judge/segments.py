"""rollout.scope segment: the judge's rule applied to each segment on its own, for each candidate.

A segment is judged only on its own comparisons (`overall` decides nothing here): each candidate
still in there gets `decide()`'s verdict on them, as if the segment were a route of its own (its
phase, step and `since`; its own samples). A candidate confidently worse in a segment is ruled out
there. Out of shadow, the segment canaries one candidate among those that passed shadow there,
picked by `rollout.select`:

  first     the first listed in `candidates`
  cheapest  the lowest cost per completion against stable's in that segment
  best      the highest completion rate against stable's in that segment
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from service.config import RouteConfig
from service.judge.catalog import route_segments
from service.judge.decide import Comparison, analysis, decide
from service.judge.evidence import RouteEvidence
from service.records import LastDecision, RolloutState, SegmentState

MAX_HOLD_LINES = 2   # per candidate, in a segment's hold reasons


@dataclass(frozen=True)
class SegmentVerdict:
    decision: LastDecision                    # hold | step | promote | rollback; reasons name the segment
    pick: str | None = None                   # leaving shadow: the candidate canaried next
    selected: str | None = None               # why `pick` (rollout.select)
    passed: tuple[str, ...] = ()              # passed shadow, not picked, not ruled out, in select order
    rejected: dict[str, LastDecision] = field(default_factory=dict)   # ruled out here by this verdict


def candidates_of(state: RolloutState) -> list[str]:
    return state.candidates or ([state.candidate] if state.candidate else [])


def rollout_start(state: RolloutState) -> float:
    return state.windows[0][2] if state.windows else state.since


def seen(evidence: Iterable[RouteEvidence]) -> set[str]:
    """Segments with any record (a live outcome or a shadow evaluation) in the rollout's evidence."""
    return {key[2] for ev in evidence for w in ev.windows for key in w.accs if key[2] != "overall"}


def decide_segments(state: RolloutState, rc: RouteConfig, comparisons: dict[str, list[Comparison]],
                    evidence: dict[str, RouteEvidence], now: float) -> dict[str, SegmentVerdict]:
    """A verdict for every segment in shadow or canary, segments seen for the first time included
    (they join in shadow since the rollout began)."""
    names = set(state.segments) | seen(evidence.values())
    out = {}
    for name in (s for s in route_segments(rc) if s in names):
        seg = state.segments.get(name) or SegmentState(phase="shadow", since=rollout_start(state))
        if seg.phase in ("shadow", "canary"):
            out[name] = _verdict(state, rc, name, seg, comparisons, evidence, now)
    return out


def _verdict(state: RolloutState, rc: RouteConfig, name: str, seg: SegmentState,
             comparisons: dict[str, list[Comparison]], evidence: dict[str, RouteEvidence], now: float) -> SegmentVerdict:
    several = len(candidates_of(state)) > 1
    live = [c for c in candidates_of(state) if c not in seg.rejected and c in evidence]
    own: dict[str, LastDecision] = {}
    for c in live:
        canaried = c == seg.candidate
        sub = state.model_copy(update={"candidate": c, "phase": "canary" if canaried else "shadow",
                                       "step_index": seg.step_index if canaried else -1, "since": seg.since})
        mine = [replace(x, segment="overall") for x in comparisons.get(c, ()) if x.segment == name]
        samples = evidence[c].segment_samples(name, shadow=not canaried, since=seg.since)
        d = decide(sub, rc, mine, samples, now)
        if d is not None:
            own[c] = relabel(d, name, c if several else None)
    # ruled out: confidently worse; or inconclusive past max_step_seconds (on_inconclusive rollback) on
    # its own clock, not while it waits for the segment's canaried candidate
    rejected = {c: d for c, d in own.items() if d.decision == "rollback" and (
        seg.candidate in (None, c) or any(e.verdict == "worse" for e in d.evidence))}
    left = [c for c in live if c not in rejected]
    ready = [c for c in left if c != seg.candidate and (c in seg.passed or own.get(c, _HOLD).decision == "step")]
    passed, why = rank(rc, ready, comparisons, name)
    if seg.candidate is not None and seg.candidate in own:
        return SegmentVerdict(own[seg.candidate], passed=tuple(passed), rejected=rejected)
    if not left:  # every candidate ruled out here: the reasons of each, the earliest first
        return SegmentVerdict(merge("rollback", [*seg.rejected.values(), *rejected.values()], now), rejected=rejected)
    if passed:
        pick = passed[0]
        base = own.get(pick) or LastDecision(decision="step", ts=now)
        d = base.model_copy(update={"decision": "step", "reasons": [f"segment {name}: {why}", *base.reasons]})
        return SegmentVerdict(d, pick=pick, selected=why, passed=tuple(passed[1:]), rejected=rejected)
    holds = [own[c].model_copy(update={"reasons": own[c].reasons[:MAX_HOLD_LINES]}) for c in left if c in own]
    return SegmentVerdict(merge("hold", holds, now), rejected=rejected)


_HOLD = LastDecision(decision="hold")
_OVERALL = re.compile(r"\boverall\b")


def relabel(d: LastDecision, segment: str, candidate: str | None = None) -> LastDecision:
    """A verdict on a segment's comparisons (judged as `overall`) with the segment's name in its reasons
    and evidence, and the candidate's when the route has several."""
    where = f"segment {segment}"
    head = f"{where}, {candidate}" if candidate else where
    reasons = []
    for line in d.reasons:
        line = _OVERALL.sub(where, line).replace(f" ({where})", "")
        reasons.append(head + line[len(where):] if line.startswith(where + ":") else f"{head}: {line}")
    return d.model_copy(update={"reasons": reasons,
                                "evidence": [e.model_copy(update={"segment": segment}) for e in d.evidence]})


def merge(kind: str, decisions: list[LastDecision], now: float) -> LastDecision:
    """One decision of `kind` carrying the reasons and evidence of all `decisions`."""
    return LastDecision(decision=kind, reasons=[r for d in decisions for r in d.reasons],
                        evidence=[e for d in decisions for e in d.evidence], ts=now)


# ---- rollout.select ------------------------------------------------------------------------------------

_RULES = {"cheapest": ("cost_per_completion", 1.0, "cost per completion"),
          "best": ("completion_rate", -1.0, "completion rate")}


def rank(rc: RouteConfig, ready: list[str], comparisons: dict[str, list[Comparison]], segment: str) -> tuple[list[str], str]:
    """The candidates that passed shadow in a segment, best first by rollout.select, and why the first."""
    listed = {c: i for i, c in enumerate(rc.candidates)}
    ready = sorted(ready, key=lambda c: listed.get(c, len(listed)))
    rule = rc.rollout.select
    if not ready:
        return [], ""
    if rule == "first" or rule not in _RULES:
        others = f"; also passed: {', '.join(ready[1:])}" if len(ready) > 1 else ""
        return ready, f"{ready[0]} picked (select first: the first listed that passed shadow here{others})"
    metric, sign, label = _RULES[rule]
    found = {c: next((x for x in comparisons.get(c, ()) if x.spec.name == metric and x.segment == segment
                      and x.effect is not None), None) for c in ready}
    effects = {c: x.effect for c, x in found.items() if x is not None and x.effect is not None}  # all found
    ordered = sorted(ready, key=lambda c: (found[c] is None, sign * effects[c] if c in effects else 0.0,
                                           listed.get(c, 0)))

    def text(c: str) -> str:
        x = found[c]
        if x is None or x.effect is None:
            return f"{c} no {label} data"
        return f"{c} {'×' + format(x.effect, '.2f') if x.spec.unit == 'ratio' else format(100 * x.effect, '+.1f') + ' pts'}"

    others = f"; {', '.join(text(c) for c in ordered[1:])}" if len(ordered) > 1 else ""
    return ordered, f"{ordered[0]} picked (select {rule}: {label} vs stable here: {text(ordered[0])}{others})"


# ---- /analysis/{route} ------------------------------------------------------------------------------

def analysis_of(state: RolloutState) -> dict:
    """`analysis(state)`, with `segments` in scope segment: each segment's own verdict. The route is
    healthy unless it is rolled back or a segment still deciding is about to be; promote-ready when
    every segment is."""
    result = analysis(state)
    if state.scope != "segment":
        return result
    segments = {}
    for name, seg in state.segments.items():
        own = analysis(state.model_copy(update={"phase": seg.phase, "recommendation": seg.recommendation,
                                                "last_decision": seg.last_decision}))
        segments[name] = {k: v for k, v in own.items() if k != "route"} | {"candidate": seg.candidate,
                                                                           "canary_weight": seg.canary_weight}
    deciding = [a for name, a in segments.items() if state.segments[name].phase not in ("promoted", "rolled_back")]
    result["healthy"] = state.phase != "rolled_back" and all(a["healthy"] for a in deciding)
    result["promote_ready"] = bool(segments) and all(a["promote_ready"] for a in segments.values())
    result["segments"] = segments
    return result
