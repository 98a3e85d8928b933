"""Shadow workers in process against the real simulator (a subprocess) over the memory bus:
records and metrics, de-duplication, the noise floor, a candidate worse only on tools, the judge
and stability evaluators."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
from prometheus_client import REGISTRY

from collectors.worker import ShadowClient, run_workers
from service.bus.memory import MemoryBus
from service.config import Config, parse_config
from service.judge.shadow_report import ShadowStats
from service.proxy.segments import classify_segment
from service.records import EvaluationRecord, PrimaryResult, TrafficEvent
from service.upstream import make_providers
from tests.fixtures.servers import SIM_MODEL, start_simulator

pytestmark = pytest.mark.timeout(120)

ROUTE = "support-bot"


def sim_model(divergence: float = 0.05, **extra) -> dict:
    m = copy.deepcopy(SIM_MODEL)
    m["divergence"] = divergence
    m.update(extra)
    return m


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shadow-sim")
    models = {
        "good-model": sim_model(0.05),
        "same-model": sim_model(0.05),
        "far-model": sim_model(0.3),
        "tools-bad-model": sim_model(0.05, segments={"tools": {"failures": {"invalid_tool_call": 0.5}}}),
        "judge-model": sim_model(0.0, judge=True),
        "broken-judge": sim_model(0.0, judge=True, failures={"invalid_json": 1.0}),
        "wrong-multi-turn": sim_model(0.05, segments={"multi_turn": {"wrong_content": 0.5}}),
    }
    server = start_simulator(tmp, {"seed": 11, "time_scale": 0.0, "models": models})
    yield server
    server.stop()


def make_config(sim_url: str, candidate_upstream: str, concurrency: int = 1, **shadow) -> Config:
    price_s = {"input_per_mtok": 0.4, "output_per_mtok": 1.6}
    price_c = {"input_per_mtok": 0.2, "output_per_mtok": 0.8}
    return parse_config({
        "providers": {"sim": {"base_url": sim_url + "/v1", "timeout_s": 5, "max_retries": 2}},
        "models": {
            "stable-m": {"provider": "sim", "name": "good-model", "price": price_s},
            "candidate-m": {"provider": "sim", "name": candidate_upstream, "price": price_c},
            "judge-m": {"provider": "sim", "name": "judge-model"},
            "broken-judge-m": {"provider": "sim", "name": "broken-judge"},
            "embed-m": {"provider": "sim", "name": "good-model"},
        },
        "routes": {ROUTE: {"stable": "stable-m", "candidate": "candidate-m",
                           "shadow": {"sample_rate": 1.0, "noise_floor": True, "stability": {"sample_rate": 0.0},
                                      **shadow}},
                   "no-candidate": {"stable": "stable-m"}},
        "collect": {"concurrency": concurrency},
    })


TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer"}, "detail": {"type": "string"}},
    "required": ["order_id"]}}}]


def bodies(n: int, kinds=("chat", "json", "tools"), tag: str = "q") -> list[dict]:
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        body: dict = {"model": ROUTE, "messages": [{"role": "user", "content": f"{tag} {i}: where is my order?"}]}
        if kind == "json":
            body["response_format"] = {"type": "json_object"}
        elif kind == "tools":
            body["tools"] = TOOLS
        if i % 4 == 0:
            body["stream"] = True  # the worker must not stream
            body["stream_options"] = {"include_usage": True}
        out.append(body)
    return out


async def live_traffic(config: Config, requests: list[dict], tag: str) -> list[TrafficEvent]:
    """What the proxy does for a sampled request: the stable model answers live; completed ones are shadowed."""
    providers = make_providers(config)
    client = ShadowClient(config, providers)
    rc = config.routes[ROUTE]
    events = []
    try:
        for i, body in enumerate(requests):
            live = await client.call(ROUTE, rc.stable, body)
            if not live.verdict.ok:
                continue
            events.append(TrafficEvent(
                request_id=f"{tag}-{i}", ts=time.time(), route=ROUTE,
                segment=classify_segment(body, None, rc.task_types), request=body,
                primary=PrimaryResult(model=rc.stable, status=200, body=live.response,
                                      latency_s=live.latency_s or 0.0,  # None: measured on a busy loop
                                      usage=live.usage, outcome="completed"),
                config_version=config.version()))
    finally:
        for p in providers.values():
            await p.close()
    return events


async def shadow(config: Config, events: list, expect: int | None = None, timeout_s: float = 60.0,
                 tracing=None) -> list[EvaluationRecord]:
    """Run the workers on the events; return the evaluation records published."""
    bus = MemoryBus()
    bus.subscribe(["traffic"], group="modelcanary-shadow")  # the workers' group queue exists before publishing
    out = bus.subscribe(["evaluations"], group=None)
    providers = make_providers(config)
    stop = asyncio.Event()
    task = asyncio.create_task(run_workers(config, bus, providers, tracing, stop))
    for e in events:
        bus.publish("traffic", e)
    expect = len(events) if expect is None else expect
    records: list[EvaluationRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(records) < expect and time.monotonic() < deadline:
        records += await out.get_batch(1000, 0.2)
    await asyncio.sleep(0.2)
    records += await out.get_batch(1000, 0.01)
    stop.set()
    await asyncio.wait_for(task, 15)
    for p in providers.values():
        await p.close()
    return records


def value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_records_metrics_dedup_and_skips(sim):
    config = make_config(sim.url, "same-model", concurrency=8)
    before = {
        "requests": value("modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m", outcome="completed"),
        "again": value("modelcanary_shadow_requests_total", route=ROUTE, model="stable-m", outcome="completed"),
        "similarity": value("modelcanary_shadow_similarity_count", route=ROUTE, model="candidate-m",
                            comparison="candidate")
        + value("modelcanary_shadow_similarity_count", route=ROUTE, model="stable-m", comparison="noise_floor"),
        "agree": sum(value("modelcanary_shadow_agreement_total", route=ROUTE, model=m, comparison=c, result=r)
                     for m, c in (("candidate-m", "candidate"), ("stable-m", "noise_floor"))
                     for r in ("agree", "disagree")),
        "verifiers": value("modelcanary_shadow_evaluations_total", route=ROUTE, model="candidate-m",
                           evaluator="verifiers", result="pass"),
        "dropped": value("modelcanary_shadow_dropped_total", route="no-candidate", reason="error"),
    }

    async def go():
        events = await live_traffic(config, bodies(30), "basic")
        other = events[0].model_copy(update={"route": "no-candidate", "request_id": "x-1"})
        unknown = events[0].model_copy(update={"route": "nowhere", "request_id": "x-2"})
        # every event twice (redelivery), plus two that must be skipped
        return events, await shadow(config, events + [other, unknown] + events, expect=len(events))

    events, records = asyncio.run(go())
    assert len(events) == 30
    ids = [r.request_id for r in records]
    assert sorted(ids) == sorted(e.request_id for e in events)  # exactly one record each
    by_id = {e.request_id: e for e in events}
    for r in records:
        e = by_id[r.request_id]
        assert r.route == ROUTE and r.segment == e.segment
        assert (r.stable_model, r.candidate_model) == ("stable-m", "candidate-m")
        assert r.candidate.outcome == "completed"
        assert r.candidate.latency_s is None or r.candidate.latency_s > 0  # None: measured on a saturated loop
        usage = r.candidate.usage
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert r.candidate.cost_usd == pytest.approx((usage["prompt_tokens"] * 0.2 + usage["completion_tokens"] * 0.8) / 1e6)
        # the latency pair's stable side: the stable asked again, on the candidate's path and at its time
        assert r.stable_latency_s == r.stable_again.latency_s and r.stable_latency_s != e.primary.latency_s
        assert r.stable_cost_usd == pytest.approx((e.primary.usage["prompt_tokens"] * 0.4
                                                   + e.primary.usage["completion_tokens"] * 1.6) / 1e6)
        sim, agree = r.similarity, r.agreement
        assert 0.0 <= sim.candidate_vs_stable <= 1.0 and 0.0 <= sim.stable_vs_stable <= 1.0
        assert agree.candidate_vs_stable == (sim.candidate_vs_stable >= 0.8)  # agree_at, the default
        assert agree.stable_vs_stable == (sim.stable_vs_stable >= 0.8)
        assert {ev.name for ev in r.evaluations} == {"verifiers", "agreement"}
        assert r.repro.modelcanary_version and r.repro.config_version == config.version()
        assert r.repro.evaluator_versions == {"verifiers": "1", "agreement": "2"}
        assert r.repro.params["candidate_upstream"] == "same-model"
        assert r.repro.params["similarity"]["backend"] == "local" and r.repro.params["similarity"]["agree_at"] == 0.8
        assert r.judge.result is None and r.stability.candidate is None  # not configured
    segments = {r.segment for r in records}
    assert segments == {"chat", "json", "tools"}
    after_requests = value("modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m", outcome="completed")
    assert after_requests - before["requests"] == 30
    again = value("modelcanary_shadow_requests_total", route=ROUTE, model="stable-m", outcome="completed")
    assert again - before["again"] == 30  # the noise floor: the stable model asked again, once each
    agree = sum(value("modelcanary_shadow_agreement_total", route=ROUTE, model=m, comparison=c, result=r)
                for m, c in (("candidate-m", "candidate"), ("stable-m", "noise_floor")) for r in ("agree", "disagree"))
    assert agree - before["agree"] == 60
    similarity = value("modelcanary_shadow_similarity_count", route=ROUTE, model="candidate-m", comparison="candidate") \
        + value("modelcanary_shadow_similarity_count", route=ROUTE, model="stable-m", comparison="noise_floor")
    assert similarity - before["similarity"] == 60
    assert value("modelcanary_shadow_evaluations_total", route=ROUTE, model="candidate-m", evaluator="verifiers",
                 result="pass") - before["verifiers"] == 30
    assert value("modelcanary_shadow_dropped_total", route="no-candidate", reason="error") - before["dropped"] == 1
    assert value("modelcanary_shadow_dropped_total", route="nowhere", reason="error") >= 1


def test_a_latency_measured_while_the_worker_loop_is_busy_is_not_recorded():
    from collectors.worker import LoopLag

    async def go():
        lag = LoopLag()
        mark = lag.start()
        await asyncio.sleep(0.02)  # an idle loop: a call of 0.5 s is measured (a small lag is tolerated)
        idle = lag.stop(0.5, mark)
        stopped = lag._ticker is None  # nothing measured: the timer does not run
        mark = lag.start()
        time.sleep(0.3)  # the loop busy with other work (scoring a backlog, say) for 300 ms
        busy = lag.stop(0.35, mark)  # the answer is picked up before the late timer runs
        mark = lag.start()
        time.sleep(0.3)
        await asyncio.sleep(0.01)
        lag_while_busy = lag.total - mark
        busy_after_tick = lag.stop(0.35, mark)
        return idle, stopped, busy, busy_after_tick, lag_while_busy

    idle, stopped, busy, busy_after_tick, lag_while_busy = asyncio.run(go())
    assert idle and stopped
    assert not busy and not busy_after_tick and lag_while_busy >= 0.25


def agreement_rows(records: list[EvaluationRecord]) -> dict:
    stats = ShadowStats(route=ROUTE)
    for r in records:
        stats.add(r)
    return stats.summary()


def test_noise_floor_same_divergence_within_and_far_candidate_clearly_below(sim):
    async def go(candidate: str, tag: str):
        config = make_config(sim.url, candidate)
        events = await live_traffic(config, bodies(300, kinds=("chat",), tag=tag), tag)
        return await shadow(config, events)

    same_rows = agreement_rows(asyncio.run(go("same-model", "nf-same")))["segments"]["overall"]
    far_rows = agreement_rows(asyncio.run(go("far-model", "nf-far")))["segments"]["overall"]
    same, far = same_rows["agreement"], far_rows["agreement"]
    # the similarity behind it: paired per request, the same model's gap is nil, the far one's is not
    same_gap = same_rows["quality"]["similarity"]["gap"]
    assert same_gap["n"] >= 290 and same_gap["interval"][0] < 0 < same_gap["interval"][1]
    assert same_rows["quality"]["similarity"]["noise_floor"]["value"] > 0.85  # rephrased, same content
    assert far_rows["quality"]["similarity"]["gap"]["interval"][1] < -0.05
    for a in (same, far):
        assert a["candidate_vs_stable"]["n"] >= 290 and a["noise_floor"]["n"] >= 290
    # divergence 0.05 on both sides: agreement ≈ 0.95², the floor too. "Within the noise floor" in the
    # statistical sense: the 95% interval of (candidate − floor) contains 0, and the two intervals overlap.
    # (A point estimate inside the other side's interval would fail ~17% of seeds by chance alone.)
    floor_lo, floor_hi = same["noise_floor"]["interval"]
    cand_lo, cand_hi = same["candidate_vs_stable"]["interval"]
    assert 0.8 < same["noise_floor"]["value"] < 0.97
    assert cand_lo <= floor_hi and floor_lo <= cand_hi
    assert same["gap"]["interval"][0] < 0 < same["gap"]["interval"][1]
    assert abs(same["gap"]["value"]) < 0.06
    # divergence 0.3: ≈ 0.95 × 0.7, clearly under the floor
    assert far["candidate_vs_stable"]["interval"][1] < far["noise_floor"]["interval"][0]
    assert far["gap"]["interval"][1] < -0.1


def test_candidate_worse_only_on_tools_shows_only_in_the_tools_row(sim):
    async def go():
        config = make_config(sim.url, "tools-bad-model", concurrency=16)
        events = await live_traffic(config, bodies(240, tag="seg"), "seg")
        return await shadow(config, events)

    summary = agreement_rows(asyncio.run(go()))
    rows = summary["segments"]
    assert set(rows) == {"overall", "chat", "json", "tools"}

    def worse_completion(row: dict) -> bool:
        stable, cand = row["completion_rate"]["stable"], row["completion_rate"]["candidate"]
        if stable["value"] is None:  # no replayed stable outcomes: live answers are all completed
            return cand["interval"][1] < 1.0 - 0.05
        return cand["interval"][1] < stable["interval"][0]

    def worse_agreement(row: dict) -> bool:
        return row["agreement"]["gap"]["interval"][1] < 0

    assert worse_completion(rows["tools"]) and worse_agreement(rows["tools"])
    assert rows["tools"]["failure_rate"]["invalid_tool_call"]["candidate"]["value"] > 0.3
    assert len(rows["tools"]["examples"]["invalid_tool_call"]) == 3
    for name in ("chat", "json"):
        assert not worse_completion(rows[name]), name
        assert not worse_agreement(rows[name]), name
        assert rows[name]["failure_rate"] == {}


def test_judge_and_stability_evaluators(sim):
    async def go(judge_model: str, tag: str):
        config = make_config(sim.url, "same-model", concurrency=4, judge={"model": judge_model},
                             stability={"sample_rate": 1.0, "k": 3})
        events = await live_traffic(config, bodies(12, tag=tag), tag)
        return await shadow(config, events)

    before_error = value("modelcanary_shadow_evaluations_total", route=ROUTE, model="candidate-m", evaluator="judge",
                         result="error")
    judge_models = {"candidate": "candidate-m", "noise_floor": "stable-m"}
    before_judged = {c: sum(value("modelcanary_shadow_judge_total", route=ROUTE, model=m, comparison=c, result=v)
                            for v in ("win", "tie", "loss", "error")) for c, m in judge_models.items()}
    good = asyncio.run(go("judge-m", "judge-ok"))
    assert len(good) == 12
    for r in good:
        results = {e.name: e for e in r.evaluations}
        judge = results["judge"]
        assert judge.passed is not None and judge.score in (0.0, 0.5, 1.0), judge
        assert r.judge.result in ("win", "tie", "loss") and r.judge.noise in ("win", "tie", "loss")
        stab = results["stability"]
        assert stab.passed is not None and 0.0 <= stab.score <= 1.0
        assert 0.0 <= r.stability.candidate <= 1.0 and 0.0 <= r.stability.stable <= 1.0
        assert r.repro.params["judge_model"] == "judge-m" and r.repro.params["stability_k"] == 3
        assert r.repro.params["judge_prompt_version"] == "pairwise-1" and r.repro.params["judge_mode"] == "pairwise"
        assert r.repro.evaluator_versions.keys() == {"verifiers", "agreement", "stability", "judge"}
    # the same content in other words: mostly ties (a divergent answer loses)
    assert sum(r.judge.result == "tie" for r in good) >= 8
    for c, m in judge_models.items():
        judged = sum(value("modelcanary_shadow_judge_total", route=ROUTE, model=m, comparison=c, result=v)
                     for v in ("win", "tie", "loss", "error"))
        assert judged - before_judged[c] == 12

    broken = asyncio.run(go("broken-judge-m", "judge-bad"))
    assert len(broken) == 12
    for r in broken:
        judge = next(e for e in r.evaluations if e.name == "judge")
        assert judge.passed is None and judge.score is None
        assert judge.detail.startswith("malformed judge answer")
    after_error = value("modelcanary_shadow_evaluations_total", route=ROUTE, model="candidate-m", evaluator="judge",
                        result="error")
    assert after_error - before_error == 12
    assert all(r.judge.result is None and r.judge.noise is None for r in broken)  # an error, never a win


def multi_turn_bodies(n: int, tag: str) -> list[dict]:
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "my order"}, {"role": "assistant", "content": "which one?"}]
    return [{"model": ROUTE, "messages": [*turns, {"role": "user", "content": f"{tag} {i}: order {i}"}]}
            for i in range(n)]


def test_the_judge_finds_fluent_wrong_answers_that_similarity_misses(sim):
    """A candidate that states one wrong fact in half its multi-turn answers: the embedding similarity
    barely moves (same subjects, same wording), the pairwise judge sees the losses, in that segment only."""
    async def go():
        config = make_config(sim.url, "wrong-multi-turn", concurrency=8, judge={"model": "judge-m"})
        events = await live_traffic(config, multi_turn_bodies(60, "wrong") + bodies(60, kinds=("chat",), tag="ok"),
                                    "wrong")
        return await shadow(config, events)

    rows = agreement_rows(asyncio.run(go()))["segments"]
    multi, chat = rows["multi_turn"]["quality"], rows["chat"]["quality"]
    assert multi["judge"]["candidate"]["loss"] >= 15 and multi["judge"]["gap"]["interval"][1] < 0
    assert chat["judge"]["gap"]["interval"][0] < 0 < chat["judge"]["gap"]["interval"][1] or \
        chat["judge"]["gap"]["value"] == 0
    # half the answers lose: the judge's gap is about −0.5, the similarity gap a few hundredths
    assert multi["judge"]["gap"]["value"] < -0.3 and multi["similarity"]["gap"]["value"] > -0.1


def test_similarity_from_an_embeddings_model(sim):
    """`shadow.similarity.backend: model`: the embeddings come from a `models:` entry's /v1/embeddings."""
    async def go():
        config = make_config(sim.url, "same-model", similarity={"backend": "model", "model": "embed-m"})
        events = await live_traffic(config, bodies(6, kinds=("chat",), tag="embed"), "embed")
        return await shadow(config, events)

    records = asyncio.run(go())
    assert len(records) == 6
    for r in records:
        assert r.repro.params["similarity"]["backend"] == "model"
        assert r.repro.params["similarity"]["model"] == "good-model"
        assert r.similarity.candidate_vs_stable is not None and r.similarity.stable_vs_stable is not None


