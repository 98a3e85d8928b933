"""Rollout state per route: the phase machine, persistence and the routing table.

The proxy reads `routing` on the hot path (a dict lookup). Changes come from
operators (admin API), the controller's decisions, a config reload, or, in
Kafka mode, the rollouts topic (latest version wins).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service import metrics
from service.config import Config, RouteConfig
from service.records import LastDecision, RolloutState

log = logging.getLogger("modelcanary.rollout")

Action = Literal["promote", "pause", "resume", "rollback"]
ACTIONS: tuple[Action, ...] = ("promote", "pause", "resume", "rollback")
TERMINAL = ("promoted", "rolled_back")


class TransitionError(ValueError):
    """An operator action that the current phase does not allow (HTTP 409)."""


@dataclass(frozen=True, slots=True)
class Split:
    """What the hot path needs to route one request."""

    stable: str
    canary: str | None
    weight: float


def split_of(state: RolloutState) -> Split:
    if state.candidate is None or state.phase == "rolled_back":
        return Split(state.stable, None, 0.0)
    if state.phase == "promoted":
        return Split(state.candidate, None, 0.0)
    return Split(state.stable, state.candidate, state.canary_weight)


def fresh_state(route: str, rc: RouteConfig, version: int = 0) -> RolloutState:
    if rc.candidate is None:
        return RolloutState(route=route, stable=rc.stable, candidate=None, phase="promoted",
                            canary_weight=0.0, step_index=-1, since=time.time(), version=version)
    return RolloutState(route=route, stable=rc.stable, candidate=rc.candidate, phase="shadow",
                        canary_weight=0.0, step_index=-1, since=time.time(), version=version)


class RolloutBook:
    """All routes' rollout states. Every change goes through `_commit`."""

    def __init__(self, config: Config, persist_path: Path | None = None,
                 publish: Callable[[RolloutState], None] | None = None):
        self._config = config
        self._persist_path = persist_path
        self._publish = publish
        self._listeners: list[Callable[[RolloutState, RolloutState | None], None]] = []
        self.states: dict[str, RolloutState] = {}
        self.routing: dict[str, Split] = {}
        saved = self._load_saved()
        for route, rc in config.routes.items():
            prior = saved.get(route)
            if prior is not None and prior.stable == rc.stable and prior.candidate == rc.candidate:
                self._set(prior)
            else:
                self._set(fresh_state(route, rc, version=(prior.version + 1) if prior else 0))

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

    # ---- changing ------------------------------------------------------------------------
    def operate(self, route: str, action: Action, by: str = "operator", reason: str | None = None) -> RolloutState:
        state = self.states[route]
        why = reason or f"{action} by {by}"
        decision = LastDecision(decision=_decision_of(action), reasons=[why], ts=time.time(), by=by)
        return self._commit(self._transition(state, action, decision))

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
        """Store the controller's latest capability matrix (no decision is counted)."""
        state = self.states[route]
        return self._commit(state.model_copy(update={"report": report, "version": state.version + 1}), count=None)

    def adopt(self, incoming: RolloutState) -> bool:
        """Follow a state published elsewhere (Kafka mode): newer version of a known route wins."""
        current = self.states.get(incoming.route)
        if current is None or precedence(incoming) <= precedence(current):
            return False
        if incoming.stable != current.stable or incoming.candidate != current.candidate:
            rc = self._config.routes.get(incoming.route)
            if rc is None or rc.stable != incoming.stable or rc.candidate != incoming.candidate:
                return False
        old = current
        self._set(incoming)
        self._save()
        for listener in self._listeners:
            listener(incoming, old)
        return True

    def reload(self, config: Config) -> list[str]:
        """Adopt a new config; a route whose stable or candidate changed starts a new rollout."""
        self._config = config
        restarted = []
        for route, rc in config.routes.items():
            prior = self.states.get(route)
            if prior is not None and prior.stable == rc.stable and prior.candidate == rc.candidate:
                continue
            state = fresh_state(route, rc, version=(prior.version + 1) if prior else 0)
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
    def _transition(self, state: RolloutState, action: Action, decision: LastDecision) -> RolloutState:
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
        self._set(state)
        self._save()
        if count == "phase" and state.last_decision is not None:
            count = state.last_decision.decision
        if count and count != "phase":
            metrics.rollout_decisions_total.labels(state.route, count).inc()
        if self._publish is not None:
            self._publish(state)
        for listener in self._listeners:
            listener(state, old)
        return state

    def _set(self, state: RolloutState) -> None:
        self.states[state.route] = state
        self.routing[state.route] = split_of(state)
        metrics.set_rollout(state.route, state.phase, state.canary_weight if state.phase != "promoted" else 1.0)

    def _load_saved(self) -> dict[str, RolloutState]:
        if self._persist_path is None or not self._persist_path.exists():
            return {}
        try:
            raw = json.loads(self._persist_path.read_text())
            return {s["route"]: RolloutState.model_validate(s) for s in raw.get("rollouts", [])}
        except (OSError, ValueError) as e:
            log.error("ignoring unreadable rollout state %s: %s", self._persist_path, e)
            return {}

    def _save(self) -> None:
        if self._persist_path is None:
            return
        self._persist_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._persist_path.with_suffix(".tmp")
        payload = {"rollouts": [s.model_dump(mode="json", by_alias=True) for s in self.states.values()]}
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, self._persist_path)


def precedence(state: RolloutState) -> tuple[int, int, float]:
    """Newer version wins; on a tie (an operator and the controller committing at once) the
    operator's action, then the later one, so every replica settles on the same state."""
    by_operator = int(state.last_decision is not None and state.last_decision.by == "operator")
    return state.version, by_operator, state.since


def _decision_of(action: Action) -> Literal["step", "hold", "promote", "rollback"]:
    return {"promote": "step", "pause": "hold", "resume": "hold", "rollback": "rollback"}[action]
