"""The shadow child process: a `collectors.worker.ShadowWorker` over a bus made of one socket to the
parent (collectors.embedded.channel), read and written on the child's event loop.

- from the parent: TRAFFIC frames (a TrafficEvent's JSON) and STOP (its payload: seconds left to
  evaluate the traffic already sent; then the rest is given up, what is in flight finishes, and the
  child exits);
- to the parent: TAKEN (how many traffic frames the workers took: the parent keeps at most
  `events.queue_size` untaken) and RESULTS: the EvaluationRecords (for the parent's bus) and the
  request ids of the sampled requests finished since the last RESULTS (evaluated, skipped or
  counted as an error), with relay.snapshot() taken after them, pickled in one frame: the parent
  gets a record exactly when it gets the metrics its evaluation wrote. Sent within RESULTS_S of an
  evaluation's end, every SNAPSHOT_S, and once more at exit.

The parent counts what the child was sent and never finished (given up, cancelled in flight, or
lost with a child that died) as `modelcanary_shadow_dropped_total{reason="stopped"}`.

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
from service.bus.base import Topic
from service.config import Config
from service.records import EvaluationRecord, Record, TrafficEvent, load
from service.upstream import make_providers
from service.upstream.base import Provider

log = logging.getLogger("modelcanary.shadow")

SNAPSHOT_S = 1.0
RESULTS_S = 0.25                # an evaluation's end waits at most this for its RESULTS frame (each
                                # carries a metrics snapshot, ~0.5 ms: at most 4 a second)
EXIT_DRAIN_S = 2.0
NICE = 10
TRAFFIC, STOP, TAKEN, RESULTS = b"t", b"s", b"c", b"r"


class ChannelBus:
    """The EventBus of the child: traffic in, evaluations out; nothing else travels."""

    def __init__(self, sock: socket.socket, stop: asyncio.Event):
        self._stop = stop
        self._traffic: deque[bytes] = deque()
        self._arrived = asyncio.Event()
        self._draining = False  # STOP came: hand out what is queued, then stop the worker
        self._records: list[bytes] = []  # published since the last RESULTS frame
        self._done: list[str] = []       # request ids finished since the last RESULTS frame
        self._results_due: asyncio.TimerHandle | None = None
        self.dropped = 0  # given up before the worker took them
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
        """Stop the worker now; what it was not handed yet is dropped (the parent counts it)."""
        self.dropped += len(self._traffic)
        self._traffic.clear()
        self._stop.set()
        self._arrived.set()

    def done(self, request_id: str) -> None:
        """A sampled request taken is finished: its records (if any) are published, its metrics written."""
        self._done.append(request_id)
        if self._results_due is None:
            self._results_due = asyncio.get_running_loop().call_later(RESULTS_S, self.ship)

    def ship(self) -> None:
        """One RESULTS frame: the records and finished ids since the last one, and the metrics now."""
        if self._results_due is not None:
            self._results_due.cancel()
            self._results_due = None
        results = (self._records, self._done, relay.snapshot())
        self._records, self._done = [], []
        self.channel.send(RESULTS, pickle.dumps(results))

    async def start(self) -> None:
        return None

    def publish(self, topic: Topic, record: Record) -> None:
        if topic == "evaluations":  # sent with the request's id and the metrics, once it is done
            self._records.append(record.model_dump_json(by_alias=True).encode())

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
    """A ShadowWorker that tells the parent each sampled request it finished; one cancelled in flight
    (the worker's drain timeout ran out) is not finished: the parent counts it."""

    def __init__(self, config: Config, bus: ChannelBus, providers: dict[str, Provider], tracing: object):
        super().__init__(config, bus, providers, tracing)
        self.channel_bus = bus

    async def handle(self, event: TrafficEvent) -> EvaluationRecord | None:
        try:
            record = await super().handle(event)
        except asyncio.CancelledError:
            raise
        except Exception:  # counted as an error by the worker, in the same step
            self.channel_bus.done(event.request_id)
            raise
        self.channel_bus.done(event.request_id)
        return record


async def _ship_results(bus: ChannelBus, stop: asyncio.Event) -> None:
    while not stop.is_set():
        bus.ship()
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
    shipper = asyncio.create_task(_ship_results(bus, stop))
    try:
        await ChildWorker(config, bus, providers, tracing).run(stop)
    finally:
        stop.set()
        if bus.dropped:
            log.warning("the shadow child stopped before it could take %d sampled requests it was sent", bus.dropped)
        await shipper
        bus.ship()
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
