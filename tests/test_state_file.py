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


def test_one_invalid_record_restarts_only_its_route(tmp_path, caplog):
    """A promoted route stays promoted and a rolled-back candidate stays rolled back when another
    route's record in the same file is broken; only that route starts again in shadow."""
    path = tmp_path / "rollouts.json"
    routes = {name: {"stable": "stable-m", "candidate": "candidate-m", "rollout": {"steps": [10, 50]}}
              for name in ("bot", "other", "third")}
    config = make_config(routes=routes)
    book = RolloutBook(config, persist_path=path)
    for action in ("promote", "promote", "promote"):
        book.operate("bot", action)
    book.operate("other", "rollback")
    assert book.flush(5)
    assert book.get("bot").phase == "promoted"
    saved = json.loads(path.read_text())
    for record in saved["rollouts"]:
        if record["route"] == "third":
            record["phase"] = "canaryy"
    path.write_text(json.dumps(saved))

    with caplog.at_level("ERROR", logger="modelcanary.rollout"):
        reread = RolloutBook(config, persist_path=path)
    assert [reread.get(r).phase for r in ("bot", "other", "third")] == ["promoted", "rolled_back", "shadow"]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert "route 'third'" in errors[0] and "phase" in errors[0] and str(path) in errors[0], errors[0]


def test_a_file_that_is_not_a_list_of_rollouts_is_ignored_without_a_traceback(tmp_path, caplog):
    path = tmp_path / "rollouts.json"
    path.write_text(json.dumps({"rollouts": {"bot": "promoted"}}))
    with caplog.at_level("ERROR", logger="modelcanary.rollout"):
        assert RolloutBook(make_config(), persist_path=path).get("bot").phase == "shadow"
    assert any(str(path) in r.getMessage() for r in caplog.records)
