"""The controller: consumes outcomes and evaluations, runs the judge, applies its decisions.

In memory mode `modelcanary serve` runs `Controller(config, bus, book).run(stop)`
as a task next to the proxy; in Kafka mode `modelcanary control` runs `main()`
(service/rollout/leader.py): several may run, the one that leads judges.

A new leader (or a restarted controller) resumes the evidence: each route's latest
state on the rollouts topic lists the windows its rollout opened (`windows`), and the
outcomes and evaluations the controller's group had already consumed since that
rollout began are read back (`KafkaBus.replay`) before it judges again. The group
then goes on from its committed offsets; a record seen twice counts once
(RouteEvidence deduplicates by request_id).

Publishing: a state on a decision, on a change of the judge's verdict, once when a new
leader first judges a route, and otherwise at most every `control.report_interval_s`
(the verdict's reasons); the report goes on the reports topic at the same times, only
when it changed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Callable

from service.bus.base import EventBus, Subscription
from service.config import Config, RouteConfig
from service.judge.decide import Judgement, judge
from service.judge.evidence import RouteEvidence
from service.judge.matrix import capability_matrix
from service.judge.segments import candidates_of, decide_segments, rollout_start
from service.records import EvaluationRecord, LastDecision, OutcomeEvent, Record, RolloutReport, RolloutState
from service.rollout.book import MAX_WINDOWS, TERMINAL, RolloutBook
from service.rollout.feedback import REQUESTS_REMEMBERED, FeedbackResolver
from service.rollout.notify import Notifier, configured_url

log = logging.getLogger("modelcanary.controller")

GROUP = "modelcanary-controller"
MAX_BATCH = 2000
MIN_INTERVAL_S = 0.05       # the judge never runs more often than this
MAX_INTERVAL_S = 5.0        # ... and never less often than this
GATHER_S = 0.05             # records are taken at most this often: a wake-up per batch, not per request
PAUSED_WAIT_S = 0.2         # how often a paused controller (`may_decide` False) looks again


class Controller:
    """Per route: evidence, the judge's latest verdict, and the capability-matrix report."""

    def __init__(self, config: Config, bus: EventBus, book: RolloutBook, notifier: Notifier | None = None, *,
                 report_interval_s: float | None = None, clock: Callable[[], float] = time.time):
        """`notifier`: whose webhook the changes go to (the proxy's in memory mode, which a reload
        updates); else one of `config.notify`'s URL."""
        self._config = config
        self.bus = bus
        self.book = book
        self.notifier = notifier if notifier is not None else Notifier(configured_url(config.notify))
        # the interval bounds the reports topic in Kafka mode; in memory mode no topic grows
        default_interval = config.control.report_interval_s if config.events.backend == "kafka" else MAX_INTERVAL_S
        self.report_interval_s = report_interval_s or default_interval
        self.clock = clock
        self.evidence: dict[str, RouteEvidence] = {}
        # rollout.scope segment: the evidence of each candidate after the first (that one is evidence[route])
        self.more_evidence: dict[str, dict[str, RouteEvidence]] = {}
        self.judgements: dict[str, Judgement] = {}
        # in memory mode the proxy resolves all feedback: no requests to remember here
        self._resolves_feedback = config.events.backend == "kafka"
        self._proxies_notify_operators = config.events.backend == "kafka"  # see _on_change
        self.feedback = FeedbackResolver(config.control.feedback_hold_s,
                                         REQUESTS_REMEMBERED if self._resolves_feedback else 1)
        self._reported_at: dict[str, float] = {}
        self._sent_reports: dict[str, dict] = {}  # route -> the last report published, without generated_at
        self.last_tick: float | None = None
        book.on_change(self._on_change)

    # ---- timing ---------------------------------------------------------------------------------
    @property
    def interval_s(self) -> float:
        """control.interval_s when set, else the shortest min_step_seconds / 10; within the bounds."""
        every = self.config.control.interval_s or min(
            (rc.rollout.min_step_seconds / 10 for rc in self.config.routes.values() if rc.candidate),
            default=MAX_INTERVAL_S)
        return min(max(every, MIN_INTERVAL_S), MAX_INTERVAL_S)

    @property
    def config(self) -> Config:
        """The book's config, so a reload (`book.reload`) reaches the controller too."""
        return getattr(self.book, "config", None) or self._config

    # ---- the loop ---------------------------------------------------------------------------------
    def subscribe(self) -> Subscription:
        return self.bus.subscribe(["outcomes", "evaluations"], group=GROUP)

    async def run(self, stop: asyncio.Event, sub: Subscription | None = None,
                  may_decide: Callable[[], bool] | None = None) -> None:
        """Judge until `stop`; `sub` (from `subscribe`) when the caller joined the group already;
        while `may_decide()` is False, records are still taken in but nothing is judged."""
        sub = sub or self.subscribe()
        log.info("controller running: judge every %.2f s", self.interval_s)
        last = 0.0
        try:
            while not stop.is_set():
                interval = self.interval_s
                paused = may_decide is not None and not may_decide()
                wait = PAUSED_WAIT_S if paused else min(max(0.0, last + interval - self.clock()), 1.0)
                batch = await sub.get_batch(MAX_BATCH, wait)
                if stop.is_set():  # e.g. leadership lost while waiting: decide nothing more
                    break
                self.ingest_batch(batch)
                now = self.clock()
                if now - last >= interval and (may_decide is None or may_decide()):  # checked again: the wait took time
                    try:
                        self.tick(now)
                    except Exception:  # a bug in one tick must not stop the controller
                        log.exception("judge tick failed")
                    last = now
                if batch:
                    await sub.commit()
                    if len(batch) < MAX_BATCH:
                        await asyncio.sleep(GATHER_S)
        finally:
            self.book.off_change(self._on_change)
            try:
                await sub.close()
            except Exception:
                log.debug("closing the controller subscription failed", exc_info=True)
            await self.notifier.drain()

    # ---- evidence -------------------------------------------------------------------------------------
    def resume(self) -> float | None:
        """Open the windows of each route's current rollout as they were (listed on its state), so the
        records read back land where they did before. Returns when the earliest of those rollouts
        began (None: nothing to rebuild)."""
        began: list[float] = []
        for route, state in self.book.states.items():
            rc = self.config.routes.get(route)
            if rc is None or state.candidate is None or state.phase in TERMINAL:
                continue
            ev = self.evidence[route] = _reopened(route, rc, state, state.candidate)
            began.append(ev.windows[0].start)
            log.info("route %s: rollout began at %.3f; %d evidence windows", route, ev.windows[0].start,
                     len(ev.windows))
        return min(began, default=None)

    def _evidence_for(self, route: str) -> RouteEvidence | None:
        state = self.book.states.get(route)
        rc = self.config.routes.get(route)
        if state is None or rc is None or state.candidate is None:
            return None
        ev = self.evidence.get(route)
        same_rollout = ev is not None and (ev.stable, ev.candidate) == (state.stable, state.candidate) \
            and not _before_rollout(ev, state)  # the same pair again, but a new rollout of it: start fresh
        if not same_rollout or ev.rc.task_types != rc.task_types:
            ev = self.evidence[route] = RouteEvidence(route, rc, state.stable, state.candidate)
        elif ev.rc is not rc:
            ev.rc = rc  # config reloaded without a new rollout (e.g. other margins): keep the evidence
        ev.sync(state)
        return ev

    def _evidences(self, route: str) -> dict[str, RouteEvidence]:
        """Each candidate's evidence; with rollout.scope segment every candidate is judged, each against
        stable (the first's is `evidence[route]`)."""
        first = self._evidence_for(route)
        if first is None:
            return {}
        state = self.book.states[route]
        if state.scope != "segment":
            return {first.candidate: first}  # type: ignore[dict-item]
        out = {state.candidate: first}  # `_evidence_for` dropped a previous rollout's already
        others = self.more_evidence.setdefault(route, {})
        for candidate in candidates_of(state)[1:]:
            ev = others.get(candidate)
            if ev is None or ev.stable != state.stable or _before_rollout(ev, state):
                ev = others[candidate] = _reopened(route, first.rc, state, candidate)
            ev.rc = first.rc
            ev.sync(state)
            out[candidate] = ev
        return out  # type: ignore[return-value]

    def ingest_batch(self, records: list[Record]) -> None:
        """`ingest` each record, looking each route's evidence up once (no state changes in between)."""
        evidences: dict[str, dict[str, RouteEvidence]] = {}
        for record in records:
            self.ingest(record, evidences)

    def ingest(self, record: Record, evidences: dict[str, dict[str, RouteEvidence]] | None = None) -> bool:
        """Add one outcome or evaluation record to its route's evidence (feedback once resolved);
        `evidences` keeps the routes' evidence looked up so far in a batch."""
        if evidences is None:
            evidences = {}
        if isinstance(record, OutcomeEvent):
            if record.kind == "feedback":
                resolved = self.feedback.feedback(record)
                return resolved is not None and self._add_outcome(resolved, evidences)
            added = self._add_outcome(record, evidences)
            if self._resolves_feedback:
                for resolved in self.feedback.outcome(record):
                    self._add_outcome(resolved, evidences)
            return added
        if isinstance(record, EvaluationRecord):
            ev = self._evidences_in(record.route, evidences).get(record.candidate_model)
            return ev.add_evaluation(record) if ev is not None else False
        return False

    def _evidences_in(self, route: str, evidences: dict[str, dict[str, RouteEvidence]]) -> dict[str, RouteEvidence]:
        evs = evidences.get(route)
        if evs is None:
            evs = evidences[route] = self._evidences(route)
        return evs

    def _add_outcome(self, record: OutcomeEvent, evidences: dict[str, dict[str, RouteEvidence]]) -> bool:
        evs = self._evidences_in(record.route, evidences).values() if record.route is not None else ()
        return any([ev.add_outcome(record) for ev in evs])  # a list: every candidate's evidence takes it

    # ---- judging ------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> dict[str, LastDecision]:
        """Run the judge on every route under rollout; apply and record its decisions."""
        now = self.clock() if now is None else now
        self.last_tick = now
        self.feedback.expire()
        decisions: dict[str, LastDecision] = {}
        for route, rc in self.config.routes.items():
            state = self.book.states.get(route)
            if state is None or state.candidate is None or state.phase in TERMINAL:
                continue
            if state.scope == "segment":
                verdict = self._judge_segments(route, rc, state, now)
                if verdict is not None:
                    decisions[route] = verdict
                continue
            ev = self._evidence_for(route)
            if ev is None:
                continue
            j = judge(state, rc, ev, now)
            self.judgements[route] = j
            due = now - self._reported_at.get(route, -1e18) >= self.report_interval_s
            d = j.decision
            if d is None:  # paused: keep the report fresh, nothing to decide
                if due:
                    self._send_report(route, self.book.set_report(route, self._report(route, state, j, ev, now)))
                continue
            decisions[route] = d
            prev = state.recommendation
            acts = d.decision != "hold" and rc.rollout.mode == "auto"
            changed = prev is None or prev.decision != d.decision
            new_leader = self.book.epoch is not None and state.epoch != self.book.epoch
            if acts or changed or due or new_leader:
                self._send_report(route, self.book.decide(route, d, report=self._report(route, state, j, ev, now)))
                if acts:
                    log.info("route %s: %s — %s", route, d.decision, "; ".join(d.reasons))
                    new_state = self.book.states[route]
                    ev.sync(new_state)
        return decisions

    def _judge_segments(self, route: str, rc: RouteConfig, state: RolloutState, now: float) -> LastDecision | None:
        """rollout.scope segment: judge every candidate, decide each segment on its own, apply."""
        evs = self._evidences(route)
        if not evs:
            return None
        judgements = {c: judge(state, rc, ev, now) for c, ev in evs.items()}
        self.judgements[route] = judgements[state.candidate]  # type: ignore[index]
        verdicts = decide_segments(state, rc, {c: j.comparisons for c, j in judgements.items()}, evs, now)
        due = now - self._reported_at.get(route, -1e18) >= self.report_interval_s
        acts = rc.rollout.mode == "auto" and any(v.decision.decision != "hold" or v.rejected for v in verdicts.values())
        changed = any((seg := state.segments.get(name)) is None or seg.recommendation is None
                      or seg.recommendation.decision != v.decision.decision for name, v in verdicts.items())
        new_leader = self.book.epoch is not None and state.epoch != self.book.epoch
        if not verdicts or not (acts or changed or due or new_leader):
            if due:
                self._send_report(route, self.book.set_report(route, self._segment_report(route, state, judgements,
                                                                                          evs, now)))
            return state.recommendation
        new = self.book.decide_segments(route, verdicts)
        self._send_report(route, self.book.set_report(route, self._segment_report(route, new, judgements, evs, now)))
        for ev in evs.values():
            ev.sync(new)
        if acts and new.last_decision is not None:
            log.info("route %s: %s — %s", route, new.last_decision.decision, "; ".join(new.last_decision.reasons))
        return new.last_decision if acts else new.recommendation

    def _segment_report(self, route: str, state: RolloutState, judgements: dict[str, Judgement],
                        evs: dict[str, RouteEvidence], now: float) -> dict:
        """The report of the first candidate, as in scope route, with every candidate's own and the
        capability × cost matrix (candidates × segments). Its decision is the one the segments' verdicts
        add up to (the route's recommendation): a route-level decision over every segment's
        comparisons is none that is applied, so the candidates' reports carry none. A route whose
        segments have all ended reports its last decision."""
        report = self._report(route, state, judgements[state.candidate], evs[state.candidate], now)  # type: ignore[index]
        report["scope"] = "segment"
        applied = state.recommendation or state.last_decision
        report["judge"].update(decision=applied.decision if applied else None,
                               reasons=list(applied.reasons) if applied else [])
        report["candidates"] = {c: {"judge": {**j.report(), "decision": None, "reasons": []},
                                    "live": evs[c].live_summary()} for c, j in judgements.items()}
        report["matrix"] = capability_matrix(state, {c: j.comparisons for c, j in judgements.items()})
        return finite(report)

    def _send_report(self, route: str, state: RolloutState) -> None:
        """Publish the state's report on the reports topic, unless it is the one published last."""
        report = state.report or {}
        self._reported_at[route] = report.get("generated_at", self.clock())
        body = {k: v for k, v in report.items() if k != "generated_at"}
        if not report or self._sent_reports.get(route) == body:
            return
        self._sent_reports[route] = body
        self.bus.publish("reports", RolloutReport(route=route, ts=self._reported_at[route],
                                                  epoch=self.book.epoch or 0, report=report))

    def _report(self, route: str, state: RolloutState, j: Judgement, ev: RouteEvidence, now: float) -> dict:
        report: dict = {
            "route": route,
            "generated_at": now,
            "phase": state.phase,
            "step_index": state.step_index,
            "canary_weight": state.canary_weight,
            "stable": state.stable,
            "candidate": state.candidate,
            "judge": j.report(),
            "live": ev.live_summary(),
            "feedback": self.feedback.summary(route),
        }
        try:
            report["shadow"] = ev.shadow_stats.summary()
        except Exception:
            log.exception("shadow summary failed for %s", route)
        return finite(report)

    # ---- notifications ------------------------------------------------------------------------------
    def _on_change(self, new: RolloutState, old: RolloutState | None) -> None:
        """Every change this book commits or adopts; in Kafka mode not an operator's, which the proxy
        that took the action notifies (there may be no leader at that moment)."""
        by_operator = new.last_decision is not None and new.last_decision.by == "operator"
        if not (self._proxies_notify_operators and by_operator):
            self.notifier.changed(new, old)