LIVE_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
LIVE_SPAN = "00f067aa0ba902b7"


def test_shadow_spans_link_to_the_live_call_and_carry_evaluations(sim, monkeypatch):
    from service.config import TracingConfig
    from service.tracing import Tracing
    from tests.test_tracing import Receiver, attrs

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    receiver = Receiver()
    try:
        config = make_config(sim.url, "same-model", concurrency=2)
        tracing = Tracing(TracingConfig(otlp_endpoint=receiver.url))

        async def go():
            events = await live_traffic(config, bodies(3, kinds=("chat",), tag="trace"), "trace")
            events = [e.model_copy(update={"traceparent": f"00-{LIVE_TRACE}-{LIVE_SPAN}-01"}) for e in events]
            return await shadow(config, events, tracing=tracing)

        records = asyncio.run(go())
        tracing.shutdown()
        assert len(records) == 3
        spans = receiver.wait_spans(6)
        shadow_spans = [s for s in spans if attrs(s).get("modelcanary.role") == "shadow"]
        assert len(shadow_spans) == 6  # candidate + stable-again per record
        for span in shadow_spans:
            assert span.trace_id.hex() != LIVE_TRACE  # its own trace, linked to the live one
            assert [(lk.trace_id.hex(), lk.span_id.hex()) for lk in span.links] == [(LIVE_TRACE, LIVE_SPAN)]
        candidate = [s for s in shadow_spans if attrs(s)["gen_ai.request.model"] == "same-model"]
        assert len(candidate) == 3
        for span in candidate:
            names = {attrs(e)["gen_ai.evaluation.name"] for e in span.events if e.name == "gen_ai.evaluation.result"}
            assert names == {"verifiers", "agreement"}
            assert attrs(span)["gen_ai.usage.output_tokens"] > 0
    finally:
        receiver.close()


