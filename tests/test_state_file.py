"""Memory mode's rollout state file: commits never wait for the disk, and a restart keeps the phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from service.rollout.book import RolloutBook
from tests.judge_traffic import make_config


def test_a_commit_does_not_wait_for_the_disk(tmp_path):
    """A FIFO where the temporary state file goes: opening it for writing blocks until someone reads
    it, a disk that does not answer. The operator's action still returns at once."""
    path = tmp_path / "rollouts.json"
    book = RolloutBook(make_config(), persist_path=path)
    os.mkfifo(path.with_suffix(".tmp"))
    returned = threading.Event()
    caller = threading.Thread(target=lambda: (book.operate("bot", "promote"), returned.set()), daemon=True)
    caller.start()
    try:
        assert returned.wait(5), "operate() waited for the state file to be written"
        assert book.get("bot").phase == "canary"
        assert not book.flush(0.2)  # the write is still held up by the FIFO
    finally:
        with open(path.with_suffix(".tmp")) as fifo:  # let the writer through
            written = json.loads(fifo.read())
    assert [s["phase"] for s in written["rollouts"]] == ["canary"]
    assert book.flush(5)


def test_the_latest_commit_wins_and_survives_a_restart(tmp_path):
    path = tmp_path / "rollouts.json"
    book = RolloutBook(make_config(rollout={"steps": [10, 50]}), persist_path=path)
    for action in ("promote", "promote", "pause"):
        book.operate("bot", action)
    assert book.flush(5)
    reread = RolloutBook(make_config(rollout={"steps": [10, 50]}), persist_path=path).get("bot")
    assert (reread.phase, reread.step_index, reread.paused_from) == ("paused", 1, "canary")


def test_a_process_that_exits_right_after_a_commit_has_written_it(tmp_path):
    path = tmp_path / "rollouts.json"
    script = (
        "import sys; from pathlib import Path; from service.rollout.book import RolloutBook; "
        "from tests.judge_traffic import make_config; "
        "RolloutBook(make_config(), persist_path=Path(sys.argv[1])).operate('bot', 'rollback')"
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert RolloutBook(make_config(), persist_path=path).get("bot").phase == "rolled_back"
