"""The proxy's side of the shadow child (see the package docstring).

On the proxy's event loop only, with no thread: reading sampled traffic from the bus (as the
in-process workers did), sending its JSON to the child over their socket (collectors.embedded.channel),
and publishing the records the child sends back. At most `events.queue_size` sent events wait for
the child to take them; more are dropped and counted (queue_full).
Every event sent is kept (its request id and route) until the child says it is finished; when the
child ends (it died, was killed, or gave up what it had no time for) what it never finished is
counted (reason stopped) and logged, and so is what is offered to it after its socket closed.
A child that dies is replaced after a pause (RESTART_S, growing while children keep dying early).
A reload that changes the config starts a child on the new config and stops the old one, which
first evaluates what it was sent (under the config it was sampled with) for up to RELOAD_DRAIN_S.
The subscription stays, so traffic sampled while the new child starts waits for it instead of
being lost. A reload that changes nothing keeps the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import pickle
import socket
import time

from collectors.embedded import child as child_main
from collectors.embedded.channel import Channel
from collectors.embedded.relay import ChildMetrics, install
from collectors.worker import DRAIN_TIMEOUT_S
from service import metrics
from service.bus import EventBus
from service.bus.base import SHADOW_GROUP
from service.config import Config
from service.records import TrafficEvent, load

log = logging.getLogger("modelcanary.shadow")

BATCH = 256
POLL_S = 0.5
STOP_TIMEOUT_S = 4.0            # the child finishes what is in flight within this, else it is killed
RELOAD_DRAIN_S = 10.0           # a child replaced by a reload evaluates what it was sent within this
RESTART_S = (1.0, 2.0, 5.0, 10.0, 30.0)
HEALTHY_S = 60.0                # a child that lived this long resets the restart pause
STOPPED = "stopped"             # shadow_dropped_total's reason for what a child never finished


class ShadowChild:
    """One child process and the channel to it."""

    def __init__(self, config: Config, bus: EventBus, relay: ChildMetrics):
        self.capacity = config.events.queue_size
        self.waiting = 0  # sent, not yet taken by the child's workers
        self.unfinished: dict[str, list[str]] = {}  # request id -> routes: sent, not yet finished
        self.bus = bus
        self.relay = relay
        self.key = id(self)
        self.started = time.monotonic()
        self._ended = asyncio.Event()
        mine, theirs = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=child_main.main, name="modelcanary-shadow", daemon=True,
                                   args=(config, theirs))
        self.process.start()
        theirs.close()
        self.channel = Channel(mine, self._frame, self._closed)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def offer(self, event: TrafficEvent) -> None:
        """Send a sampled request to the child, or drop it (counted) when `capacity` already wait or
        the child's socket is closed."""
        if self.channel.closed:
            metrics.shadow_dropped_total.labels(event.route, STOPPED).inc()
            return
        if self.waiting >= self.capacity:
            metrics.shadow_dropped_total.labels(event.route, "queue_full").inc()
            return
        self.waiting += 1
        self.unfinished.setdefault(event.request_id, []).append(event.route)  # before a send that may close
        self.channel.send(child_main.TRAFFIC, child_main.encode(event))

    def _frame(self, kind: bytes, payload: bytes) -> None:
        if kind == child_main.TAKEN:
            self.waiting = max(0, self.waiting - int(payload))
        elif kind == child_main.RESULTS:
            records, done, snapshot = pickle.loads(payload)  # noqa: S301 - from our own child
            for record in records:
                self._publish(record)
            self.relay.update(self.key, snapshot)
            for request_id in done:
                self._finished(request_id)

    def _publish(self, record: bytes) -> None:
        try:
            self.bus.publish("evaluations", load(json.loads(record)))
        except ValueError:
            log.exception("a record from the shadow child could not be published")

    def _finished(self, request_id: str) -> None:
        routes = self.unfinished.get(request_id)
        if routes:
            routes.pop()
            if not routes:
                del self.unfinished[request_id]

    def _closed(self) -> None:
        """The child is gone: what it was sent and never finished is counted (its last RESULTS was read)."""
        lost = [route for routes in self.unfinished.values() for route in routes]
        self.unfinished.clear()
        for route in lost:
            metrics.shadow_dropped_total.labels(route, STOPPED).inc()
        if lost:
            log.warning("the shadow child ended with %d sampled requests it had not evaluated (counted as "
                        "modelcanary_shadow_dropped_total{reason=\"%s\"})", len(lost), STOPPED)
        self.relay.child_ended(self.key)
        self._ended.set()

    async def stop(self, drain_s: float = 0.0) -> None:
        """Ask the child to finish (STOP): what it was sent within `drain_s`, then what is in flight;
        wait for it, and kill it if it takes too long."""
        self.channel.send(child_main.STOP, str(drain_s).encode())
        timeout_s = drain_s + DRAIN_TIMEOUT_S + STOP_TIMEOUT_S if drain_s else STOP_TIMEOUT_S
        try:
            await asyncio.to_thread(self.process.join, timeout_s)
        finally:
            if self.process.is_alive():
                log.warning("the shadow child did not stop in %.0f s and is killed", timeout_s)
                self.process.kill()
                await asyncio.to_thread(self.process.join, 1.0)
            with contextlib.suppress(TimeoutError):  # what the child sent last is read first
                await asyncio.wait_for(self._ended.wait(), 1.0)
            if not self._ended.is_set():
                self.channel.close()
                self._closed()


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _has_candidate(config: Config) -> bool:
    return any(rc.candidate for rc in config.routes.values())


