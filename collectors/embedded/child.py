"""The shadow child process: `collectors.worker.run_workers` over a bus made of two queues.

- traffic: TrafficEvents from the parent, as JSON (`None` asks the child to finish and exit);
- results: ("record", JSON of an EvaluationRecord) for the parent's bus, and ("metrics",
  relay.snapshot()) every SNAPSHOT_S and once more at exit.

The child stops by itself when its parent is gone. SIGINT is ignored (a Ctrl-C in a terminal
reaches the whole process group; the parent asks the child to stop, with the queue).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import signal
from collections.abc import Callable

from collectors.embedded import relay
from collectors.worker import run_workers
from service import metrics
from service.bus.base import Topic
from service.config import Config
from service.records import Record, TrafficEvent, load
from service.upstream import make_providers

log = logging.getLogger("modelcanary.shadow")

SNAPSHOT_S = 1.0
STOP = None  # on the traffic queue: finish what is in flight, then exit


class QueueSubscription:
    def __init__(self, traffic, stop: asyncio.Event):
        self._traffic = traffic
        self._stop = stop

    def _take(self, timeout_s: float) -> object:
        try:
            return self._traffic.get(timeout=timeout_s)
        except queue.Empty:
            return queue.Empty

    async def get_batch(self, max_records: int, timeout_s: float) -> list[Record]:
        items = [await asyncio.to_thread(self._take, timeout_s)]
        while items[-1] is not queue.Empty and items[-1] is not STOP and len(items) < max_records:
            try:
                items.append(self._traffic.get_nowait())
            except queue.Empty:
                break
        if STOP in items:
            self._stop.set()
        return [load(json.loads(item)) for item in items if isinstance(item, (bytes, str))]

    async def commit(self) -> None:
        return None

    async def close(self) -> None:
        return None


class QueueBus:
    """The EventBus of the child: traffic in, evaluations out; nothing else travels."""

    def __init__(self, traffic, results, stop: asyncio.Event):
        self._traffic = traffic
        self._results = results
        self._stop = stop

    async def start(self) -> None:
        return None

    def publish(self, topic: Topic, record: Record) -> None:
        if topic != "evaluations":
            return
        try:
            self._results.put_nowait(("record", record.model_dump_json(by_alias=True)))
        except queue.Full:  # the parent stopped reading
            metrics.shadow_dropped_total.labels(record.route, "queue_full").inc()

    def subscribe(self, topics: list[Topic], group: str | None) -> QueueSubscription:
        if topics != ["traffic"]:
            raise ValueError(f"the shadow child only reads traffic, not {topics}")
        return QueueSubscription(self._traffic, self._stop)

    async def flush(self, timeout_s: float) -> bool:
        return True

    async def replay(self, topics: list[Topic], group: str, since_ts: float, handle: Callable[[Record], object],
                     stop: asyncio.Event | None = None) -> int:
        return 0

    async def close(self) -> None:
        return None


async def _ship_metrics(results, stop: asyncio.Event, parent: int) -> None:
    while not stop.is_set():
        if os.getppid() != parent:  # the parent is gone: nobody reads
            log.warning("the proxy process is gone; the shadow child stops")
            stop.set()
            return
        results.put(("metrics", relay.snapshot()))
        try:
            await asyncio.wait_for(stop.wait(), SNAPSHOT_S)
        except TimeoutError:
            pass


async def _run(config: Config, traffic, results, parent: int) -> None:
    from service.tracing import Tracing

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    providers = make_providers(config)
    tracing = Tracing(config.tracing)  # the proxy's service name, as when the workers ran in its process
    shipper = asyncio.create_task(_ship_metrics(results, stop, parent))
    try:
        await run_workers(config, QueueBus(traffic, results, stop), providers, tracing, stop)
    finally:
        stop.set()
        await shipper
        results.put(("metrics", relay.snapshot()))
        for provider in providers.values():
            await provider.close()
        tracing.shutdown()


def main(config: Config, traffic, results, parent: int) -> None:
    """The child's entry point (multiprocessing, spawn: the parent's Config arrives pickled, as it was
    validated there)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    asyncio.run(_run(config, traffic, results, parent))


def encode(event: TrafficEvent) -> bytes:
    """A TrafficEvent as the traffic queue carries it."""
    return event.model_dump_json(by_alias=True).encode()
