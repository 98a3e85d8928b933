"""The controller: consumes outcomes and evaluations, runs the judge, applies its decisions.

In memory mode `modelcanary serve` runs `Controller(config, bus, book).run(stop)`
as a task next to the proxy; in Kafka mode `modelcanary control` runs `main()`,
which first follows the rollouts topic (so a restarted controller resumes the
phase and step), then judges and publishes every change back to that topic.

A restarted controller also resumes its evidence: the rollouts topic gives each
route's current rollout and the states that opened its windows (`RolloutHistory`),
and the outcomes and evaluations the controller's group had already consumed since
that rollout began are read back (`KafkaBus.replay`) before it judges again. The
group then goes on from its committed offsets; a record seen twice counts once
(RouteEvidence deduplicates by request_id).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import time
from collections.abc import Callable

import aiohttp

from service.bus.base import EventBus
from service.config import Config
from service.judge.decide import Judgement, judge
from service.judge.evidence import RouteEvidence
from service.records import EvaluationRecord, LastDecision, OutcomeEvent, Record, RolloutState
from service.rollout.book import TERMINAL, RolloutBook
from service.rollout.follower import RolloutHistory, follow_rollouts
from service.rollout.notify import safe_url, webhook_payload

log = logging.getLogger("modelcanary.controller")

GROUP = "modelcanary-controller"
MAX_BATCH = 2000
MIN_INTERVAL_S = 0.05       # the judge never runs more often than this
MAX_INTERVAL_S = 5.0        # ... and never less often than this
MIN_GAP_ON_BATCH_S = 1.0    # a busy bus re-runs the judge at most this often (it shares the proxy's loop)
WEBHOOK_TIMEOUT_S = 5.0
REPLAY_SKEW_S = 60.0        # read back from this long before a rollout began (clocks of other hosts)


class Controller:
    """Per route: evidence, the judge's latest verdict, and the capability-matrix report."""

    def __init__(self, config: Config, bus: EventBus, book: RolloutBook, notify_url: str | None = None, *,
                 report_interval_s: float = 5.0, clock: Callable[[], float] = time.time):
        self._config = config
        self.bus = bus
        self.book = book
        self.notify_url = notify_url if notify_url is not None else config.notify.webhook_url
        self.report_interval_s = report_interval_s
        self.clock = clock
        self.evidence: dict[str, RouteEvidence] = {}
        self.judgements: dict[str, Judgement] = {}
        self._reported_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        self.last_tick: float | None = None
        book.on_change(self._on_change)

    # ---- timing ---------------------------------------------------------------------------------
    @property
    def interval_s(self) -> float:
        """At least every min_step_seconds / 10 (and control.interval_s when set)."""
        options = [rc.rollout.min_step_seconds / 10 for rc in self.config.routes.values() if rc.candidate]
        if self.config.control.interval_s:
            options.append(self.config.control.interval_s)
        return min(max(min(options, default=MAX_INTERVAL_S), MIN_INTERVAL_S), MAX_INTERVAL_S)

    @property
    def config(self) -> Config:
        """The book's config, so a reload (`book.reload`) reaches the controller too."""
        return getattr(self.book, "config", None) or self._config

    # ---- the loop ---------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        sub = self.bus.subscribe(["outcomes", "evaluations"], group=GROUP)
        log.info("controller running: judge every %.2f s and on every batch", self.interval_s)
        last = 0.0
        try:
            while not stop.is_set():
                interval = self.interval_s
                wait = min(max(0.0, last + interval - self.clock()), 1.0)
                batch = await sub.get_batch(MAX_BATCH, wait)
                for record in batch:
                    self.ingest(record)
                now = self.clock()
                gap = min(MIN_GAP_ON_BATCH_S, interval)
                if (batch and now - last >= gap) or now - last >= interval:
                    try:
                        self.tick(now)
                    except Exception:  # a bug in one tick must not stop the controller
                        log.exception("judge tick failed")
                    last = now
                if batch:
                    await sub.commit()
        finally:
            try:
                await sub.close()
            except Exception:
                log.debug("closing the controller subscription failed", exc_info=True)
            await self._drain_webhooks()

    # ---- evidence -------------------------------------------------------------------------------------
    def resume(self, history: RolloutHistory) -> float | None:
        """Open the windows of each route's current rollout as they were (from the rollouts topic), so
        the records read back land where they did before a restart. Returns when the earliest of those
        rollouts began (None: nothing to rebuild)."""
        began: list[float] = []
        for route, state in self.book.states.items():
            rc = self.config.routes.get(route)
            if rc is None or state.candidate is None or state.phase in TERMINAL:
                continue
            states = [s for s in history.windows(route) if (s.stable, s.candidate) == (state.stable, state.candidate)]
            if not states:
                continue
            ev = self.evidence[route] = RouteEvidence(route, rc, state.stable, state.candidate)
            for s in states:
                ev.sync(s)
            ev.sync(state)
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
        same_rollout = ev is not None and (ev.stable, ev.candidate) == (state.stable, state.candidate)
        if not same_rollout or ev.rc.task_types != rc.task_types:
            ev = self.evidence[route] = RouteEvidence(route, rc, state.stable, state.candidate)
        elif ev.rc is not rc:
            ev.rc = rc  # config reloaded without a new rollout (e.g. other margins): keep the evidence
        ev.sync(state)
        return ev

    def ingest(self, record: Record) -> bool:
        """Add one outcome or evaluation record to its route's evidence."""
        if isinstance(record, OutcomeEvent):
            ev = self._evidence_for(record.route)
            return ev.add_outcome(record) if ev is not None else False
        if isinstance(record, EvaluationRecord):
            ev = self._evidence_for(record.route)
            return ev.add_evaluation(record) if ev is not None else False
        return False

    # ---- judging ------------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> dict[str, LastDecision]:
        """Run the judge on every route under rollout; apply and record its decisions."""
        now = self.clock() if now is None else now
        self.last_tick = now
        decisions: dict[str, LastDecision] = {}
        for route, rc in self.config.routes.items():
            state = self.book.states.get(route)
            if state is None or state.candidate is None or state.phase in TERMINAL:
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
                    self.book.set_report(route, self._report(route, state, j, ev, now))
                    self._reported_at[route] = now
                continue
            decisions[route] = d
            prev = state.recommendation
            acts = d.decision != "hold" and rc.rollout.mode == "auto"
            changed = prev is None or prev.decision != d.decision
            if acts or changed or due:
                self.book.decide(route, d, report=self._report(route, state, j, ev, now))
                self._reported_at[route] = now
                if acts:
                    log.info("route %s: %s — %s", route, d.decision, "; ".join(d.reasons))
                    new_state = self.book.states[route]
                    ev.sync(new_state)
        return decisions

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
        }
        if ev.shadow_stats is not None:
            try:
                report["shadow"] = ev.shadow_stats.summary()
            except Exception:
                log.exception("shadow summary failed for %s", route)
        return finite(report)

    # ---- notifications ------------------------------------------------------------------------------
    def _on_change(self, new: RolloutState, old: RolloutState | None) -> None:
        if not self.notify_url or old is None:
            return
        if new.phase == old.phase and new.step_index == old.step_index:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("webhook for %s skipped: no event loop", new.route)
            return
        task = loop.create_task(self._post(webhook_payload(new, old)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, payload: dict) -> None:
        url = self.notify_url
        if not url:
            return
        try:
            if self._session is None or self._session.closed:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S))
            async with self._session.post(url, json=payload) as resp:
                if resp.status >= 300:
                    log.warning("webhook %s answered %s", safe_url(url), resp.status)
        except Exception as e:  # never raised: a notification must not affect a decision
            log.warning("webhook %s failed: %s", safe_url(url), type(e).__name__)

    async def _drain_webhooks(self, timeout_s: float = 2.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        if self._session is not None and not self._session.closed:
            await self._session.close()


def finite(obj):
    """The report as strict JSON: NaN and ±inf become null (JSON has neither)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


# ---- `modelcanary control` (Kafka mode) --------------------------------------------------------------

async def _serve_health(config: Config, controller_ref: dict):
    from aiohttp import web

    from service import metrics

    async def metrics_handler(_request):
        body, ctype = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def healthz(_request):
        c = controller_ref.get("controller")
        return web.json_response({"status": "ok", "caught_up": c is not None,
                                  "last_tick": c.last_tick if c else None})

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.control.metrics_port)
    await site.start()
    return runner


async def _resume_evidence(controller: Controller, bus: EventBus, history: RolloutHistory,
                           stop: asyncio.Event) -> int:
    """Rebuild the judge's evidence of the current rollouts from what this controller's group consumed."""
    began = controller.resume(history)
    if began is None:
        return 0
    t0 = time.monotonic()
    n = await bus.replay(["outcomes", "evaluations"], GROUP, began - REPLAY_SKEW_S, controller.ingest, stop)
    for route, ev in controller.evidence.items():
        log.info("route %s: evidence rebuilt from %d records read back in %.1f s (%d in the current window, "
                 "%d duplicates)", route, n, time.monotonic() - t0, ev.step_samples(
                     controller.book.states[route].phase), ev.duplicates)
    return n


async def _control(config: Config) -> int:
    from service.bus import make_bus

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    ref: dict = {}
    runner = await _serve_health(config, ref)
    bus = make_bus(config.events)
    await bus.start()
    book = RolloutBook(config, persist_path=None, publish=lambda s: bus.publish("rollouts", s))
    follow = bus.subscribe(["rollouts"], group=None)
    follower: asyncio.Task | None = None
    try:
        history = RolloutHistory()
        n = await follow_rollouts(follow, book, stop, catch_up=True, history=history)
        for route, state in book.states.items():
            log.info("resuming route %s: phase %s, step %d (%d states adopted)", route, state.phase,
                     state.step_index, n)
        controller = Controller(config, bus, book)
        await _resume_evidence(controller, bus, history, stop)
        ref["controller"] = controller
        follower = asyncio.create_task(follow_rollouts(follow, book, stop))
        await controller.run(stop)
    finally:
        stop.set()
        if follower is not None:
            await asyncio.gather(follower, return_exceptions=True)
        try:
            await follow.close()
        except Exception:
            pass
        await bus.close()
        await runner.cleanup()
    return 0


def main(config: Config) -> int:
    """`modelcanary control --config FILE`: the controller process for Kafka mode."""
    if config.events.backend != "kafka":
        print("error: events.backend is memory; the controller runs inside `modelcanary serve` "
              "(use `modelcanary control` with events.backend: kafka)", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_control(config))
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
