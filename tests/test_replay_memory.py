"""Replay's memory: a golden set is replayed window by window, so only a window's answers are held at a
time (not every case's candidate and stable answers until the end), progress still counts each step
over the whole set, and `--json` prints the records one at a time, as one json.dumps would."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import tracemalloc
from collections import Counter
from types import SimpleNamespace

from collectors.evaluators.base import ShadowCall
from collectors.golden import commands, dataset, printing
from collectors.golden import replay as replaying
from service.config import parse_config
from service.records import CandidateResult, EvaluationRecord, EvaluationResult, Repro, dump
from tests.fixtures.servers import proxy_config, write_yaml
from tests.test_golden import golden_set

CONCURRENCY = 2


def answers_held() -> int:
    """Shadow answers alive in the process (a ShadowCall with a response)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, ShadowCall) and o.response is not None)


def test_replay_holds_one_windows_answers_not_every_cases(servers, tmp_path):
    sim = servers.simulator()
    golden = golden_set(sim.url, tmp_path / "golden.jsonl", n=24)   # 48 cases: three windows
    config = parse_config({**proxy_config(sim.url), "collect": {"concurrency": CONCURRENCY}})
    cases = dataset.load(golden)
    window = replaying.WINDOW_PER_SLOT * CONCURRENCY
    assert len(cases) == 3 * window
    held: list[int] = []
    steps: dict[str, list[int]] = {"answered": [], "evaluated": []}

    def progress(step: str, done: int, total: int) -> None:
        assert total == 48
        steps[step].append(done)
        if step == "answered":
            held.append(answers_held())

    runs, _ = asyncio.run(replaying.run(cases, config, "candidate-m", None, 3, progress))

    rr = runs["support-bot"]
    assert len(rr.records) == 48 and not rr.skipped
    assert all(r.stability.candidate is not None for r in rr.records)  # the repeats were asked and scored
    assert max(held) <= 2 * window, held  # a candidate and a stable answer per case of one window
    assert steps["answered"] == steps["evaluated"] == list(range(49))
    assert answers_held() == 0


def test_plain_progress_counts_each_step_on_its_own_when_steps_take_turns(capsys):
    report = printing.Reporter("replay")
    report.tty = False
    for start in range(0, 20, 5):  # windows of 5 of 20 cases: answered, then evaluated
        for step in ("answered", "evaluated"):
            for done in range(start, start + 6) if start == 0 else range(start + 1, start + 6):
                report(step, done, 20)
    lines = capsys.readouterr().err.splitlines()
    for step in ("answered", "evaluated"):
        assert [line for line in lines if f" {step} " in line] == \
            [f"replay: {step} {n}/20 cases" for n in range(0, 21, 2)]


def synthetic_run(n: int) -> tuple[dict[str, replaying.RouteRun], SimpleNamespace]:
    """A replayed route of n records (as `run` returns it, judged), without asking any model."""
    config = replaying.replay_config(parse_config(proxy_config("http://127.0.0.1:9/")), {"support-bot"},
                                     "candidate-m", None, None)
    rr = replaying.RouteRun("support-bot", config.routes["support-bot"])
    for i in range(n):
        done = CandidateResult(outcome="completed", latency_s=0.1, cost_usd=0.0001,
                               usage={"prompt_tokens": 20, "completion_tokens": 200, "total_tokens": 220})
        rr.records.append(EvaluationRecord(
            request_id=f"case-{i:05d}", ts=1.7e9, route="support-bot", segment="chat", stable_model="stable-m",
            candidate_model="candidate-m", candidate=done, stable_again=done, stable_latency_s=0.1,
            stable_cost_usd=0.0001, similarity={"candidate_vs_stable": 0.9, "stable_vs_stable": float("nan")},
            evaluations=[EvaluationResult(name="agreement", version="2", passed=True, score=0.9,
                                          detail="similarity to the live answer 0.900 " * 4)],
            repro=Repro(modelcanary_version="x", config_version="y", evaluator_versions={"agreement": "2"},
                        model_settings={"candidate-m": {"name": "new-model"}, "stable-m": {"name": "good-model"}})))
    replaying.judge(rr, {})
    client = SimpleNamespace(calls=Counter({"candidate-m": n}), served={}, cost_usd={"candidate-m": 0.1})
    return {"support-bot": rr}, client


def test_replay_json_is_printed_record_by_record_as_one_document_would_be(tmp_path, monkeypatch):
    runs, client = synthetic_run(3000)
    golden = tmp_path / "golden.jsonl"
    dataset.write(golden, [dataset.Case(request_id="case-00000", route="support-bot", segment="chat",
                                        request={"messages": [{"role": "user", "content": "hi"}]})])
    config = write_yaml(tmp_path / "replay.yaml", proxy_config("http://127.0.0.1:9/"))

    async def replayed(*args, **kwargs):
        return runs, client

    monkeypatch.setattr(commands, "run", replayed)
    printed = tmp_path / "replay.json"
    with open(printed, "w") as stdout:   # a file, not a capture: the output itself takes no memory
        monkeypatch.setattr(sys, "stdout", stdout)
        tracemalloc.start()
        try:
            code = commands.replay(str(golden), "candidate-m", None, None, str(config), True, None)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    out = printed.read_text()
    result = json.loads(out)
    assert code == 0 and len(result["records"]) == 3000
    assert result["records"][7]["similarity"]["stable_vs_stable"] is None  # NaN is no JSON: null
    assert out == json.dumps(commands.finite({**result, "records": [dump(r) for r in runs["support-bot"].records]}),
                             indent=2) + "\n"  # byte for byte what one json.dumps prints
    assert peak < 1.5 * len(out), f"printing {len(out) / 1e6:.1f} MB of JSON took {peak / 1e6:.1f} MB at its peak"
