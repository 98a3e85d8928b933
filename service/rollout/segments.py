"""rollout.scope segment: each segment's own phase machine, and the route's summary of them.

A segment joins the rollout (in shadow, since the rollout began) when its first traffic is judged,
or when an operator names it. It is then a small route of its own: shadow → steps → promoted or
rolled_back, one candidate at a time canaried live. A candidate confidently worse in a segment is
ruled out there; the segment goes back to shadow while another candidate is still in, and is
rolled back (the stable model keeps it) when none is.

The route's phase summarises its segments: promoted when every one is, rolled_back when every one
is, partial when all have finished otherwise; while any is still deciding it is canary (shadow
while all are in shadow, paused while all those deciding are paused).
"""

from __future__ import annotations

from typing import Literal

from service.config import RouteConfig
from service.judge.catalog import route_segments
from service.judge.segments import SegmentVerdict, candidates_of, merge, rollout_start
from service.records import LastDecision, Phase, RolloutState, SegmentState

Action = Literal["promote", "pause", "resume", "rollback"]
TERMINAL = ("promoted", "rolled_back", "partial")
SEVERITY = {"hold": 0, "step": 1, "promote": 2, "rollback": 3}


class TransitionError(ValueError):
    """An operator action that the current phase does not allow (HTTP 409)."""


class UnknownSegment(ValueError):
    """An operator named a segment the route does not have (HTTP 404)."""


def joined(state: RolloutState, rc: RouteConfig, name: str) -> SegmentState:
    """The segment's state, a new one in shadow (since the rollout began) if it has not joined yet."""
    seg = state.segments.get(name)
    if seg is not None:
        return seg
    known = [s for s in route_segments(rc) if s != "overall"]
    if name not in known:
        raise UnknownSegment(f"route {state.route!r} has no segment {name[:64]!r}; its segments: {', '.join(known)}")
    return SegmentState(phase="shadow", since=rollout_start(state))


def transition(state: RolloutState, name: str, seg: SegmentState, action: Action, decision: LastDecision,
               steps: list[float], now: float) -> SegmentState:
    """An operator's action on one segment. `promote` out of shadow canaries the first candidate that
    passed shadow there (else the first not ruled out); `rollback` rules out every candidate left.
    A pause and its resume keep the step, and `since` with it: its samples and time carry on."""
    where = f"route {state.route!r} segment {name!r}"
    if seg.phase in TERMINAL:
        raise TransitionError(f"{where} is {seg.phase}; name new candidates in the config and reload")
    update: dict = {"last_decision": decision, "recommendation": None}
    if action == "promote":
        update |= _promote(state, where, seg, decision, steps) | {"since": now}
    elif action == "pause":
        if seg.phase == "paused":
            raise TransitionError(f"{where} is already paused")
        update |= {"phase": "paused", "paused_from": seg.phase}
    elif action == "resume":
        if seg.phase != "paused":
            raise TransitionError(f"{where} is not paused (phase {seg.phase})")
        update |= {"phase": seg.paused_from or "shadow", "paused_from": None}
    else:
        out = {c: decision for c in candidates_of(state) if c not in seg.rejected}
        update |= {"phase": "rolled_back", "canary_weight": 0.0, "candidate": None, "paused_from": None,
                   "passed": [], "rejected": {**seg.rejected, **out}, "since": now}
    return seg.model_copy(update=update)


def _promote(state: RolloutState, where: str, seg: SegmentState, decision: LastDecision,
              steps: list[float]) -> dict:
    """An operator's promote of one segment: one step on, a candidate picked out of shadow; past the
    last step it is recorded as a `promote`, as the judge's (`apply`)."""
    if seg.phase == "paused":
        raise TransitionError(f"{where} is paused; resume it first")
    update: dict = {}
    if seg.candidate is None:
        pick = next(iter([*seg.passed, *(c for c in candidates_of(state) if c not in seg.rejected)]), None)
        if pick is None:
            raise TransitionError(f"{where}: every candidate is ruled out here")
        update |= {"candidate": pick, "selected": f"{decision.by}: {'passed shadow first' if seg.passed else 'first not ruled out'}"}
    update |= _forward(seg.step_index, steps)
    if update["phase"] == "promoted":
        update["last_decision"] = decision.model_copy(update={"decision": "promote"})
    return update


def _forward(step_index: int, steps: list[float]) -> dict:
    nxt = step_index + 1
    if nxt < len(steps):
        return {"phase": "canary", "step_index": nxt, "canary_weight": steps[nxt] / 100.0}
    return {"phase": "promoted", "step_index": len(steps), "canary_weight": 1.0}


def apply(state: RolloutState, seg: SegmentState, v: SegmentVerdict, steps: list[float], auto: bool,
          now: float) -> SegmentState:
    """The judge's verdict on one segment. In advisory mode (`auto` False) only recorded."""
    d = v.decision
    if not auto or (d.decision == "hold" and not v.rejected):
        return seg.model_copy(update={"recommendation": d, "passed": list(v.passed)})
    rejected = {**seg.rejected, **v.rejected}
    if d.decision == "hold":  # a candidate ruled out while others are still in: the split stays
        return seg.model_copy(update={"recommendation": d, "passed": list(v.passed), "rejected": rejected,
                                      "last_decision": combined(list(v.rejected.values()), now)})
    update: dict = {"last_decision": d, "recommendation": None, "since": now, "passed": list(v.passed),
                    "rejected": rejected}
    if d.decision == "rollback":
        left = [c for c in candidates_of(state) if c not in rejected]
        update |= {"canary_weight": 0.0, "step_index": -1, "candidate": None, "selected": None,
                   "phase": "shadow" if left else "rolled_back"}
    elif d.decision == "promote":
        update |= {"phase": "promoted", "step_index": len(steps), "canary_weight": 1.0}
    else:
        if seg.candidate is None:
            update |= {"candidate": v.pick, "selected": v.selected}
        update |= _forward(seg.step_index, steps)
        if update["phase"] == "promoted":
            update["last_decision"] = d.model_copy(update={"decision": "promote"})
    return seg.model_copy(update=update)


def summary(segments: dict[str, SegmentState]) -> tuple[Phase, float]:
    """The route's phase and weight (the largest segment's) from its segments."""
    if not segments:
        return "shadow", 0.0
    phases = {s.phase for s in segments.values()}
    weight = max(s.canary_weight for s in segments.values())
    if phases <= {"promoted", "rolled_back"}:
        return (phases.pop() if len(phases) == 1 else "partial"), weight
    deciding = phases - {"promoted", "rolled_back"}
    if deciding == {"paused"}:
        return "paused", weight
    return ("shadow" if phases == {"shadow"} else "canary"), weight


def moved(old: SegmentState | None, new: SegmentState) -> bool:
    """A change of the segment's split: the route opens a new evidence window."""
    if old is None:
        return new.phase != "shadow"
    return (old.phase, old.step_index, old.candidate) != (new.phase, new.step_index, new.candidate)


def strongest(decisions: list[LastDecision]) -> LastDecision:
    """The most severe of one operator action's decisions on several segments (a promote over a step)."""
    return max(decisions, key=lambda d: SEVERITY[d.decision])


def combined(decisions: list[LastDecision], now: float) -> LastDecision | None:
    """One route-level decision from segment decisions: the most severe kind, every segment's reasons."""
    if not decisions:
        return None
    return merge(max((d.decision for d in decisions), key=SEVERITY.__getitem__), decisions, now)
