"""The shadow child process: a `collectors.worker.ShadowWorker` over a bus made of one socket to the
parent (collectors.embedded.channel), read and written on the child's event loop.

- from the parent: TRAFFIC frames (a TrafficEvent's JSON) and STOP (its payload: seconds left to
  evaluate the traffic already sent; then the rest is given up, what is in flight finishes, and the
  child exits);
- to the parent: RECORD (an EvaluationRecord's JSON, for the parent's bus), TAKEN (how many
  traffic frames the workers took: the parent keeps at most `events.queue_size` untaken), and
  METRICS (relay.snapshot(), pickled) every SNAPSHOT_S and once more at exit.

Sampled requests the child gives up (its drain time ran out, or its parent is gone) and those still
in flight when the worker stops waiting for them are counted as
`modelcanary_shadow_dropped_total{reason="stopped"}` and logged once with their number.

The child stops by itself when its parent is gone (the socket closes). SIGINT is ignored (a Ctrl-C
in a terminal reaches the whole process group; the parent asks the child to stop, with STOP).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import signal
import socket
from collections import deque
from collections.abc import Callable

import uvloop

from collectors.embedded import relay
from collectors.embedded.channel import Channel
from collectors.worker import ShadowWorker
from service import metrics
from service.bus.base import Topic
from service.config import Config
from service.records import EvaluationRecord, Record, TrafficEvent, load
from service.upstream import make_providers
from service.upstream.base import Provider

log = logging.getLogger("modelcanary.shadow")

SNAPSHOT_S = 1.0
EXIT_DRAIN_S = 2.0
NICE = 10
TRAFFIC, STOP, RECORD, TAKEN, METRICS = b"t", b"s", b"r", b"c", b"m"
STOPPED = "stopped"  # shadow_dropped_total's reason for what a stopping child could not evaluate


class ChannelBus:
    """The EventBus of the child: traffic in, evaluations out; nothing else travels."""

    def __init__(self, sock: socket.socket, stop: asyncio.Event):
        self._stop = stop
        self._traffic: deque[bytes] = deque()
        self._arrived = asyncio.Event()
        self._draining = False  # STOP came: hand out what is queued, then stop the worker
        self.dropped = 0
        self.channel = Channel(sock, self._frame, self._parent_gone)

    def _frame(self, kind: bytes, payload: bytes) -> None:
        if kind == TRAFFIC:
            self._traffic.append(payload)
            self._arrived.set()
        elif kind == STOP:
            self._draining = True
            self._arrived.set()
            asyncio.get_running_loop().call_later(float(payload or 0), self._give_up)

    def _parent_gone(self) -> None:
        if not self._stop.is_set():
            log.warning("the proxy process is gone; the shadow child stops")
        self._give_up()

    def _give_up(self) -> None:
        """Stop the worker now; what it was not handed yet is dropped (counted)."""
        while self._traffic:
            self.drop(json.loads(self._traffic.popleft()).get("route", "unknown"))
        self._stop.set()
        self._arrived.set()

    def drop(self, route: str) -> None:
        metrics.shadow_dropped_total.labels(route, STOPPED).inc()
        self.dropped += 1

    async def start(self) -> None:
        return None

    def publish(self, topic: Topic, record: Record) -> None:
        if topic == "evaluations":
            self.channel.send(RECORD, record.model_dump_json(by_alias=True).encode())

    def subscribe(self, topics: list[Topic], group: str | None) -> ChannelBus:
        if topics != ["traffic"]:
            raise ValueError(f"the shadow child only reads traffic, not {topics}")
        return self

    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        """One record at a time: ShadowWorker starts what it took before it next looks at `stop`, so
        stopping it never strands a taken record in its backlog."""
        if not self._traffic and not self._draining and not self._stop.is_set():
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout_s)
            except TimeoutError:
                pass
        if self._stop.is_set():
            return []
        if not self._traffic:
            if self._draining:  # everything sent before STOP was handed out
                self._stop.set()
            return []
        self.channel.send(TAKEN, b"1")
        return [load(json.loads(self._traffic.popleft()))]

    async def commit(self) -> None:
        return None

    async def flush(self, timeout_s: float) -> bool:
        return True

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None) -> int:
        return 0

    async def close(self) -> None:
        return None


class ChildWorker(ShadowWorker):
    """A ShadowWorker that counts the evaluations it cancels when it stops (its drain timeout ran out)."""

    def __init__(self, config: Config, bus: ChannelBus, providers: dict[str, Provider], tracing: object):
        super().__init__(config, bus, providers, tracing)
        self.drop = bus.drop

    async def handle(self, event: TrafficEvent) -> EvaluationRecord | None:
        try:
            return await super().handle(event)
        except asyncio.CancelledError:
            self.drop(event.route)
            raise


async def _ship_metrics(bus: ChannelBus, stop: asyncio.Event) -> None:
    while not stop.is_set():
        bus.channel.send(METRICS, pickle.dumps(relay.snapshot()))
        try:
            await asyncio.wait_for(stop.wait(), SNAPSHOT_S)
        except TimeoutError:
            pass


async def _run(config: Config, sock: socket.socket) -> None:
    from service.tracing import Tracing

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    bus = ChannelBus(sock, stop)
    providers = make_providers(config)
    tracing = Tracing(config.tracing)  # the proxy's service name, as when the workers ran in its process
    shipper = asyncio.create_task(_ship_metrics(bus, stop))
    try:
        await ChildWorker(config, bus, providers, tracing).run(stop)
    finally:
        stop.set()
        if bus.dropped:
            log.warning("the shadow child stopped before it could evaluate %d sampled requests "
                        "(counted as modelcanary_shadow_dropped_total{reason=\"%s\"})", bus.dropped, STOPPED)
        await shipper
        bus.channel.send(METRICS, pickle.dumps(relay.snapshot()))
        await bus.channel.drain(EXIT_DRAIN_S)
        bus.channel.close()
        for provider in providers.values():
            await provider.close()
        tracing.shutdown()


def main(config: Config, sock: socket.socket) -> None:
    """The child's entry point (multiprocessing, spawn: the parent's Config arrives pickled, as it was
    validated there, and the socket as a file descriptor)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    uvloop.run(_run(config, sock))


def encode(event: TrafficEvent) -> bytes:
    """A TrafficEvent as the traffic queue carries it."""
    return event.model_dump_json(by_alias=True).encode()
