"""Rollout state per route: the phase machine, persistence and the routing table.

The proxy reads `routing` on the hot path (a dict lookup). Changes come from
operators (admin API), the controller's decisions, a config reload, or, in
Kafka mode, the rollouts topic (latest version wins).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service import metrics
from service.config import Config, RouteConfig
from service.judge.evidence import window_key
from service.judge.segments import SegmentVerdict, candidates_of
from service.records import LastDecision, RolloutState, SegmentState
from service.rollout import segments
from service.rollout.segments import TERMINAL, Action, TransitionError, UnknownSegment
from service.rollout.state_file import StateFile

ACTIONS: tuple[Action, ...] = ("promote", "pause", "resume", "rollback")
log = logging.getLogger("modelcanary.rollout")

__all__ = ["ACTIONS", "TERMINAL", "Action", "RolloutBook", "Split", "TransitionError", "UnknownSegment"]


@dataclass(frozen=True, slots=True)
class Split:
    """What the hot path needs to route one request; with rollout.scope segment, each segment's own
    (a segment not among them goes to the stable model)."""

    stable: str
    canary: str | None
    weight: float
    segments: Mapping[str, Split] | None = None


def split_of(state: RolloutState) -> Split:
    if state.scope == "segment":
        return Split(state.stable, None, 0.0, {name: _segment_split(state.stable, seg)
                                               for name, seg in state.segments.items()})
    if state.candidate is None or state.phase == "rolled_back":
        return Split(state.stable, None, 0.0)
    if state.phase == "promoted":
        return Split(state.candidate, None, 0.0)
    return Split(state.stable, state.candidate, state.canary_weight)


def candidate_share(state: RolloutState) -> float:
    """The share of live traffic the route's candidate gets (`rollout_canary_weight_ratio`): none on a
    route without one, which starts `promoted` (its stable is all there is)."""
    if state.candidate is None or state.phase == "rolled_back":
        return 0.0
    return 1.0 if state.phase == "promoted" else state.canary_weight


def _segment_split(stable: str, seg: SegmentState) -> Split:
    if seg.candidate is None or seg.phase == "rolled_back":
        return Split(stable, None, 0.0)
    if seg.phase == "promoted":
        return Split(seg.candidate, None, 0.0)
    return Split(stable, seg.candidate, seg.canary_weight)


def same_rollout(state: RolloutState, rc: RouteConfig) -> bool:
    """The state is of the rollout the route's config describes (same models, same scope)."""
    return (state.stable, state.candidate, candidates_of(state), state.scope) == \
        (rc.stable, rc.candidate, rc.candidates, rc.rollout.scope)


def fresh_state(route: str, rc: RouteConfig, version: int = 0, epoch: int = 0) -> RolloutState:
    now = time.time()
    if rc.candidate is None:
        return RolloutState(route=route, stable=rc.stable, candidate=None, phase="promoted",
                            canary_weight=0.0, step_index=-1, since=now, version=version, epoch=epoch,
                            scope=rc.rollout.scope)
    return RolloutState(route=route, stable=rc.stable, candidate=rc.candidate, phase="shadow",
                        canary_weight=0.0, step_index=-1, since=now, version=version, epoch=epoch,
                        windows=[("shadow", -1, now)], scope=rc.rollout.scope, candidates=list(rc.candidates))


MAX_WINDOWS = 64  # a rollout's windows kept on its state (steps, pauses, resumes): far more than happen


def with_window(state: RolloutState) -> RolloutState:
    """The state with its own window (phase, step, since) last in `windows`, as the evidence opens it."""
    if state.candidate is None:
        return state
    last = state.windows[-1] if state.windows else None
    if last is not None and (last[0], last[1], round(last[2], 6)) == window_key(state):
        return state
    windows = [*state.windows, (state.phase, state.step_index, state.since)][-MAX_WINDOWS:]
    return state.model_copy(update={"windows": windows})


