"""The Kafka bus's spool when its disk fails: full, unwritable. Every record is delivered or counted
as dropped (delivered + dropped = produced), and delivery resumes once broker and disk allow."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from service.bus import spool as spool_module
from service.bus.kafka import read_topic
from service.bus.spool import Spool
from tests.fixtures.broker import TansuBroker, free_port
from tests.test_kafka_bus import ROOT, dropped, make_bus, outcome, prefix, published, spooled_gauge, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

FSIZE_LIMIT = 16 * 1024  # bytes a file of the child may grow to: its "disk"

# A real KafkaBus whose files can't grow past FSIZE_LIMIT (RLIMIT_FSIZE stops root too; SIGXFSZ is
# ignored, so a write past it fails with EFBIG, as one on a full disk fails with ENOSPC).
FULL_DISK_CHILD = """
import asyncio, json, resource, signal, sys
from pathlib import Path
from prometheus_client import REGISTRY
from tests.test_kafka_bus import make_bus, outcome

bootstrap, prefix, spool_dir, limit = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])

def metric(name, **labels):
    return int(REGISTRY.get_sample_value(name, {"topic": "outcomes", **labels}) or 0)

def say(word, bus):
    print(word, json.dumps({"spooled": bus.spooled, "published": metric("modelcanary_events_published_total"),
                            "spool_error": metric("modelcanary_events_dropped_total", reason="spool_error")}),
          flush=True)

async def until(cond, timeout_s):
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return False

async def main():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    bus = make_bus(bootstrap, spool_dir, prefix)  # nothing listens there yet
    await bus.start()
    for i in range(200):  # far more than fits: the disk fills
        bus.publish("outcomes", outcome("full", i))
    await bus.flush(10)
    say("FULL", bus)
    sys.stdin.readline()  # the broker is back; the disk is still full
    await until(lambda: bus.spooled == 0, 20)
    for i in range(20):
        bus.publish("outcomes", outcome("direct", i))
    await bus.flush(15)
    say("DONE", bus)
    await bus.close()

