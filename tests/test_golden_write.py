"""`capture --out` over a curated golden set: the file is replaced only once the new set is whole. A
capture that fails midway (here: the file size limit a full disk or a quota sets) leaves the curated
file as it was and no partial file beside it; a case holding a lone surrogate (JSON allows "\\ud800",
so a client's request may) is written as its escape, not a crash midway."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import time

from collectors.golden import dataset
from service.records import PrimaryResult, TrafficEvent, dump
from tests.fixtures.servers import CLI, ROOT, canned_upstream, proxy_config, write_yaml

ROUTE = "support-bot"
CURATED = [dataset.Case(request_id=f"curated-{i}", route=ROUTE, tags=["edge"],
                        request={"messages": [{"role": "user", "content": f"hand-written question {i}"}]})
           for i in range(3)]


def traffic_lines(texts: list[str]) -> bytes:
    """What a memory-mode proxy's GET /admin/traffic answers: one sampled request per text."""
    now = time.time()
    events = [TrafficEvent(request_id=f"live-{i}", ts=now - 60 + i, route=ROUTE, segment="chat", config_version="v",
                           request={"model": ROUTE, "messages": [{"role": "user", "content": text}]},
                           primary=PrimaryResult(model="stable-m", status=200, latency_s=0.1, outcome="completed",
                                                 body={"choices": [{"message": {"role": "assistant",
                                                                                "content": "an answer " * 20}}]}))
              for i, text in enumerate(texts)]
    return b"".join(json.dumps(dump(e)).encode() + b"\n" for e in events)


def capture(tmp_path, body: bytes, out, max_file_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:  # in the child: writes past this size fail (EFBIG), as on a full disk
        if max_file_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    config = write_yaml(tmp_path / "c.yaml", proxy_config("http://127.0.0.1:9"))
    with canned_upstream(body, "application/x-ndjson") as (url, _):
        return subprocess.run([*CLI, "capture", "--config", str(config), "--url", url, "--token", "t", "--out",
                               str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              preexec_fn=limit)  # noqa: PLW1509 - only a signal and a limit, before exec


def test_a_capture_that_fails_midway_leaves_the_curated_golden_set_as_it_was(tmp_path):
    out = tmp_path / "golden" / "support.jsonl"
    out.parent.mkdir()
    dataset.write(out, CURATED)
    before = out.read_bytes()
    result = capture(tmp_path, traffic_lines([f"live question {i}" for i in range(60)]), out,
                     max_file_bytes=len(before) + 4096)  # room for the first cases, not for all
    assert result.returncode == 2, result.stderr
    assert "File too large" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert out.read_bytes() == before, "the curated golden set was overwritten by a partial capture"
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no partial file left beside it


def test_a_case_with_a_lone_surrogate_is_captured_and_read_back_as_it_came(tmp_path):
    out = tmp_path / "golden.jsonl"
    dataset.write(out, CURATED)
    result = capture(tmp_path, traffic_lines(["plain", "half a pair: \ud83d", "plain again"]), out)
    assert result.returncode == 0, result.stderr
    cases = {c.request_id: c for c in dataset.load(out)}
    assert cases["live-1"].request["messages"][-1]["content"] == "half a pair: \ud83d"
    assert sorted(cases) == ["live-0", "live-1", "live-2"]
