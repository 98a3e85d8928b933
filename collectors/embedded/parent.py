"""The proxy's side of the shadow child (see the package docstring).

On the proxy's event loop only: reading sampled traffic from the bus (as the in-process workers
did) and a non-blocking put of its JSON on the child's bounded queue. A thread reads what the
child sends back and hands each record to the loop (`call_soon_threadsafe`) for the bus.
A child that dies is replaced after a pause (RESTART_S, growing while children keep dying early).
A reload starts a child on the new config and stops the old one; the subscription stays, so
traffic sampled while the new child starts waits on its queue instead of being lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import queue
import threading
import time

from collectors.embedded import child as child_main
from collectors.embedded.relay import ChildMetrics, install
from collectors.worker import GROUP
from service import metrics
from service.bus import EventBus
from service.config import Config
from service.records import TrafficEvent, load

log = logging.getLogger("modelcanary.shadow")

BATCH = 256
POLL_S = 0.5
STOP_TIMEOUT_S = 4.0            # the child finishes what is in flight within this, else it is killed
RESTART_S = (1.0, 2.0, 5.0, 10.0, 30.0)
HEALTHY_S = 60.0                # a child that lived this long resets the restart pause


class ShadowChild:
    """One child process, its two queues and the thread that reads its results."""

    def __init__(self, config: Config, bus: EventBus, relay: ChildMetrics, loop: asyncio.AbstractEventLoop):
        ctx = multiprocessing.get_context("spawn")
        self.traffic = ctx.Queue(config.events.queue_size)
        self.traffic.cancel_join_thread()  # never wait at exit for a child that does not read
        self.results = ctx.Queue()
        self.relay = relay
        self.key = id(self)
        self.started = time.monotonic()
        self.process = ctx.Process(target=child_main.main, name="modelcanary-shadow", daemon=True,
                                   args=(config, self.traffic, self.results, os.getpid()))
        self.process.start()
        self._reader = threading.Thread(target=self._read, args=(bus, loop), name="shadow-results", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def offer(self, event: TrafficEvent) -> None:
        """Hand a sampled request to the child, or drop it (counted) when its queue is full."""
        try:
            self.traffic.put_nowait(child_main.encode(event))
        except queue.Full:
            metrics.shadow_dropped_total.labels(event.route, "queue_full").inc()

    def _read(self, bus: EventBus, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                kind, payload = self.results.get(timeout=POLL_S)
            except queue.Empty:
                if self.process.is_alive():
                    continue
                break
            except (EOFError, OSError, ValueError):
                break
            if kind == "metrics":
                self.relay.update(self.key, payload)
                continue
            try:
                record = load(json.loads(payload))
                loop.call_soon_threadsafe(bus.publish, "evaluations", record)
            except (ValueError, RuntimeError):  # a bad record, or the loop is closed (shutting down)
                log.exception("a record from the shadow child could not be published")
        self.relay.child_ended(self.key)

    async def stop(self) -> None:
        """Ask the child to finish (STOP on its queue), then wait for it; kill it if it takes too long."""
        with contextlib.suppress(queue.Full, ValueError, OSError):
            self.traffic.put_nowait(child_main.STOP)
        try:
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        finally:
            if self.process.is_alive():
                self.process.kill()
                self.process.join(1.0)
            self._reader.join(2 * POLL_S + 1.0)
            self.traffic.close()


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def _has_candidate(config: Config) -> bool:
    return any(rc.candidate for rc in config.routes.values())


async def run_in_child(config: Config, bus: EventBus, stop: asyncio.Event, reloads: asyncio.Queue[Config]) -> None:
    """Memory mode's ShadowRunner: shadow workers in a child process until `stop` is set; each config
    put on `reloads` replaces the child (the child makes its own providers and tracing from it)."""
    relay = install()
    loop = asyncio.get_running_loop()
    sub = bus.subscribe(["traffic"], group=GROUP)
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
            while not reloads.empty():  # before offering: what was read may have been sampled after it
                config = reloads.get_nowait()
                if child is not None:  # its queue holds traffic sampled under the old config
                    task = loop.create_task(child.stop())
                    stopping.add(task)
                    task.add_done_callback(stopping.discard)
                    child, deaths = None, 0
            if child is None and _has_candidate(config):
                child = ShadowChild(config, bus, relay, loop)
                log.info("shadow workers run in a child process (pid %d)", child.process.pid)
            for event in events:
                if isinstance(event, TrafficEvent) and child is not None:
                    child.offer(event)
    finally:
        await sub.close()
        if child is not None:
            await child.stop()
        await asyncio.gather(*stopping, return_exceptions=True)