def test_embedded_mode_serve_runs_the_workers_and_reports_the_shadow_matrix(servers):
    """`modelcanary serve` in memory mode: shadow workers in process, the report carries ShadowStats."""
    import json
    import urllib.request

    import openai

    from tests.fixtures.servers import metric_value, proxy_config, scrape, sim_config

    token = "admin-token-shadow-test"
    sim = servers.simulator(sim_config())
    cfg = proxy_config(sim.url, shadow={"sample_rate": 1.0, "max_per_minute": 100_000},
                       rollout={"mode": "advisory"})
    cfg["control"] = {"interval_s": 0.5, "report_interval_s": 1.0}
    proxy = servers.proxy(cfg, env={"MODELCANARY_ADMIN_TOKEN": token})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)
    n = 24
    for i in range(n):
        kwargs: dict = {"tools": TOOLS} if i % 2 else {}
        client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": f"embedded {i}"}], **kwargs)

    def shadowed() -> float:
        return metric_value(scrape(proxy.url), "modelcanary_shadow_requests_total", route=ROUTE, model="candidate-m")

    deadline = time.monotonic() + 20
    while shadowed() < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert shadowed() == n
    text = scrape(proxy.url)
    assert metric_value(text, "modelcanary_shadow_agreement_total", route=ROUTE, comparison="noise_floor") == n

    def report() -> dict:
        req = urllib.request.Request(proxy.url + f"/admin/rollouts/{ROUTE}/report",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())["report"] or {}

    deadline = time.monotonic() + 20
    shadow_part: dict = {}
    while time.monotonic() < deadline:
        shadow_part = report().get("shadow") or {}
        if shadow_part.get("n") == n:
            break
        time.sleep(0.5)
    assert shadow_part.get("n") == n, shadow_part
    assert set(shadow_part["segments"]) == {"overall", "chat", "tools"}
    overall = shadow_part["segments"]["overall"]
    assert overall["completion_rate"]["candidate"]["n"] == n
    assert overall["agreement"]["noise_floor"]["n"] == n