asyncio.run(main())
"""


def test_a_full_disk_drops_counted_records_and_delivery_resumes(tmp_path):
    """Records the full disk refused are counted as spool_error; those spooled before it replay when
    the broker is back, though the disk is still full, and later records go out directly."""
    port = free_port()
    bootstrap, p = f"127.0.0.1:{port}", prefix()
    with open(tmp_path / "child.log", "w") as child_log:
        child = subprocess.Popen([sys.executable, "-c", FULL_DISK_CHILD, bootstrap, p, str(tmp_path / "spool"),
                                  str(FSIZE_LIMIT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=child_log, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    broker = TansuBroker(port, log_path=tmp_path / "tansu.log")

    def said(word: str) -> dict[str, int]:
        assert child.stdout is not None
        for line in child.stdout:
            if line.startswith(word):
                return dict(json.loads(line.split(" ", 1)[1]))
        raise AssertionError(f"the child ended before saying {word}: exit {child.wait()}, "
                             f"log: {(tmp_path / 'child.log').read_text()[-3000:]}")

    try:
        full = said("FULL")
        assert 0 < full["spooled"] < 200 and full["spooled"] + full["spool_error"] == 200, full
        broker.start()
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.flush()
        done = said("DONE")
        assert done["spooled"] == 0, done  # replayed
        assert done["published"] == full["spooled"] + 20, done  # every one spooled, then the direct ones
        assert done["published"] + done["spool_error"] == 220, done  # delivered + dropped = produced
        assert child.wait(30) == 0
        got = [m["request_id"] for m in read_topic(bootstrap, f"{p}.outcomes", 15)]
        assert len(got) == len(set(got)) == done["published"]
        assert {f"direct-{i}" for i in range(20)} <= set(got)
    finally:
        if child.poll() is None:
            child.kill()
        broker.stop()


async def test_an_unwritable_spool_directory_counts_each_record_it_loses(tmp_path):
    """The spool's directory can't be written (here: a file stands where it was, which stops root
    too): each record is counted as spool_error and flush says so; once writable, spooling resumes."""
    port = free_port()
    broker = TansuBroker(port, log_path=tmp_path / "tansu.log")
    p, spool_dir = prefix(), tmp_path / "spool"
    bus = make_bus(broker.bootstrap, spool_dir, p)
    await bus.start()  # nothing listens yet
    slot, aside = spool_dir / "slot-0", spool_dir / "aside"
    try:
        base_pub, base_err = published(), dropped("spool_error")
        slot.rename(aside)
        slot.write_bytes(b"")
        for i in range(20):
            bus.publish("outcomes", outcome("lost", i))
        await wait_for(lambda: dropped("spool_error") - base_err == 20, 10, "20 records counted as spool_error")
        assert not await bus.flush(5)  # they were dropped: flush does not report them settled
        slot.unlink()
        aside.rename(slot)
        for i in range(10):
            bus.publish("outcomes", outcome("kept", i))
        assert await bus.flush(5)
        assert bus.spooled == 10 and spooled_gauge() == 10

        broker.start()
        await wait_for(lambda: bus.spooled == 0, 30, "spool replayed")
        assert published() - base_pub == 10 and dropped("spool_error") - base_err == 20
        got = {m["request_id"] for m in read_topic(broker.bootstrap, f"{p}.outcomes", 10)}
        assert got == {f"kept-{i}" for i in range(10)}
    finally:
        await bus.close()
        broker.stop()


def test_a_failing_write_leaves_no_partial_line_and_the_spool_usable(tmp_path, monkeypatch):
    """Unit level, besides the real-disk test above: a write that fails half-way (ENOSPC after part of
    the line) is cut back off the segment; the segment stays readable and later records go in."""
    spool = Spool(tmp_path, 1 << 20)
    spool.open()
    real_write = os.write
    calls = {"n": 0}

    def short_then_enospc(fd: int, data: bytes | memoryview) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            return real_write(fd, bytes(data)[:7])  # part of the line reaches the disk...
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")  # ...then the disk is full
        return real_write(fd, data)

    try:
        before = dropped("spool_error")
        monkeypatch.setattr(spool_module.os, "write", short_then_enospc)
        assert spool.append("outcomes", "a", b'{"i":1}')
        assert not spool.append("outcomes", "b", b'{"i":2}')
        assert spool.append("outcomes", "c", b'{"i":3}')
        monkeypatch.undo()
        assert dropped("spool_error") - before == 1 and len(spool) == 2
        batch = spool.read(10)
        assert batch is not None and [e.key for e in batch.entries] == ["a", "c"]
        segment = next(spool.slot.glob("seg-*.log"))  # type: ignore[union-attr]
        assert segment.stat().st_size == batch.ends[-1]
    finally:
        spool.close()


def test_spool_full_drops_are_logged_at_most_once_a_minute_with_their_count(tmp_path, caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(spool_module.time, "monotonic", lambda: clock[0])
    spool = Spool(tmp_path, max_bytes=5000)
    spool.open()
    record = b'{"pad":"' + b"x" * 80 + b'"}'
    try:
        with caplog.at_level(logging.WARNING, logger="modelcanary.bus.spool"):
            n = 0
            while spool.append("outcomes", f"k{n}", record):
                n += 1
            for i in range(99):
                assert not spool.append("outcomes", f"over{i}", record)
            clock[0] += 61
            assert not spool.append("outcomes", "late", record)
        warnings = [r.getMessage() for r in caplog.records if "spool_full" in r.getMessage()]
        assert len(warnings) == 2, warnings
        assert "a record was dropped" in warnings[0] and "100 records dropped" in warnings[1], warnings
    finally:
        spool.close()


async def test_spooling_is_logged_when_the_broker_is_down_at_start_and_so_is_the_replay(tmp_path, caplog):
    port = free_port()
    broker = TansuBroker(port, log_path=tmp_path / "tansu.log")
    bus = make_bus(broker.bootstrap, tmp_path / "spool", prefix())
    with caplog.at_level(logging.INFO, logger="modelcanary.bus"):
        await bus.start()  # nothing listens yet
        try:
            for i in range(5):
                bus.publish("outcomes", outcome("down", i))
            assert await bus.flush(5)
            spooling = [r for r in caplog.records if "spooling" in r.getMessage()]
            assert len(spooling) == 1 and spooling[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
            broker.start()
            await wait_for(lambda: any("spool replayed" in r.getMessage() for r in caplog.records), 30,
                           "the replay's end logged")
        finally:
            await bus.close()
            broker.stop()
