"""Evaluators and shadow statistics, in process: answer normalisation, the judge's strict parsing,
and ShadowStats' intervals, de-duplication and examples."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from collectors.evaluators import AgreementEvaluator, JudgeEvaluator, StabilityEvaluator, VerifiersEvaluator
from collectors.evaluators.answers import agrees, answer_key, canonical_json, normalize_text
from collectors.evaluators.base import EvalContext, ShadowCall
from collectors.evaluators.llm_judge import JUDGEMENT_SCHEMA, judge_request, parse_judgement
from collectors.worker import shadow_body
from service.config import parse_config
from service.judge.shadow_report import ShadowStats, newcombe, quantile_interval, wilson
from service.proxy.outcome import COMPLETED, failed
from service.records import (
    Agreement,
    CandidateResult,
    EvaluationRecord,
    EvaluationResult,
    PrimaryResult,
    Repro,
    TrafficEvent,
)

pytestmark = pytest.mark.timeout(60)


def text(content: str | None, **message) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, **message},
                         "finish_reason": "stop"}]}


def tool(name: str, arguments: str, call_id: str = "call_1") -> dict:
    return text(None, tool_calls=[{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}])


# ---- agreement -------------------------------------------------------------------------------------


def test_text_normalisation():
    assert normalize_text("  Hello,\n\tWORLD.  ") == "hello, world"
    assert normalize_text("Ｆｕｌｌｗｉｄｔｈ") == "fullwidth"  # NFKC
    assert agrees(text("The answer is 42."), text("the answer  is 42"))
    assert not agrees(text("The answer is 42."), text("The answer is 43."))
    assert agrees(text([{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]), text("hi there!"))


def test_canonical_json_equality():
    assert canonical_json({"b": 1.0, "a": [1, {"y": 2, "x": 1}]}) == '{"a":[1,{"x":1,"y":2}],"b":1}'
    assert agrees(text('{"a": 1, "b": [1, 2]}'), text('{\n  "b": [1, 2.0],\n  "a": 1\n}'))
    assert agrees(text('```json\n{"a": 1}\n```'), text('{"a":1}'))
    assert not agrees(text('{"a": 1, "b": [1, 2]}'), text('{"a": 1, "b": [2, 1]}'))
    assert not agrees(text('{"a": "1"}'), text('{"a": 1}'))
    # JSON never equals text that merely looks alike
    assert answer_key(text('{"a": 1}'))[0] == "json"
    assert answer_key(text("{not json"))[0] == "text"


def test_tool_calls_compare_by_name_and_canonical_arguments():
    assert agrees(tool("lookup", '{"id": 7, "q": "x"}', "call_a"), tool("lookup", '{"q":"x","id":7.0}', "call_b"))
    assert not agrees(tool("lookup", '{"id": 7}'), tool("search", '{"id": 7}'))
    assert not agrees(tool("lookup", '{"id": 7}'), tool("lookup", '{"id": 8}'))
    assert not agrees(tool("lookup", '{"id": 7}'), text('{"id": 7}'))
    # malformed arguments compare as raw text, and never equal the valid ones
    assert not agrees(tool("lookup", '{"id": 7'), tool("lookup", '{"id": 7}'))
    legacy = text(None, function_call={"name": "lookup", "arguments": '{"id":7}'})
    assert agrees(legacy, tool("lookup", '{ "id": 7 }'))


def test_refusal_and_missing_answers():
    assert not agrees(text(None, refusal="I can't help with that."), text("I can't help with that."))
    assert agrees(None, text("x")) is None
    assert agrees({"choices": []}, text("x")) is None


def test_shadow_body_is_never_streamed_and_names_the_upstream_model():
    body = {"model": "support-bot", "messages": [], "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.2}
    out = shadow_body(body, "new-model")
    assert out == {"model": "new-model", "messages": [], "temperature": 0.2}
    assert body["stream"] is True  # the event's request is not modified


# ---- evaluators on a context -----------------------------------------------------------------------

CONFIG = parse_config({
    "providers": {"sim": {"base_url": "http://127.0.0.1:1/v1"}},
    "models": {"s": {"provider": "sim", "name": "good"}, "c": {"provider": "sim", "name": "new"},
               "j": {"provider": "sim", "name": "judge"}},
    "routes": {"r": {"stable": "s", "candidate": "c",
                     "shadow": {"stability": {"sample_rate": 1.0, "k": 3}, "judge": {"model": "j"}}}},
})


class ScriptedCaller:
    """Answers shadow calls from a script (the judge's and stability's upstream)."""

    def __init__(self, answers: list[dict | None]):
        self.answers = list(answers)
        self.bodies: list[dict] = []

    async def call(self, route, model_key, body, checks=None):
        self.bodies.append(body)
        response = self.answers.pop(0)
        verdict = COMPLETED if response is not None else failed("provider_5xx")
        return ShadowCall(model_key, verdict, response=response, status=200 if response else 500)


def context(candidate: dict | None, verdict=COMPLETED, live: dict | None = None, again: dict | None = None,
            caller=None) -> EvalContext:
    request = {"model": "r", "messages": [{"role": "user", "content": "hi"}]}
    event = TrafficEvent(request_id="rid-1", ts=time.time(), route="r", segment="chat", request=request,
                         primary=PrimaryResult(model="s", status=200, body=live, latency_s=0.1, outcome="completed"),
                         config_version="v")
    return EvalContext(config=CONFIG, route="r", route_cfg=CONFIG.routes["r"], event=event, request=request,
                       live=live, candidate=ShadowCall("c", verdict, response=candidate),
                       stable_again=ShadowCall("s", COMPLETED, response=again) if again is not None else None,
                       caller=caller or ScriptedCaller([]))


def run(coro):
    return asyncio.run(coro)


def test_verifiers_reports_the_shared_verdict():
    ev = VerifiersEvaluator()
    ok = run(ev.evaluate(context(text("x"))))
    assert (ok.passed, ok.score) == (True, 1.0)
    bad = run(ev.evaluate(context(text("x"), verdict=failed("invalid_json", "not JSON"))))
    assert bad.passed is False and bad.detail.startswith("invalid_json")
    assert not ev.selected(context(None, verdict=failed("rate_limited")))


def test_agreement_evaluator_and_noise_floor():
    ctx = context(text("A."), live=text("a"), again=text("b"))
    result = run(AgreementEvaluator().evaluate(ctx))
    assert result.passed is True and "stable-again disagrees" in result.detail
    from collectors.evaluators.agreement import compare
    assert compare(ctx) == Agreement(candidate_vs_stable=True, stable_vs_stable=False)
    assert compare(context(text("a"), live=text("a"))).stable_vs_stable is None


def judge_answer(content: str) -> dict:
    return text(content)


@pytest.mark.parametrize("content, problem", [
    ("not json at all", "not JSON"),
    ('{"score": 1.2, "reason": "too high"}', "schema"),
    ('{"score": "0.9", "reason": "string score"}', "schema"),
    ('{"score": true, "reason": "bool score"}', "score"),
    ('{"score": 0.9}', "schema"),
    ('{"score": 0.9, "reason": "ok", "extra": 1}', "schema"),
    ("", "empty"),
])
def test_malformed_judge_answer_is_an_error_never_a_pass(content, problem):
    caller = ScriptedCaller([judge_answer(content)])
    result = run(JudgeEvaluator().evaluate(context(text("x"), caller=caller)))
    assert result.passed is None and result.score is None
    assert "malformed judge answer" in result.detail and problem in result.detail


def test_judge_request_and_good_answer():
    caller = ScriptedCaller([judge_answer('{"score": 0.8, "reason": "fine"}'), judge_answer('{"score": 0, "reason": "bad"}')])
    good = run(JudgeEvaluator().evaluate(context(tool("lookup", "{}"), caller=caller)))
    assert (good.passed, good.score, good.detail) == (True, 0.8, "fine")
    body = caller.bodies[0]
    assert body["response_format"]["json_schema"]["schema"] == JUDGEMENT_SCHEMA
    assert "Rubric:" in body["messages"][0]["content"] and "lookup" in body["messages"][1]["content"]
    low = run(JudgeEvaluator().evaluate(context(text("x"), caller=caller)))
    assert (low.passed, low.score) == (False, 0.0)
    failed_call = run(JudgeEvaluator().evaluate(context(text("x"), caller=ScriptedCaller([None]))))
    assert failed_call.passed is None and "judge call failed" in failed_call.detail
    assert parse_judgement(None) == "no answer"
    assert judge_request("r", {"messages": [{"role": "user", "content": "x" * 100_000}]}, None)["messages"][1][
        "content"].count("characters cut") == 1


def test_stability_majority():
    caller = ScriptedCaller([text("a"), text("b")])
    result = run(StabilityEvaluator().evaluate(context(text("A"), caller=caller)))
    assert result.passed is True and result.score == pytest.approx(2 / 3)
    caller = ScriptedCaller([text("b"), text("c")])
    result = run(StabilityEvaluator().evaluate(context(text("a"), caller=caller)))
    assert result.passed is False and result.score == pytest.approx(1 / 3)
    caller = ScriptedCaller([None, None])
    assert run(StabilityEvaluator().evaluate(context(text("a"), caller=caller))).passed is None


# ---- intervals -------------------------------------------------------------------------------------


def test_wilson_and_newcombe():
    lo, hi = wilson(0, 20)
    assert lo == 0.0 and 0.15 < hi < 0.17
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-3) and hi == pytest.approx(0.5962, abs=1e-3)
    assert wilson(0, 0) is None
    lo, hi = newcombe(90, 100, 90, 100)
    assert lo < 0 < hi
    lo, hi = newcombe(60, 100, 90, 100)
    assert hi < 0


def test_order_statistic_quantile_interval_covers():
    rng = random.Random(3)
    misses = 0
    for _ in range(200):
        xs = [rng.expovariate(1.0) for _ in range(200)]
        _, (lo, hi) = quantile_interval(xs, 0.95)
        true_p95 = -__import__("math").log(0.05)
        misses += not (lo <= true_p95 <= hi)
    assert misses <= 20  # ~5% expected
    est, (lo, hi) = quantile_interval([1.0] * 10, 0.95)
    assert est == 1.0 and hi is None  # 10 values cannot bound a p95 from above


# ---- ShadowStats -----------------------------------------------------------------------------------


def record(i: int, segment: str = "chat", outcome: str = "completed", cause: str | None = None,
           agree: bool | None = True, floor: bool | None = True, latency: float = 0.2, cost: float = 0.001,
           evaluations=()) -> EvaluationRecord:
    return EvaluationRecord(
        request_id=f"r{i}", ts=0.0, route="r", segment=segment, stable_model="s", candidate_model="c",
        candidate=CandidateResult(outcome=outcome, cause=cause, blame="model" if cause else None, latency_s=latency,
                                  cost_usd=cost),
        evaluations=list(evaluations), agreement=Agreement(candidate_vs_stable=agree, stable_vs_stable=floor),
        repro=Repro(modelcanary_version="0", config_version="v"), stable_latency_s=0.3, stable_cost_usd=0.002,
    )


def test_shadow_stats_summary():
    stats = ShadowStats(route="r")
    for i in range(100):
        bad = i % 10 == 0
        stats.add(record(i, segment="tools" if i % 2 else "chat",
                         outcome="failed" if bad else "completed", cause="invalid_tool_call" if bad else None,
                         agree=i % 5 != 0, latency=0.1 + i / 1000,
                         evaluations=[EvaluationResult(name="verifiers", version="1", passed=not bad,
                                                       score=0.0 if bad else 1.0)]))
    stats.add(record(3, segment="tools"))  # a duplicate is ignored
    stats.add(record(1000).model_copy(update={"route": "other"}))  # another route is ignored
    s = stats.summary()
    json.dumps(s)  # JSON-ready
    assert s["n"] == 100 and s["stable_outcomes"] == "live"
    assert list(s["segments"]) == ["overall", "chat", "tools"]
    overall = s["segments"]["overall"]
    comp = overall["completion_rate"]["candidate"]
    assert (comp["value"], comp["count"], comp["n"]) == (0.9, 90, 100)
    assert comp["interval"][0] < 0.9 < comp["interval"][1]
    assert overall["completion_rate"]["stable"]["value"] == 1.0
    fail = overall["failure_rate"]["invalid_tool_call"]["candidate"]
    assert fail["count"] == 10 and fail["value"] == 0.1
    assert overall["examples"]["invalid_tool_call"] == ["r0", "r10", "r20"]
    assert overall["agreement"]["candidate_vs_stable"]["value"] == 0.8
    assert overall["agreement"]["noise_floor"]["value"] == 1.0
    gap = overall["agreement"]["gap"]
    assert gap["value"] == pytest.approx(-0.2) and gap["interval"][1] < 0
    p50 = overall["latency_p50_s"]["candidate"]
    assert p50["n"] == 90 and p50["interval"][0] <= p50["value"] <= p50["interval"][1]
    assert overall["latency_p95_s"]["stable"]["value"] == pytest.approx(0.3)
    cost = overall["cost_per_completion_usd"]
    assert cost["candidate"]["value"] == pytest.approx(0.1 / 90) and cost["candidate"]["n"] == 90
    assert cost["stable"]["value"] == pytest.approx(0.002)
    assert overall["evaluations"]["verifiers"]["pass"] == 90
    assert overall["evaluations"]["verifiers"]["pass_rate"]["value"] == 0.9
    # i % 10 == 0 are all even: the chat segment holds every failure
    assert s["segments"]["tools"]["completion_rate"]["candidate"]["value"] == 1.0
    assert s["segments"]["chat"]["failure_rate"]["invalid_tool_call"]["candidate"]["count"] == 10


def test_shadow_stats_memory_is_bounded():
    stats = ShadowStats(seen_memory=1000)
    for i in range(5000):
        stats.add(record(i, latency=i))
    seg = stats._segments["overall"]
    assert len(seg.cand_latency.values) <= 2048 and seg.cand_latency.seen == 5000
    assert len(stats._seen) == 1000
    p50 = stats.summary()["segments"]["overall"]["latency_p50_s"]["candidate"]
    assert 2000 < p50["value"] < 3000 and p50["n"] == 5000


def test_report_tables_render():
    from rich.console import Console

    from service.judge.shadow_report import failures_table, shadow_table

    stats = ShadowStats()
    for i in range(20):
        stats.add(record(i, outcome="failed" if i < 2 else "completed", cause="refusal" if i < 2 else None))
    console = Console(record=True, width=250)
    console.print(shadow_table(stats.summary()))
    console.print(failures_table(stats.summary()))
    out = console.export_text()
    assert "overall" in out and "refusal" in out and "r0, r1" in out