def test_shadow_calls_use_the_providers_key_only(servers, monkeypatch):
    from tests.fixtures.servers import sim_config

    sim = servers.simulator(sim_config(api_key="sim-secret-key"), name="keyed-sim")
    monkeypatch.setenv("SHADOW_TEST_SIM_KEY", "sim-secret-key")

    def config() -> Config:
        cfg = make_config(sim.url, "new-model").model_dump()
        cfg["providers"]["sim"]["api_key_env"] = "SHADOW_TEST_SIM_KEY"
        return parse_config(cfg)

    async def go(tag: str, unset_before_shadow: bool):
        cfg = config()
        events = await live_traffic(cfg, bodies(6, kinds=("chat",), tag=tag), tag)
        if unset_before_shadow:
            monkeypatch.delenv("SHADOW_TEST_SIM_KEY")
        return events, await shadow(config(), events)

    events, records = asyncio.run(go("keyed", False))
    assert len(records) == 6 and all(r.candidate.outcome == "completed" for r in records)
    events, records = asyncio.run(go("keyless", True))  # no key configured: no credentials at all
    assert len(events) == 6 and len(records) == 6
    assert {(r.candidate.outcome, r.candidate.cause, r.candidate.blame) for r in records} == {
        ("failed", "auth_error", "proxy")}
    assert all(r.evaluations == [] and r.agreement.candidate_vs_stable is None for r in records)