class RolloutBook:
    """All routes' rollout states. Every change goes through `_commit`."""

    def __init__(self, config: Config, persist_path: Path | None = None,
                 publish: Callable[[RolloutState], None] | None = None):
        self._config = config
        self._file = StateFile(persist_path) if persist_path is not None else None
        self._publish = publish
        # the leadership epoch of the controller that owns this book, stamped on what it commits
        # (Kafka mode); None elsewhere: a change keeps the epoch of the state it derives from
        self.epoch: int | None = None
        self._listeners: list[Callable[[RolloutState, RolloutState | None], None]] = []
        self._operator_actions: set[tuple[str, float]] = set()  # (route, decision ts) applied here
        self.states: dict[str, RolloutState] = {}
        self.routing: dict[str, Split] = {}
        saved = self._file.load() if self._file is not None else {}
        for route, rc in config.routes.items():
            prior = saved.get(route)
            if prior is not None and same_rollout(prior, rc):
                self._set(prior)
            else:
                self._set(fresh_state(route, rc, version=(prior.version + 1) if prior else 0,
                                      epoch=prior.epoch if prior else 0))

    # ---- reading -------------------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The config the book currently follows (replaced by `reload`)."""
        return self._config

    def get(self, route: str) -> RolloutState:
        return self.states[route]

    def on_change(self, listener: Callable[[RolloutState, RolloutState | None], None]) -> None:
        """listener(new_state, old_state) after every committed change."""
        self._listeners.append(listener)

    def off_change(self, listener: Callable[[RolloutState, RolloutState | None], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the state file holds every committed change (writes happen off the caller's thread)."""
        return self._file.flush(timeout_s) if self._file is not None else True

    # ---- changing ------------------------------------------------------------------------
    def operate(self, route: str, action: Action, by: str = "operator", reason: str | None = None,
                segment: str | None = None) -> RolloutState:
        """An operator's action on the route, or with rollout.scope segment on one segment (`segment`;
        without it, on every segment the action applies to)."""
        state = self.states[route]
        why = reason or f"{action} by {by}" + (f" in segment {segment}" if segment else "")
        decision = LastDecision(decision=_decision_of(action), reasons=[why], ts=time.time(), by=by)
        if state.scope == "segment" and state.candidate is not None:
            return self._commit(self._segment_action(state, action, decision, segment))
        if segment is not None:
            raise TransitionError(f"route {route!r} has rollout.scope: route; a segment can be named only "
                                  "with rollout.scope: segment")
        return self._commit(self._transition(state, action, decision))

    def decide_segments(self, route: str, verdicts: dict[str, SegmentVerdict]) -> RolloutState:
        """Apply the judge's per-segment verdicts (rollout.scope segment) in one commit; a segment seen
        for the first time joins. In advisory mode they are only recorded."""
        state = self.states[route]
        if state.phase in TERMINAL or state.candidate is None:
            return state
        rc = self._config.routes[route]
        now = time.time()
        auto = rc.rollout.mode == "auto"
        new = dict(state.segments)
        acted: list[LastDecision] = []
        holds: list[LastDecision] = []
        for name, v in verdicts.items():
            old = state.segments.get(name) or segments.joined(state, rc, name)
            if old.phase == "paused":
                continue
            seg = new[name] = segments.apply(state, old, v, rc.rollout.steps, auto, now)
            if seg.last_decision is not old.last_decision and seg.last_decision is not None:
                acted.append(seg.last_decision)
                metrics.rollout_decisions_total.labels(route, seg.last_decision.decision).inc()
            elif v.decision.decision == "hold" or not auto:
                holds.append(v.decision)
        moved = any(segments.moved(state.segments.get(n), s) for n, s in new.items())
        update: dict = {"segments": new, "recommendation": segments.combined(holds, now)}
        if moved:
            update["since"] = now
        if acted:
            update["last_decision"] = segments.combined(acted, now)
        if update["recommendation"] is not None and not _same_kind(update["recommendation"], state.recommendation):
            metrics.rollout_decisions_total.labels(route, update["recommendation"].decision).inc()
        return self._commit(_summarised(state.model_copy(update=update | {"version": state.version + 1})), count=None)

    def decide(self, route: str, decision: LastDecision, report: dict | None = None) -> RolloutState:
        """Apply a controller decision; a hold (or any verdict in advisory mode) is only recorded.

        `report` (optional) replaces the state's capability matrix in the same commit.
        """
        state = self.states[route]
        rc = self._config.routes[route]
        if state.phase in TERMINAL or state.phase == "paused" or state.candidate is None:
            return self.set_report(route, report) if report is not None else state
        extra = {"report": report} if report is not None else {}
        if decision.decision == "hold" or rc.rollout.mode == "advisory":
            prev = state.recommendation
            changed = prev is None or prev.decision != decision.decision
            updated = state.model_copy(update={"recommendation": decision, "version": state.version + 1, **extra})
            return self._commit(updated, count=decision.decision if changed else None)
        action: Action = "rollback" if decision.decision == "rollback" else "promote"
        return self._commit(self._transition(state.model_copy(update=extra), action, decision))

    def set_report(self, route: str, report: dict) -> RolloutState:
        """Keep the controller's latest capability matrix on the state, here only: it is not a change
        of the rollout (no version, nothing published; Kafka mode carries it on the reports topic)."""
        state = self.states[route] = self.states[route].model_copy(update={"report": report})
        self._save()
        return state

    def republish(self, route: str) -> None:
        """Publish the route's state again, unchanged (the leader answers a deposed one's late state,
        which would otherwise be the latest record of the compacted topic)."""
        if self._publish is not None:
            self._publish(self.states[route].model_copy(update={"report": None}))

    def adopt(self, incoming: RolloutState) -> bool:
        """Follow a state published elsewhere (Kafka mode): the newer (epoch, version) of a known route
        wins. It comes without the report, so the one this book has of the same rollout stays."""
        current = self.states.get(incoming.route)
        if current is None or precedence(incoming) <= precedence(current):
            return False
        ours = (incoming.stable, candidates_of(incoming), incoming.scope) == \
            (current.stable, candidates_of(current), current.scope)
        if not ours:
            rc = self._config.routes.get(incoming.route)
            if rc is None or not same_rollout(incoming, rc):
                return False
        elif incoming.report is None and current.report is not None:
            incoming = incoming.model_copy(update={"report": current.report})
        old = current
        self._note_operator(incoming)
        self._set(incoming)
        self._save()
        for listener in self._listeners:
            listener(incoming, old)
        return True

    def adopt_operator(self, incoming: RolloutState) -> bool:
        """As the leader: keep an operator's action that a replica derived from a state older than this
        book's (it had not seen this leader's latest decisions: an older epoch, or a step committed
        meanwhile), so that an action the operator was told is done is not undone. It is committed
        again above this book's version, so every replica follows it. Not when a later operator action
        stands, nor when the judge ended the rollout meanwhile (then only a rollback still applies)."""
        current = self.states.get(incoming.route)
        decision = incoming.last_decision
        if current is None or self.epoch is None or decision is None or decision.by != "operator":
            return False
        same = (incoming.stable, candidates_of(incoming), incoming.scope) == \
            (current.stable, candidates_of(current), current.scope)
        if not same or (incoming.route, decision.ts) in self._operator_actions:
            return False
        latest = current.last_decision
        if latest is not None and latest.by == "operator" and latest.ts >= decision.ts:
            return False
        if current.phase in TERMINAL and (decision.decision != "rollback" or current.phase == "rolled_back"):
            log.warning("route %s: an operator's %s came after the rollout ended (%s); not applied", incoming.route,
                        decision.decision, current.phase)
            return False
        update: dict = {"version": max(incoming.version, current.version + 1)}
        if incoming.report is None and current.report is not None:
            update["report"] = current.report
        self._commit(incoming.model_copy(update=update), count=None)
        return True

    def _note_operator(self, state: RolloutState) -> None:
        if state.last_decision is not None and state.last_decision.by == "operator":
            self._operator_actions.add((state.route, state.last_decision.ts))

    def reload(self, config: Config) -> list[str]:
        """Adopt a new config; a route whose stable or candidate changed starts a new rollout."""
        self._config = config
        restarted = []
        for route, rc in config.routes.items():
            prior = self.states.get(route)
            if prior is not None and same_rollout(prior, rc):
                continue
            state = fresh_state(route, rc, version=(prior.version + 1) if prior else 0,
                                epoch=prior.epoch if prior else 0)
            state.last_decision = LastDecision(decision="hold", reasons=["new rollout from config reload"],
                                               ts=time.time(), by="reload")
            self._commit(state)
            restarted.append(route)
        for route in [r for r in self.states if r not in config.routes]:
            del self.states[route]
            self.routing.pop(route, None)
        self._save()
        return restarted

    # ---- internals -----------------------------------------------------------------------
    def _segment_action(self, state: RolloutState, action: Action, decision: LastDecision,
                        segment: str | None) -> RolloutState:
        rc = self._config.routes[state.route]
        if state.phase in TERMINAL:
            raise TransitionError(f"route {state.route!r} is {state.phase}; name new candidates in the config and reload")
        now = time.time()
        names = [segment] if segment is not None else list(state.segments)
        new = dict(state.segments)
        errors = []
        acted: list[LastDecision] = []
        for name in names:
            try:
                new[name] = segments.transition(state, name, segments.joined(state, rc, name), action, decision,
                                                rc.rollout.steps, now)
                acted.append(new[name].last_decision or decision)
            except TransitionError as e:
                if segment is not None:
                    raise
                errors.append(str(e))
        if new == state.segments:
            why = "; ".join(errors) or "no segment has joined the rollout yet (a segment joins with its first traffic)"
            raise TransitionError(f"route {state.route!r}: nothing to {action}: {why}")
        return _summarised(state.model_copy(update={"segments": new, "last_decision": segments.strongest(acted),
                                                    "since": now, "version": state.version + 1}))

    def _transition(self, state: RolloutState, action: Action, decision: LastDecision) -> RolloutState:  # noqa: C901 - the phase machine as one table: a branch per action
        steps = self._config.routes[state.route].rollout.steps
        phase = state.phase
        if state.candidate is None:
            raise TransitionError(f"route {state.route!r} has no candidate to roll out")
        if phase in TERMINAL:
            raise TransitionError(f"route {state.route!r} is {phase}; name a new candidate in the config and reload")
        update: dict = {"last_decision": decision, "recommendation": None}
        if action == "promote":
            if phase == "paused":
                raise TransitionError(f"route {state.route!r} is paused; resume it first")
            nxt = state.step_index + 1
            if nxt < len(steps):
                update |= {"phase": "canary", "step_index": nxt, "canary_weight": steps[nxt] / 100.0}
            else:
                update |= {"phase": "promoted", "step_index": len(steps), "canary_weight": 1.0}
                if decision.decision == "step":
                    update["last_decision"] = decision.model_copy(update={"decision": "promote"})
        elif action == "pause":
            if phase == "paused":
                raise TransitionError(f"route {state.route!r} is already paused")
            update |= {"phase": "paused", "paused_from": phase}
        elif action == "resume":
            if phase != "paused":
                raise TransitionError(f"route {state.route!r} is not paused (phase {phase})")
            update |= {"phase": state.paused_from or "shadow", "paused_from": None}
        elif action == "rollback":
            update |= {"phase": "rolled_back", "canary_weight": 0.0, "paused_from": None}
        update |= {"version": state.version + 1, "since": time.time()}
        return state.model_copy(update=update)

    def _commit(self, state: RolloutState, count: str | None = "phase") -> RolloutState:
        old = self.states.get(state.route)
        self._note_operator(state)
        if self.epoch is not None and state.epoch != self.epoch:
            state = state.model_copy(update={"epoch": self.epoch})
        state = with_window(state)
        self._set(state)
        self._save()
        if count == "phase" and state.last_decision is not None:
            count = state.last_decision.decision
        if count and count != "phase":
            metrics.rollout_decisions_total.labels(state.route, count).inc()
        if self._publish is not None:  # the state only: the report travels on its own
            self._publish(state.model_copy(update={"report": None}) if state.report is not None else state)
        for listener in self._listeners:
            listener(state, old)
        return state

    def _set(self, state: RolloutState) -> None:
        self.states[state.route] = state
        self.routing[state.route] = split_of(state)
        metrics.set_rollout(state.route, state.stable, state.candidates, state.phase, candidate_share(state))
        for name, seg in state.segments.items():
            metrics.set_segment_rollout(state.route, name, seg.phase, seg.canary_weight)

    def _save(self) -> None:
        if self._file is not None:
            self._file.save(list(self.states.values()))


def precedence(state: RolloutState) -> tuple[int, int, int, float]:
    """A newer leadership epoch wins (a deposed controller's late state is ignored, whatever its
    version), then the newer version; on a tie (an operator and the controller committing at once)
    the operator's action, then the later one, so every replica settles on the same state."""
    by_operator = int(state.last_decision is not None and state.last_decision.by == "operator")
    return state.epoch, state.version, by_operator, state.since


def _summarised(state: RolloutState) -> RolloutState:
    phase, weight = segments.summary(state.segments)
    return state.model_copy(update={"phase": phase, "canary_weight": weight})


def _same_kind(a: LastDecision | None, b: LastDecision | None) -> bool:
    return (a.decision if a else None) == (b.decision if b else None)


def _decision_of(action: Action) -> Literal["step", "hold", "promote", "rollback"]:
    return {"promote": "step", "pause": "hold", "resume": "hold", "rollback": "rollback"}[action]
