"""`modelcanary control` (Kafka mode): run two or more; exactly one leads, the others stand by.

Every controller follows the rollouts and reports topics, so each knows every route's phase and
step. The one that holds the partition of `{prefix}.control` (service/bus/kafka/leadership.py)
claims the next leadership epoch, rebuilds its judge's evidence from the topics (as a restarted
controller does), and judges; every state it commits carries its epoch. The others answer /readyz
with `standby` and export `modelcanary_controller_leader` 0.

A leader that loses the partition, or its lease (cut off from the broker), stops judging at once
and stands by again. So does one that sees a higher epoch than its own, on a LeaderRecord or on a
rollout state it follows: another won the lead without this one being told (a broker that came back
empty); it joins the leadership group again as a new member and claims only once the group gives it
the partition afresh, with an epoch above the one that deposed it. Anything it still publishes
carries its old epoch, which every follower ignores once the new leader's first state is out
(`precedence`): two controllers never both decide one route and version. After a kill -9 of the
leader, a standby leads within ~10 s (the group's session timeout, then a join), after a SIGTERM
within ~7 s (see docs/kubernetes.md), plus the time to read the evidence back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

from aiohttp import web

from service import metrics
from service.bus.kafka import KafkaBus, KafkaLeadership, KafkaSubscription
from service.cli import cannot_listen
from service.config import Config
from service.records import RolloutState
from service.rollout.book import RolloutBook
from service.rollout.controller import GROUP, MAX_BATCH, Controller
from service.rollout.follower import Follower

log = logging.getLogger("modelcanary.controller")

REPLAY_SKEW_S = 60.0   # read back from this long before a rollout began (clocks of other hosts)
WATCH_S = 0.2          # how often the leader checks it still holds its lease
RETRY_S = 1.0          # after a failed claim
# The leader's intake: with no partition of its group's for this long, it reads every partition itself.
# A join takes ~3 s and waits at most the rebalance timeout (10 s) for a member that died mid-join; 20 s
# is past both, and short against a rollout step (judging on nothing for longer hides a bad candidate).
SOLE_MEMBER_AFTER_S = 20.0


def instance_name() -> str:
    """This process in the leader records and the leader metric: the pod's host name and the pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Status:
    """What the health server reports: `starting` until the rollouts topic is read and the leadership
    group joined (a rolling update waits for that before it stops the next pod), then `leading` or
    `standby`."""

    def __init__(self) -> None:
        self.leadership: KafkaLeadership | None = None
        self.stopping = False
        self.epoch: int | None = None
        self.controller: Controller | None = None
        self.intake: KafkaSubscription | None = None  # the leader's outcomes and evaluations

    @property
    def role(self) -> str:
        if self.stopping:
            return "stopping"
        if self.controller is not None:
            return "leading"
        return "standby" if self.leadership is not None and self.leadership.joined else "starting"

    def body(self) -> dict:
        c = self.controller
        return {"status": self.role, "leader": c is not None, "epoch": self.epoch,
                "caught_up": self.leadership is not None, "last_tick": c.last_tick if c else None,
                "intake": intake(self.intake) if c else None}


def intake(sub: KafkaSubscription | None) -> dict | None:
    """How the leader takes in records: `group` (assigned by its consumer group) or `manual` (every
    partition itself, the group having given it none for SOLE_MEMBER_AFTER_S), the partitions held,
    and for how long it has held none."""
    if sub is None:
        return None
    since = sub.unassigned_since
    return {"mode": "manual" if sub.manual else "group", "partitions": sub.partitions,
            "unassigned_s": None if since is None else round(time.monotonic() - since, 1)}


async def serve_health(config: Config, status: Status) -> web.AppRunner:
    async def metrics_handler(_request: web.Request) -> web.Response:
        body, ctype = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({**status.body(), "status": "ok", "role": status.role})

    async def readyz(_request: web.Request) -> web.Response:
        # 200 on a standby too: a Deployment's rollout waits for Ready pods, and a standby is as it should
        # be; 503 while starting (not yet able to take over) or stopping
        body = status.body()
        return web.json_response(body, status=503 if body["status"] in ("starting", "stopping") else 200)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.server.host, config.control.metrics_port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


async def resume_evidence(controller: Controller, bus: KafkaBus, stop: asyncio.Event) -> int:
    """Rebuild the judge's evidence of the current rollouts from what the controller group consumed."""
    began = controller.resume()
    if began is None:
        return 0
    t0 = time.monotonic()
    n = await bus.replay(["outcomes", "evaluations"], GROUP, began - REPLAY_SKEW_S, controller.ingest, stop)
    for route, ev in controller.evidence.items():
        log.info("route %s: evidence rebuilt from %d records read back in %.1f s (%d in the current window, "
                 "%d duplicates)", route, n, time.monotonic() - t0, ev.step_samples(
                     controller.book.states[route].phase), ev.duplicates)
    return n


def open_intake(bus: KafkaBus) -> KafkaSubscription:
    """The leader's outcomes and evaluations, up to MAX_BATCH waiting: a backlog (a `collect` worker
    catching up) reaches the controller in full batches, each committed once it is in the evidence."""
    return KafkaSubscription(bus, ["outcomes", "evaluations"], GROUP, sole_member_after_s=SOLE_MEMBER_AFTER_S,
                             batch=MAX_BATCH)