def dollar_a_token(sim_url: str, priced: tuple[str, ...], **shadow) -> Config:
    """make_config with `priced` models at $1 per input token (exact from usage) and none per output one."""
    cfg = make_config(sim_url, "same-model", **shadow).model_dump(exclude_unset=True)
    for key in priced:
        cfg["models"][key]["price"] = {"input_per_mtok": 1e6, "output_per_mtok": 0.0}
    return parse_config(cfg)


def test_every_shadow_call_spends_the_hourly_cap(sim, caplog):
    """Candidate, noise floor, LLM judge and stability calls all count against `max_usd_per_hour`, in
    the worker that makes them: the cap here would hold the candidate and noise-floor calls of every
    request, but the judge's and stability's calls spend it early, and the rest are budget drops."""
    from collectors.worker import ShadowWorker

    n = 8

    def config(cap: float | None) -> Config:
        return dollar_a_token(sim.url, ("stable-m", "candidate-m", "judge-m"), judge={"model": "judge-m"},
                              stability={"sample_rate": 1.0, "k": 3}, max_usd_per_hour=cap)

    async def go():
        events = await live_traffic(config(None), bodies(n, kinds=("chat",), tag="spend"), "spend")
        assert len(events) == n
        base = sum(2.0 * e.primary.usage["prompt_tokens"] for e in events)  # candidate + noise floor, all n
        cfg = config(base + 0.5)
        providers = make_providers(cfg)
        worker = ShadowWorker(cfg, MemoryBus(), providers)
        records, spent = [], [0.0]  # spent[i]: the spend before event i
        try:
            for e in events:
                records.append(await worker.handle(e))
                spent.append(worker.client.spend.spent(ROUTE))
        finally:
            for p in providers.values():
                await p.close()
        return cfg, records, spent

    before = value("modelcanary_shadow_dropped_total", route=ROUTE, reason="budget")
    cfg, records, spent = asyncio.run(go())
    cap = cfg.routes[ROUTE].shadow.max_usd_per_hour
    done = [r for r in records if r is not None]
    drops = value("modelcanary_shadow_dropped_total", route=ROUTE, reason="budget") - before
    assert 1 <= len(done) < n and drops == n - len(done), (len(done), drops)
    for i, r in enumerate(records):  # an evaluation starts only while the last hour's spend is under the cap
        assert (r is not None) == (spent[i] < cap), (i, spent[i], cap)
    for r in done:
        assert {e.name for e in r.evaluations} >= {"judge", "stability"}
    live_calls = sum(r.candidate.cost_usd + r.stable_again.cost_usd for r in done)
    assert spent[-1] > live_calls  # the judge's and stability's calls were counted too
    # a drop is counted, not logged: the noise-floor call refused by the cap is no stray task error
    assert "exception was never retrieved" not in caplog.text, caplog.text[-2000:]


