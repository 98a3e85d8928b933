"""The shadow child process: `collectors.worker.run_workers` over a bus made of one socket to the
parent (collectors.embedded.channel), read and written on the child's event loop.

- from the parent: TRAFFIC frames (a TrafficEvent's JSON) and STOP (finish what is in flight, exit);
- to the parent: RECORD (an EvaluationRecord's JSON, for the parent's bus), TAKEN (how many
  traffic frames the workers took: the parent keeps at most `events.queue_size` untaken), and
  METRICS (relay.snapshot(), pickled) every SNAPSHOT_S and once more at exit.

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
from collectors.worker import run_workers
from service.bus.base import Topic
from service.config import Config
from service.records import Record, TrafficEvent, load
from service.upstream import make_providers

log = logging.getLogger("modelcanary.shadow")

SNAPSHOT_S = 1.0
EXIT_DRAIN_S = 2.0
NICE = 10
TRAFFIC, STOP, RECORD, TAKEN, METRICS = b"t", b"s", b"r", b"c", b"m"


class ChannelBus:
    """The EventBus of the child: traffic in, evaluations out; nothing else travels."""

    def __init__(self, sock: socket.socket, stop: asyncio.Event):
        self._stop = stop
        self._traffic: deque[bytes] = deque()
        self._arrived = asyncio.Event()
        self.channel = Channel(sock, self._frame, self._parent_gone)

    def _frame(self, kind: bytes, payload: bytes) -> None:
        if kind == TRAFFIC:
            self._traffic.append(payload)
            self._arrived.set()
        elif kind == STOP:
            self._stop.set()
            self._arrived.set()

    def _parent_gone(self) -> None:
        if not self._stop.is_set():
            log.warning("the proxy process is gone; the shadow child stops")
        self._stop.set()
        self._arrived.set()

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
        if not self._traffic and not self._stop.is_set():
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout_s)
            except TimeoutError:
                pass
        taken = [self._traffic.popleft() for _ in range(min(max_records, len(self._traffic)))]
        if taken:
            self.channel.send(TAKEN, str(len(taken)).encode())
        return [load(json.loads(item)) for item in taken]

    async def commit(self) -> None:
        return None

    async def flush(self, timeout_s: float) -> bool:
        return True

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None) -> int:
        return 0

    async def close(self) -> None:
        return None


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
        await run_workers(config, bus, providers, tracing, stop)
    finally:
        stop.set()
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