def _reloaded(config: Config, reloads: asyncio.Queue[Config]) -> Config | None:
    """The last config put on `reloads`; None if there is none, or it is `config` again (the child
    gets everything it uses from its Config)."""
    latest = config
    while not reloads.empty():
        latest = reloads.get_nowait()
    return None if latest == config else latest


async def run_in_child(config: Config, bus: EventBus, stop: asyncio.Event, reloads: asyncio.Queue[Config]) -> None:
    """Memory mode's ShadowRunner: shadow workers in a child process until `stop` is set; each config
    put on `reloads` that differs replaces the child (the child makes its own providers and tracing from it)."""
    relay = install()
    loop = asyncio.get_running_loop()
    sub = bus.subscribe(["traffic"], group=SHADOW_GROUP)
    child: ShadowChild | None = None
    stopping: set[asyncio.Task] = set()
    deaths = 0
    if not _has_candidate(config):
        log.info("no route has a candidate; no shadow child")
    try:
        while not stop.is_set():
            if child is not None and not child.alive:
                lived = time.monotonic() - child.started
                deaths = 0 if lived > HEALTHY_S else deaths + 1
                log.warning("the shadow child exited (code %s) after %.0f s; a new one starts in %.0f s",
                            child.process.exitcode, lived, RESTART_S[min(deaths, len(RESTART_S) - 1)])
                await child.stop()
                child = None
                await _pause(stop, RESTART_S[min(deaths, len(RESTART_S) - 1)])
                continue
            events = await sub.get_batch(BATCH, POLL_S)
            reloaded = _reloaded(config, reloads)  # before offering: what was read may have been sampled after it
            if reloaded is not None:
                config = reloaded
                if child is not None:  # its queue holds traffic sampled under the old config
                    task = loop.create_task(child.stop(RELOAD_DRAIN_S))
                    stopping.add(task)
                    task.add_done_callback(stopping.discard)
                    child, deaths = None, 0
            if child is None and _has_candidate(config):
                child = ShadowChild(config, bus, relay)
                log.info("shadow workers run in a child process (pid %d)", child.process.pid)
            for event in events:
                if isinstance(event, TrafficEvent) and child is not None:
                    child.offer(event)
    finally:
        await sub.close()
        if child is not None:
            await child.stop()
        await asyncio.gather(*stopping, return_exceptions=True)