def test_embeddings_calls_spend_the_hourly_cap(sim):
    """`similarity.backend: model` calls an embeddings model for every record: those calls are shadow
    calls too, priced from `models:`. A cap that would hold every candidate and noise-floor call is
    spent early by them, and the rest are budget drops."""
    from collectors.worker import ShadowWorker

    n = 6

    def config(cap: float | None) -> Config:
        return dollar_a_token(sim.url, ("stable-m", "candidate-m", "embed-m"),
                              similarity={"backend": "model", "model": "embed-m"}, max_usd_per_hour=cap)

    async def go():
        events = await live_traffic(config(None), bodies(n, kinds=("chat",), tag="embed-spend"), "embed-spend")
        assert len(events) == n
        base = sum(2.0 * e.primary.usage["prompt_tokens"] for e in events)  # candidate + noise floor, all n
        cfg = config(base + 0.5)
        providers = make_providers(cfg)
        worker = ShadowWorker(cfg, MemoryBus(), providers)
        try:
            records = [await worker.handle(e) for e in events]
        finally:
            await worker.embedders.aclose()
            for p in providers.values():
                await p.close()
        return records, worker.client.spend.spent(ROUTE)

    records, spent = asyncio.run(go())
    done = [r for r in records if r is not None]
    assert 1 <= len(done) < n, len(done)
    assert done[0].similarity.candidate_vs_stable is not None  # the first record's embeddings were made
    calls = sum(r.candidate.cost_usd + r.stable_again.cost_usd for r in done)
    assert spent > calls  # and counted


