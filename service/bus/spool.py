"""The bounded on-disk spool behind the Kafka bus (DESIGN §8).

Records whose delivery failed wait here, in order, until the broker is back.
Layout: `{dir}/slot-N/seg-000000000001.log` append-only segment files shared by
all topics, one record per line: `topic \\t key-as-JSON \\t value-JSON \\n`
(JSON never contains a raw newline or tab byte, so a line is a record and a torn
last line after a crash is recognisable). `seg-….pos` holds how many bytes of a
segment were already replayed, so a restart does not resend them.

Each line goes to the OS in one unbuffered write as it is appended (it then survives a crash of
this process). A write the disk refuses (full, unwritable) drops that record, counted as
`spool_error`, and is cut back off the segment, so the segment holds whole lines only and the
spool goes on: replaying what it holds, taking records again once the disk has room.

One process owns one slot (an exclusive `flock` on `slot-N/lock`), so several
workers can share `spool.dir`; a process that finds a slot nobody holds adopts
its segments. Files survive a process restart; the next owner replays them.

Not thread-safe: the Kafka bus's sender thread is the only user.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from service import metrics
from service.bus.base import TOPICS, Topic

log = logging.getLogger("modelcanary.bus.spool")

_SEGMENT = re.compile(r"^seg-(\d{12})\.log$")
_TOPICS: dict[bytes, Topic] = {t.encode(): t for t in TOPICS}
DROP_LOG_INTERVAL_S = 60.0  # drops of one reason are logged at most this often, with their count


@dataclass(frozen=True)
class SpoolEntry:
    topic: Topic
    key: str
    value: bytes


@dataclass
class SpoolBatch:
    """Entries read from the oldest segment; `ends[i]` is the byte offset just past entry i."""

    segment: _Segment
    entries: list[SpoolEntry]
    ends: list[int]
    skipped_to: int  # offset past unreadable lines at the front (already counted as dropped)


@dataclass
class _Segment:
    number: int
    path: Path
    size: int
    pos: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def pos_path(self) -> Path:
        return self.path.with_suffix(".pos")


def encode_line(topic: str, key: str, value: bytes) -> bytes:
    return b"%s\t%s\t%s\n" % (topic.encode(), json.dumps(key).encode(), value)


class _DropLog:
    """Says that records were dropped for one reason: at once, then at most once per interval, with how
    many were dropped since it last said so."""

    def __init__(self, level: int, reason: str):
        self.level, self.reason = level, reason
        self._count = 0
        self._said_at: float | None = None

    def note(self, slot: Path | None, detail: str) -> None:
        self._count += 1
        now = time.monotonic()
        said_at = self._said_at
        if said_at is None:
            log.log(self.level, "spool %s: a record was dropped (%s): %s; such drops are logged at most "
                    "once a minute from now on, with their count", slot, self.reason, detail)
        elif now - said_at >= DROP_LOG_INTERVAL_S:
            log.log(self.level, "spool %s: %d record%s dropped (%s) in the last %.0f s: %s", slot, self._count,
                    "" if self._count == 1 else "s", self.reason, now - said_at, detail)
        else:
            return
        self._count, self._said_at = 0, now


def decode_line(line: bytes) -> SpoolEntry | None:
    parts = line.rstrip(b"\n").split(b"\t", 2)
    if len(parts) != 3 or parts[0] not in _TOPICS or not line.endswith(b"\n"):
        return None
    try:
        key = json.loads(parts[1])
    except ValueError:
        return None
    if not isinstance(key, str):
        return None
    return SpoolEntry(_TOPICS[parts[0]], key, parts[2])


class Spool:
    def __init__(self, directory: str | os.PathLike, max_bytes: int, segment_bytes: int | None = None):
        self.root = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(4096, min(16 * 1024 * 1024, max_bytes // 8))
        self.slot: Path | None = None
        self._lock_fd: int | None = None
        self._segments: list[_Segment] = []  # oldest first; the last may be the active one
        self._active: _Segment | None = None
        self._fd: int | None = None  # the active segment, open for appending
        self._drop_logs = {"spool_full": _DropLog(logging.WARNING, "spool_full"),
                           "spool_error": _DropLog(logging.ERROR, "spool_error")}
        self._counts: dict[str, int] = {t: 0 for t in TOPICS}
        self._next_number = 1

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(self) -> None:
        """Take a slot, adopt orphaned slots, and index what is waiting (sets the gauges)."""
        self.root.mkdir(parents=True, exist_ok=True)
        i = 0
        while self._lock_fd is None:
            slot = self.root / f"slot-{i}"
            fd = _try_lock(slot)
            if fd is not None:
                self.slot, self._lock_fd = slot, fd
            i += 1
        self._index()
        self._adopt_orphans()
        self._publish_gauges()
        if self._segments:
            log.info("spool %s: %d records waiting from an earlier run", self.slot, len(self))

    def close(self) -> None:
        self._seal()
        if self._lock_fd is not None:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ---- writing ------------------------------------------------------------------------------

    def append(self, topic: str, key: str, value: bytes) -> bool:
        """Add a record at the end, handed to the OS. False when it is dropped, counted: reason
        spool_full when it does not fit in max_bytes, spool_error when the disk refuses it."""
        line = encode_line(topic, key, value)
        if self.slot is None:  # never opened (or could not be): nothing can be kept
            return self._dropped(topic, "spool_error", "the spool is not open")
        if self.disk_bytes + len(line) > self.max_bytes:
            return self._dropped(topic, "spool_full", f"events.spool.max_bytes is {self.max_bytes}")
        try:
            seg = self._writable()
            self._write(seg, line)
        except Exception as e:  # a full or unwritable disk, or anything else: the record is lost
            return self._dropped(topic, "spool_error", f"cannot write: {_why(e)}")
        seg.size += len(line)
        seg.counts[topic] = seg.counts.get(topic, 0) + 1
        self._counts[topic] += 1
        metrics.events_spooled.labels(topic).set(self._counts[topic])
        return True

    # ---- reading (replay) ---------------------------------------------------------------------

    def read(self, max_records: int, max_bytes: int = 4 * 1024 * 1024) -> SpoolBatch | None:
        """The next records in order from the oldest segment (the active one is sealed first)."""
        while self._segments:
            seg = self._segments[0]
            if seg is self._active:
                self._seal()
            entries: list[SpoolEntry] = []
            ends: list[int] = []
            skipped_to = seg.pos
            offset = seg.pos
            size = 0
            with open(seg.path, "rb") as f:
                f.seek(seg.pos)
                # past seg.size is at most a partial line a failed write left (and could not cut off)
                while len(entries) < max_records and size < max_bytes and offset < seg.size:
                    line = f.readline()
                    if not line:
                        break
                    entry = decode_line(line)
                    if entry is None:
                        if entries:
                            break  # the next read meets it first, counts and skips it
                        self._count_bad(line)
                        offset += len(line)
                        skipped_to = offset
                        continue
                    offset += len(line)
                    entries.append(entry)
                    ends.append(offset)
                    size += len(line)
            if entries:
                return SpoolBatch(seg, entries, ends, skipped_to)
            # nothing readable left in this segment
            seg.pos = max(skipped_to, seg.size)
            self._drop_segment(seg)
        return None

    def commit(self, batch: SpoolBatch, n: int) -> None:
        """The first `n` entries of `batch` are delivered: advance past them, delete a finished segment."""
        seg = batch.segment
        if seg not in self._segments:
            return
        new_pos = batch.ends[n - 1] if n > 0 else batch.skipped_to
        if new_pos <= seg.pos:
            return
        for entry in batch.entries[:n]:
            seg.counts[entry.topic] = seg.counts.get(entry.topic, 0) - 1
            self._counts[entry.topic] -= 1
            metrics.events_spooled.labels(entry.topic).set(self._counts[entry.topic])
        seg.pos = new_pos
        if seg.pos >= seg.size and seg is not self._active:
            self._drop_segment(seg)
            return
        try:
            _write_atomic(seg.pos_path, str(seg.pos).encode())
        except OSError as e:  # the replay goes on from memory; only a restart would resend them
            log.warning("spool %s: cannot keep the replayed position of %s (%s); after a restart its "
                        "replayed records would be sent again", self.slot, seg.path.name, _why(e))

    # ---- state --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self._counts.values())

    def count(self, topic: str) -> int:
        return self._counts.get(topic, 0)

    @property
    def disk_bytes(self) -> int:
        """The segment files' bytes: a replayed part goes from the disk with its whole segment."""
        return sum(seg.size for seg in self._segments)

    # ---- internals ----------------------------------------------------------------------------

    def _dropped(self, topic: str, reason: str, detail: str) -> bool:
        metrics.events_dropped_total.labels(topic, reason).inc()
        self._drop_logs[reason].note(self.slot, detail)
        return False

    def _writable(self) -> _Segment:
        seg = self._active
        if seg is None or seg.size >= self.segment_bytes:
            seg = self._roll()
        return seg

    def _roll(self) -> _Segment:
        self._seal()
        assert self.slot is not None
        seg = _Segment(self._next_number, self.slot / f"seg-{self._next_number:012d}.log", 0)
        self._next_number += 1
        self._fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segments.append(seg)
        self._active = seg
        return seg

    def _write(self, seg: _Segment, line: bytes) -> None:
        """All of `line` at the end of the active segment, or (raising) none of it."""
        assert self._fd is not None
        rest = memoryview(line)
        try:
            while rest:
                written = os.write(self._fd, rest)
                if written == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                rest = rest[written:]
        except BaseException:
            self._cut_back(seg)
            raise

    def _cut_back(self, seg: _Segment) -> None:
        """Remove what a failed write left past the segment's last whole line."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, seg.size)
        except OSError as e:  # the rest is read up to seg.size only; new records go to a new segment
            log.error("spool %s: cannot cut a partial line off %s (%s)", self.slot, seg.path.name, _why(e))
            self._seal()

    def _seal(self) -> None:
        """Close the active segment (it is not appended to again)."""
        fd, self._fd, self._active = self._fd, None, None
        if fd is None:
            return
        for step in (os.fsync, os.close):  # both, whatever the first does
            try:
                step(fd)
            except OSError as e:
                log.error("spool %s: closing a segment: %s failed: %s", self.slot, step.__name__, _why(e))

    def _drop_segment(self, seg: _Segment) -> None:
        if seg is self._active:
            self._seal()
        for t, c in seg.counts.items():
            if c:
                self._counts[t] -= c
                metrics.events_spooled.labels(t).set(self._counts[t])
        self._segments.remove(seg)
        for p in (seg.path, seg.pos_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def _index(self) -> None:
        assert self.slot is not None
        for number, path in sorted(_segment_files(self.slot)):
            self._segments.append(self._scan(number, path))
            self._next_number = max(self._next_number, number + 1)
        for seg in list(self._segments):
            if seg.pos >= seg.size:
                self._drop_segment(seg)

    def _scan(self, number: int, path: Path) -> _Segment:
        seg = _Segment(number, path, path.stat().st_size)
        try:
            seg.pos = min(int(seg.pos_path.read_text().strip() or 0), seg.size)
        except (FileNotFoundError, ValueError):
            seg.pos = 0
        with open(path, "rb") as f:
            f.seek(seg.pos)
            for line in f:
                entry = decode_line(line)
                if entry is not None:
                    seg.counts[entry.topic] = seg.counts.get(entry.topic, 0) + 1
        for t, c in seg.counts.items():
            self._counts[t] += c
        return seg

    def _adopt_orphans(self) -> None:
        """Move the segments of slots no live process holds into ours (after our own, in their order)."""
        assert self.slot is not None
        for other in sorted(self.root.glob("slot-*")):
            if other == self.slot or not other.is_dir():
                continue
            fd = _try_lock(other)
            if fd is None:
                continue
            try:
                for _, path in sorted(_segment_files(other)):
                    target = self.slot / f"seg-{self._next_number:012d}.log"
                    pos = path.with_suffix(".pos")
                    if pos.exists():
                        os.replace(pos, target.with_suffix(".pos"))
                    os.replace(path, target)
                    seg = self._scan(self._next_number, target)
                    self._next_number += 1
                    if seg.pos >= seg.size:
                        self._segments.append(seg)
                        self._drop_segment(seg)
                    else:
                        self._segments.append(seg)
                        log.info("spool: adopted %s from %s", target.name, other.name)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _publish_gauges(self) -> None:
        for t in TOPICS:
            metrics.events_spooled.labels(t).set(self._counts[t])

    def _count_bad(self, line: bytes) -> None:
        head = line.split(b"\t", 1)[0]
        topic = head.decode() if head in _TOPICS else "unknown"
        metrics.events_dropped_total.labels(topic, "bad_record").inc()
        log.warning("spool %s: skipped an unreadable line (%d bytes)", self.slot, len(line))


def _segment_files(slot: Path) -> list[tuple[int, Path]]:
    out = []
    for p in slot.iterdir():
        m = _SEGMENT.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return out


def _try_lock(slot: Path) -> int | None:
    slot.mkdir(parents=True, exist_ok=True)
    fd = os.open(slot / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _why(e: BaseException) -> str:
    return (e.strerror if isinstance(e, OSError) else None) or str(e) or type(e).__name__
