"""The rollout state file of memory mode, written off the caller's thread.

Commits happen on the event loop; a write (and a slow disk) must not stall it. `save` hands the
latest snapshot to a writer thread and returns; snapshots that arrive while one is being written
coalesce, so only the newest is written next. The writer is not a daemon: a process that exits
normally waits for the last write, so a restart keeps the phase.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path

from pydantic import ValidationError

from service.records import RolloutState

log = logging.getLogger("modelcanary.rollout")


def state_dir_problem(directory: Path, create: bool = True) -> str | None:
    """Why the rollout state can't be written in `directory` (created when missing), or None; with
    `create` False, judged without touching the disk (`check-config`)."""
    if not create:
        existing = next(p for p in (directory, *directory.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            why = "not a directory" if not existing.is_dir() else "not writable"
            return f"cannot create or write the directory {str(directory)!r}: {str(existing)!r} is {why}"
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        return f"cannot create or write the directory {str(directory)!r}: {e.strerror or e}"
    return None


class StateFile:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._pending: list[RolloutState] | None = None
        self._writer: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()

    def load(self) -> dict[str, RolloutState]:
        """Every route's saved state. A record that is not valid is left out (that route starts
        fresh), logged with its route and fields; the other routes keep theirs."""
        if not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            log.error("ignoring unreadable rollout state %s: %s", self.path, e)
            return {}
        records = raw.get("rollouts", []) if isinstance(raw, dict) else None
        if not isinstance(records, list):
            log.error("ignoring rollout state %s: expected an object with a list of rollouts", self.path)
            return {}
        states: dict[str, RolloutState] = {}
        for index, record in enumerate(records):
            state = self._record(index, record)
            if state is not None:
                states[state.route] = state
        return states

    def _record(self, index: int, record: object) -> RolloutState | None:
        try:
            return RolloutState.model_validate(record)
        except ValidationError as e:
            route = record.get("route") if isinstance(record, dict) else None
            who = f"route {route!r}" if isinstance(route, str) else f"record {index}"
            fields = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '(record)'}: {err['msg']}"
                               for err in e.errors())
            log.error("rollout state %s: %s is not valid, so it starts fresh: %s", self.path, who, fields)
            return None

    def save(self, states: list[RolloutState]) -> None:
        """Queue `states` (every route's, replacing any snapshot not yet written) and return."""
        with self._lock:
            self._pending = states
            self._idle.clear()
            if self._writer is None:
                self._writer = threading.Thread(target=self._drain, name="rollout-state-writer")
                self._writer.start()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every snapshot saved so far is on disk; False if `timeout_s` passed first."""
        return self._idle.wait(timeout_s)

    def _drain(self) -> None:
        while True:
            with self._lock:
                states, self._pending = self._pending, None
                if states is None:
                    self._writer = None
                    self._idle.set()
                    return
            try:
                self._write(states)
            except Exception as e:  # the writer outlives a failed write; the next commit tries again
                log.error("cannot write rollout state %s: %s", self.path, e)

    def _write(self, states: list[RolloutState]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        payload = {"rollouts": [s.model_dump(mode="json", by_alias=True) for s in states]}
        tmp.write_text(json.dumps(payload, indent=2))
        os.replace(tmp, self.path)