def test_the_spend_cap_slides_over_the_last_hour():
    from collectors.spend import OverBudget, SpendCap

    cap = SpendCap(make_config("http://127.0.0.1:1", "same-model", max_usd_per_hour=1.0))
    cap.add(ROUTE, 0.6, now=100.0)
    cap.check(ROUTE, now=200.0)
    cap.add(ROUTE, 0.5, now=1900.0)
    with pytest.raises(OverBudget, match="shadow.max_usd_per_hour"):
        cap.check(ROUTE, now=1900.0)
    assert cap.spent(ROUTE, now=3700.0) == pytest.approx(0.5)  # the first call is more than an hour old
    cap.check(ROUTE, now=3700.0)
    cap.check("no-candidate", now=3700.0)  # no cap on that route


def test_the_noise_floor_is_counted_once_per_request_whatever_the_candidates(sim):
    """With two candidates each request has two records but one noise floor (the stable model asked
    again once): its similarity, agreement and judge series count it once."""
    n = 6
    cfg = make_config(sim.url, "same-model", judge={"model": "judge-m"}).model_dump(exclude_unset=True)
    cfg["models"]["other-m"] = {"provider": "sim", "name": "new-model"}
    cfg["routes"][ROUTE] = {**cfg["routes"][ROUTE], "candidate": None, "candidates": ["candidate-m", "other-m"],
                            "rollout": {"scope": "segment"}}
    config = parse_config(cfg)

    def noise() -> tuple[float, float, float]:
        return (value("modelcanary_shadow_similarity_count", route=ROUTE, model="stable-m", comparison="noise_floor"),
                sum(value("modelcanary_shadow_agreement_total", route=ROUTE, model="stable-m", comparison="noise_floor",
                          result=r) for r in ("agree", "disagree")),
                sum(value("modelcanary_shadow_judge_total", route=ROUTE, model="stable-m", comparison="noise_floor",
                          result=r) for r in ("win", "tie", "loss", "error")))

    async def go():
        events = await live_traffic(config, bodies(n, kinds=("chat",), tag="floor"), "floor")
        before = noise()
        records = await shadow(config, events, expect=2 * n)
        return before, records

    before, records = asyncio.run(go())
    assert len(records) == 2 * n and {r.candidate_model for r in records} == {"candidate-m", "other-m"}
    assert tuple(b - a for a, b in zip(before, noise())) == (n, n, n)


