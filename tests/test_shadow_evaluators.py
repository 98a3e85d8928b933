"""Evaluators and shadow statistics, in process: semantic agreement with its noise floor, the
pairwise judge (both orders, strict parsing), stability by similarity, and ShadowStats' intervals,
de-duplication and examples."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest

from collectors.evaluators import AgreementEvaluator, JudgeEvaluator, StabilityEvaluator, VerifiersEvaluator
from collectors.evaluators.agreement import measure
from collectors.evaluators.base import EvalContext, ShadowCall, StableSide
from collectors.evaluators.llm_judge import (
    PROMPT_VERSION,
    VERDICT_SCHEMA,
    pairwise_request,
    parse_verdict,
    repro_params,
)
from collectors.similarity import local_embedder
from collectors.worker import shadow_body
from service.config import parse_config
from service.judge.shadow_report import ShadowStats, newcombe, quantile_interval, wilson
from service.proxy.formats import RESPONSES
from service.proxy.outcome import COMPLETED, failed
from service.records import (
    Agreement,
    CandidateResult,
    EvaluationRecord,
    EvaluationResult,
    PairwiseJudgement,
    PrimaryResult,
    Repro,
    Similarity,
    Stability,
    TrafficEvent,
)

pytestmark = pytest.mark.timeout(60)


def text(content: str | None, **message) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content, **message},
                         "finish_reason": "stop"}]}


def tool(name: str, arguments: str, call_id: str = "call_1") -> dict:
    return text(None, tool_calls=[{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}])


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
    """Answers shadow calls from a script per model key (the judge's and stability's upstream)."""

    def __init__(self, answers: dict[str, list[dict | None]] | list[dict | None]):
        self.answers = answers if isinstance(answers, dict) else {"*": list(answers)}
        self.bodies: list[dict] = []
        self.models: list[str] = []

    async def call(self, route, model_key, body, checks=None):
        self.bodies.append(body)
        self.models.append(model_key)
        script = self.answers.get(model_key, self.answers.get("*"))
        response = script.pop(0)
        verdict = COMPLETED if response is not None else failed("provider_5xx")
        return ShadowCall(model_key, verdict, response=response, status=200 if response else 500)


class RuleJudge:
    """A judge model that answers every pairwise prompt by a rule on the two answers it is shown."""

    def __init__(self, rule):
        self.rule = rule  # (answer A's content, answer B's content) -> "A" | "B" | "tie" | raw reply text
        self.calls = 0

    async def call(self, route, model_key, body, checks=None):
        self.calls += 1
        user = body["messages"][1]["content"]
        m = re.match(r"Conversation:\n.*\n\nAnswer A:\n(.*)\n\nAnswer B:\n(.*)\Z", user, re.DOTALL)
        a, b = (json.loads(m.group(k))["content"] for k in (1, 2))
        out = self.rule(a, b)
        content = out if out not in ("A", "B", "tie") else json.dumps({"winner": out, "reason": "rule"})
        return ShadowCall(model_key, COMPLETED, response=text(content), status=200)


def context(candidate: dict | None, verdict=COMPLETED, live: dict | None = None, again: dict | None = None,
            caller=None, request: dict | None = None, view: dict | None = None) -> EvalContext:
    caller = caller or ScriptedCaller([])
    request = request or {"model": "r", "messages": [{"role": "user", "content": "hi"}]}
    event = TrafficEvent(request_id="rid-1", ts=time.time(), route="r", segment="chat", request=request,
                         primary=PrimaryResult(model="s", status=200, body=live, latency_s=0.1, outcome="completed"),
                         config_version="v")
    return EvalContext(config=CONFIG, route="r", route_cfg=CONFIG.routes["r"], event=event, request=request,
                       view=request if view is None else view, live=live, candidate=ShadowCall("c", verdict, response=candidate),
                       stable_again=ShadowCall("s", COMPLETED, response=again) if again is not None else None,
                       caller=caller, stable_side=StableSide(caller), embedder=local_embedder())


def run(coro):
    return asyncio.run(coro)


def test_verifiers_reports_the_shared_verdict():
    ev = VerifiersEvaluator()
    ok = run(ev.evaluate(context(text("x"))))
    assert (ok.passed, ok.score) == (True, 1.0)
    bad = run(ev.evaluate(context(text("x"), verdict=failed("invalid_json", "not JSON"))))
    assert bad.passed is False and bad.detail.startswith("invalid_json")
    assert not ev.selected(context(None, verdict=failed("rate_limited")))


def test_agreement_is_similarity_against_the_noise_floor():
    ctx = context(text("Paris is the capital of France."), live=text("The capital of France is Paris."),
                  again=text("I like green apples and long walks."))
    result = run(AgreementEvaluator().evaluate(ctx))
    sim = run(measure(ctx)).similarity
    assert sim.candidate_vs_stable > 0.8 > sim.stable_vs_stable  # a paraphrase agrees; an unrelated answer not
    assert result.passed is True and result.score == sim.candidate_vs_stable
    assert run(measure(ctx)).agreement == Agreement(candidate_vs_stable=True, stable_vs_stable=False)
    assert run(measure(context(text("a"), live=text("a")))).agreement.stable_vs_stable is None
    # structural kinds: JSON by leaves (one wrong field of two costs half), tool calls by name, refusal 0
    json_request = {"model": "r", "messages": [], "response_format": {"type": "json_object"}}
    half = run(measure(context(text('{"a": 1, "b": 2}'), live=text('{"b": 2, "a": 3}'), request=json_request)))
    assert half.similarity.candidate_vs_stable == 0.5 and half.agreement.candidate_vs_stable is False
    other_tool = run(measure(context(tool("search", "{}"), live=tool("lookup", "{}"))))
    assert other_tool.similarity.candidate_vs_stable == 0.0
    refused = run(measure(context(text(None, refusal="I can't help."), live=text("Sure, here it is."))))
    assert refused.similarity.candidate_vs_stable == 0.0


def test_agreement_threshold_is_configurable():
    cfg = parse_config({**CONFIG.model_dump(), "routes": {"r": {"stable": "s", "candidate": "c",
                                                                 "shadow": {"similarity": {"agree_at": 0.99}}}}})
    ctx = context(text("France's capital city is Paris."), live=text("The capital of France is Paris."))
    ctx.route_cfg = cfg.routes["r"]
    m = run(measure(ctx))
    assert 0.8 < m.similarity.candidate_vs_stable < 0.99 and m.agreement.candidate_vs_stable is False


@pytest.mark.parametrize("content, problem", [
    ("not json at all", "not JSON"),
    ('{"winner": "C", "reason": "no such answer"}', "schema"),
    ('{"winner": "A"}', "schema"),
    ('{"winner": "A", "reason": "ok", "extra": 1}', "schema"),
    ('["A"]', "schema"),
    ("", "empty"),
])
def test_malformed_judge_answer_is_an_error_never_a_win(content, problem):
    judge = RuleJudge(lambda a, b: content)
    ctx = context(text("x"), live=text("y"), caller=judge)
    result = run(JudgeEvaluator().evaluate(ctx))
    assert result.passed is None and result.score is None
    assert "malformed judge answer" in result.detail and problem in result.detail
    assert ctx.extra["judge"].record() == PairwiseJudgement(result=None, noise=None)
    # with a stable-again answer, its judging failed too: counted as the noise floor's error in the report
    ctx = context(text("x"), live=text("y"), again=text("z"), caller=judge)
    run(JudgeEvaluator().evaluate(ctx))
    record = ctx.extra["judge"].record()
    assert record == PairwiseJudgement(result=None, noise=None, noise_failed=True)
    from service.judge.quality import Quality
    from service.records import EvaluationResult
    from tests.judge_traffic import evaluation
    quality = Quality()
    quality.add(evaluation("chat", True).model_copy(update={"judge": record, "evaluations": [
        EvaluationResult(name="judge", version="2", passed=None, detail="malformed judge answer")]}))
    judged = quality.summary()["judge"]
    assert judged["candidate"]["error"] == 1 and judged["noise_floor"]["error"] == 1


def right_wins(a: str, b: str) -> str:
    return "A" if "right" in a and "right" not in b else "B" if "right" in b and "right" not in a else "tie"


def test_pairwise_judge_in_both_orders_with_its_noise_floor():
    judge = RuleJudge(right_wins)
    ctx = context(text("the right answer"), live=text("a wrong answer"), again=text("another wrong answer"),
                  caller=judge)
    result = run(JudgeEvaluator().evaluate(ctx))
    assert judge.calls == 4  # candidate and stable-again, each in both orders
    assert ctx.extra["judge"].record() == PairwiseJudgement(result="win", noise="tie")
    assert (result.passed, result.score) == (True, 1.0)
    ctx = context(text("a wrong answer"), live=text("the right answer"), caller=RuleJudge(right_wins))
    result = run(JudgeEvaluator().evaluate(ctx))
    assert ctx.extra["judge"].record() == PairwiseJudgement(result="loss", noise=None)
    assert (result.passed, result.score) == (False, 0.0)


def test_a_preference_that_flips_with_the_order_is_a_tie():
    first_position = RuleJudge(lambda a, b: "A")  # always prefers whatever it sees first
    ctx = context(text("the right answer"), live=text("a wrong answer"), again=text("x"), caller=first_position)
    result = run(JudgeEvaluator().evaluate(ctx))
    assert ctx.extra["judge"].record() == PairwiseJudgement(result="tie", noise="tie")
    assert result.score == 0.5


def test_judge_request_and_failed_calls():
    caller = ScriptedCaller([None, None])
    result = run(JudgeEvaluator().evaluate(context(tool("lookup", "{}"), live=text("y"), caller=caller)))
    assert result.passed is None and "judge call failed" in result.detail
    body = caller.bodies[0]
    assert body["response_format"]["json_schema"]["schema"] == VERDICT_SCHEMA and body["temperature"] == 0
    assert "Rubric:" in body["messages"][0]["content"] and "lookup" in body["messages"][1]["content"]
    with pytest.raises(ValueError, match="no answer"):
        parse_verdict(None)
    long = pairwise_request("r", {"messages": [{"role": "user", "content": "x" * 100_000}]}, None, None)
    assert long["messages"][1]["content"].count("characters cut") == 1
    params = repro_params(CONFIG.routes["r"].shadow.judge)
    assert params["judge_model"] == "j" and params["judge_prompt_version"] == PROMPT_VERSION
    assert params["judge_params"] == {"temperature": 0} and len(params["judge_rubric_sha256"]) == 12


def test_evaluators_read_a_responses_request_through_its_chat_view():
    request = {"model": "r", "instructions": "Answer in JSON.", "input": "Capital of France?",
               "text": {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}}}
    caller = ScriptedCaller([None, None])
    ctx = context(text("Paris"), live=text('{"city": "Paris"}'), caller=caller, request=request,
                  view=RESPONSES.view(request))
    run(JudgeEvaluator().evaluate(ctx))
    shown = caller.bodies[0]["messages"][1]["content"]
    assert "Capital of France?" in shown and "Answer in JSON." in shown and "json_schema" in shown
    # `text.format` asked for JSON: an answer that is not JSON scores 0 against one that is
    assert run(measure(ctx)).similarity.candidate_vs_stable == 0.0


def test_stability_is_mean_pairwise_similarity_for_both_models():
    paraphrases = [text("The capital of France is Paris."), text("Paris is the capital of France."),
                   text("France's capital city is Paris.")]
    scattered = [text("I like green apples."), text("The train leaves at noon.")]
    caller = ScriptedCaller({"c": paraphrases[1:], "s": scattered[1:]})
    ctx = context(paraphrases[0], live=scattered[0], again=text("Quantum physics is hard."), caller=caller)
    result = run(StabilityEvaluator().evaluate(ctx))
    stab: Stability = ctx.extra["stability"]
    assert caller.models.count("c") == 2 and caller.models.count("s") == 1  # live and stable-again count
    assert stab.candidate > 0.8 > stab.stable
    assert result.passed is True and result.score == stab.candidate
    caller = ScriptedCaller({"c": [None, None], "s": [None, None]})
    assert run(StabilityEvaluator().evaluate(context(text("a"), live=text("b"), caller=caller))).passed is None


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


def test_quality_summary_per_segment():
    from rich.console import Console

    from service.judge.quality import quality_table
    from service.judge.shadow_report import shadow_table

    stats = ShadowStats(route="r")
    for i in range(40):
        rec = record(i, segment="tools" if i % 2 else "chat")
        rec.similarity = Similarity(candidate_vs_stable=0.6 if i % 2 else 0.9, stable_vs_stable=0.9)
        rec.judge = PairwiseJudgement(result="loss" if i % 4 == 1 else "tie", noise="tie")
        if i % 10 == 0:
            rec.stability = Stability(candidate=0.8, stable=0.85)
        rec.evaluations = [EvaluationResult(name="judge", version="2", passed=True, score=0.5)]
        stats.add(rec)
    broken = record(99, segment="chat")
    broken.evaluations = [EvaluationResult(name="judge", version="2", passed=None, detail="malformed judge answer")]
    stats.add(broken)
    s = stats.summary()
    tools, chat = s["segments"]["tools"]["quality"], s["segments"]["chat"]["quality"]
    assert tools["similarity"]["gap"]["value"] == pytest.approx(-0.3) and tools["similarity"]["gap"]["n"] == 20
    assert chat["similarity"]["gap"]["value"] == pytest.approx(0.0)
    assert tools["judge"]["candidate"]["loss"] == 10 and tools["judge"]["candidate"]["tie"] == 10
    assert tools["judge"]["candidate"]["preference"]["value"] == pytest.approx(-0.5)
    assert tools["judge"]["gap"]["interval"][1] < 0
    assert chat["judge"]["candidate"]["error"] == 1 and chat["judge"]["gap"]["value"] == 0.0
    assert s["segments"]["chat"]["quality"]["stability"]["gap"]["value"] == pytest.approx(-0.05)
    assert s["segments"]["overall"]["quality"]["similarity"]["candidate_vs_stable"]["n"] == 40
    console = Console(record=True, width=300)
    console.print(shadow_table(s))
    console.print(quality_table(s))
    out = console.export_text()
    assert "−0.300" in out or "-0.300" in out
    assert "10/10/10" not in out and "0/10/10" in out  # tools: win/tie/loss


def test_quality_intervals_stay_in_the_range_of_their_values():
    """A stability or similarity near 1 over few samples: its display interval never passes 1 (the
    report showed stability [0.762, 1.030])."""
    stats = ShadowStats(route="r")
    for i, value in enumerate((1.0, 1.0, 0.6, 1.0, 0.98, 1.0, 0.6, 1.0)):
        rec = record(i, segment="chat")
        rec.similarity = Similarity(candidate_vs_stable=value, stable_vs_stable=1.0 - value)
        rec.stability = Stability(candidate=value, stable=1.0 - value)
        stats.add(rec)
    quality = stats.summary()["segments"]["chat"]["quality"]
    for name, low, high in (("candidate", 0.0, 1.0), ("stable", 0.0, 1.0), ("gap", -1.0, 1.0)):
        lo, hi = quality["stability"][name]["interval"]
        assert low <= lo <= hi <= high, (name, lo, hi)
    lo, hi = quality["similarity"]["noise_floor"]["interval"]
    assert 0.0 <= lo <= hi <= 1.0