def leader_group(config: Config) -> str:
    """One leadership group per topic prefix: deployments that share a broker do not share a leader."""
    return f"{GROUP}-leader.{config.events.kafka.topic_prefix}"


class Term:
    """One leadership term: over when `stop` is set, the partition is revoked or lost, or a higher
    epoch shows (`depose`)."""

    def __init__(self, book: RolloutBook, epoch: int):
        self.book = book
        self.epoch = epoch
        self.over = asyncio.Event()
        self.deposed_by: int | None = None

    def depose(self, newer: int) -> None:
        """Stop at once: the book stamps no state with this epoch from now on, and the controller's
        loop ends before it judges again (it checks `over` after every wait)."""
        if self.deposed_by is None:
            log.warning("epoch %d seen while leading epoch %d: deposed, standing by", newer, self.epoch)
        self.deposed_by = max(newer, self.deposed_by or 0)
        self.book.epoch = None
        self.over.set()

    def on_change(self, new: RolloutState, _old: RolloutState | None) -> None:
        if new.epoch > self.epoch:
            self.depose(new.epoch)


async def lead(config: Config, bus: KafkaBus, book: RolloutBook, leadership: KafkaLeadership, epoch: int,
               status: Status, stop: asyncio.Event) -> int | None:
    """Judge as the leader of `epoch` until `stop`, the partition is revoked or lost, or a higher epoch
    shows (returned); while the lease lapses (a rebalance, a slow broker) judging pauses."""
    term = Term(book, epoch)

    async def watch() -> None:
        paused = False
        while not stop.is_set() and leadership.owned() and not term.over.is_set():
            if paused != (not leadership.held()):
                paused = not paused
                log.info("leadership lease %s", "lapsed: judging paused" if paused else "renewed: judging again")
            newer = await leadership.newer_epoch(epoch)
            if newer is not None:
                term.depose(newer)
            await asyncio.sleep(WATCH_S)
        term.over.set()

    book.epoch = status.epoch = epoch
    book.on_change(term.on_change)
    for state in book.states.values():  # adopted between the claim and now
        term.on_change(state, None)
    watcher = asyncio.create_task(watch(), name="leader-lease")
    controller = status.controller = Controller(config, bus, book)
    # joining the group goes on while the evidence is read back
    sub = status.intake = open_intake(bus)
    log.info("leading (epoch %d): rebuilding the evidence", epoch)
    try:
        await resume_evidence(controller, bus, term.over)
        await controller.run(term.over, sub, may_decide=lambda: leadership.held() and not term.over.is_set())
    finally:
        book.off_change(term.on_change)
        book.epoch = None
        status.controller = status.intake = None
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if not stop.is_set() and term.deposed_by is None:
        log.warning("leadership (epoch %d) lost; standing by", epoch)
    return term.deposed_by


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP: `modelcanary control` reads its config at start "
                            "only; restart it (and `collect`) with the changed file, as the chart does")


async def control(config: Config) -> int:
    stop = asyncio.Event()
    stop_on_signals(stop)
    status = Status()
    try:
        runner = await serve_health(config, status)
    except OSError as e:  # before anything else starts: one line, and the exit code of `serve`'s
        return cannot_listen(f"server.host {config.server.host}, control.metrics_port {config.control.metrics_port}", e)
    events = config.events
    bus = KafkaBus(events.kafka, events.spool, events.queue_size)
    await bus.start()
    book = RolloutBook(config, persist_path=None, publish=lambda s: bus.publish("rollouts", s))
    follower = Follower(bus, book)
    instance = instance_name()
    gauge = metrics.controller_leader.labels(instance)
    gauge.set(0)
    leadership: KafkaLeadership | None = None
    following: asyncio.Task | None = None
    try:
        if not await follower.catch_up(stop):
            log.warning("the rollouts topic was not read to its end in time; going on with what was read")
        for route, state in book.states.items():
            log.info("resuming route %s: phase %s, step %d (%d states adopted)", route, state.phase,
                     state.step_index, follower.adopted)
        following = asyncio.create_task(follower.run(stop), name="rollouts")
        leadership = status.leadership = bus.leadership(leader_group(config))
        log.info("%s standing by for the lead", instance)
        deposed_by = 0
        while await leadership.wait_held(stop):
            floor = max([deposed_by, *(s.epoch for s in book.states.values())])
            epoch = await leadership.claim(instance, floor)
            if epoch is None:
                await asyncio.sleep(RETRY_S)
                continue
            gauge.set(1)
            try:
                newer = await lead(config, bus, book, leadership, epoch, status, stop)
            finally:
                gauge.set(0)
            if newer is not None and not stop.is_set():
                deposed_by = max(deposed_by, newer)
                await leadership.rejoin()
    finally:
        stop.set()
        status.stopping = True
        await bus.flush(5.0)  # the last decisions, before the lead is given up
        if leadership is not None:
            await leadership.close()
        if following is not None:
            await asyncio.gather(following, return_exceptions=True)
        await bus.close()
        await runner.cleanup()
    return 0