def test_the_stable_side_is_asked_once_per_request_whatever_the_candidates(sim, monkeypatch):
    """With two candidates, the judge's noise floor (stable-again against live) and the stable model's
    stability answers are made once per request and shared by both records: the stable model and
    the judge are not paid twice for the same question."""
    n, k = 4, 3
    cfg = make_config(sim.url, "same-model", judge={"model": "judge-m"},
                      stability={"sample_rate": 1.0, "k": k}).model_dump(exclude_unset=True)
    cfg["models"]["other-m"] = {"provider": "sim", "name": "far-model"}
    cfg["routes"][ROUTE] = {**cfg["routes"][ROUTE], "candidate": None, "candidates": ["candidate-m", "other-m"],
                            "rollout": {"scope": "segment"}}
    config = parse_config(cfg)
    asked: list[str] = []
    real_call = ShadowClient.call

    async def counted(self, route, model_key, body, *args, **kwargs):
        asked.append(model_key)
        return await real_call(self, route, model_key, body, *args, **kwargs)

    async def go():
        events = await live_traffic(config, bodies(n, kinds=("chat",), tag="side"), "side")
        monkeypatch.setattr(ShadowClient, "call", counted)
        return await shadow(config, events, expect=2 * n)

    records = asyncio.run(go())
    assert len(records) == 2 * n
    # per request: the stable model again (1) and for stability k - 2 more (live and again count);
    # each candidate 1 + (k - 1); the judge 2 orders for each candidate and 2 for the noise floor
    assert {m: asked.count(m) for m in set(asked)} == {
        "stable-m": n * (1 + k - 2), "candidate-m": n * k, "other-m": n * k, "judge-m": n * 2 * 3}
    by_request: dict[str, list[EvaluationRecord]] = {}
    for r in records:
        by_request.setdefault(r.request_id, []).append(r)
    for pair in by_request.values():
        assert len(pair) == 2
        assert pair[0].judge.noise == pair[1].judge.noise is not None
        assert pair[0].stability.stable == pair[1].stability.stable is not None