def _before_rollout(ev: RouteEvidence, state: RolloutState) -> bool:
    """`ev` holds evidence from before the state's rollout began: a previous rollout's (the same
    stable and candidate may be rolled out again, e.g. removed from the config and named again).
    A window list cut to its last MAX_WINDOWS no longer tells when the rollout began: kept then."""
    if not ev.windows or len(state.windows) >= MAX_WINDOWS:
        return False
    return ev.windows[0].start < rollout_start(state) - 1e-6


def _reopened(route: str, rc: RouteConfig, state: RolloutState, candidate: str) -> RouteEvidence:
    """Evidence of one candidate with the windows of the route's current rollout open as they were
    (listed on its state), so that records read back land where they did before."""
    ev = RouteEvidence(route, rc, state.stable, candidate)
    for phase, step, since in state.windows:
        ev.sync(state.model_copy(update={"phase": phase, "step_index": step, "since": since}))
    ev.sync(state)
    return ev


def finite(obj):
    """The report as strict JSON: NaN and ±inf become null (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def main(config: Config) -> int:
    """`modelcanary control --config FILE`: the controller process for Kafka mode."""
    if config.events.backend != "kafka":
        print("error: events.backend is memory; the controller runs inside `modelcanary serve` "
              "(use `modelcanary control` with events.backend: kafka)", file=sys.stderr)
        return 1
    from service.rollout.leader import control

    try:
        return asyncio.run(control(config))
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
