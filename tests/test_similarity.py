"""collectors/similarity: answer similarity by kind, with real embeddings.

The local backend is the real WordLlama model from its wheel; the endpoint backend is exercised
over real HTTP, against the simulator's /v1/embeddings (protocol: order, auth, errors) and
against a small aiohttp server in this file that computes embeddings with the local model (so
that semantics survive the HTTP path).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from collectors.similarity import Answer, EmbeddingError, EndpointEmbedder, LocalEmbedder, ToolCall, repro, score
from collectors.similarity import local as local_mod
from collectors.similarity.base import Embedder
from tests.fixtures.servers import free_port, sim_config

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]

PARAPHRASES = [
    ("The capital of France is Paris, which is also its largest city.",
     "Paris is France's capital and its biggest city."),
    ("To reverse a list in Python, call list.reverse() in place or slice it with [::-1] for a copy.",
     "In Python, my_list.reverse() reverses the list in place, while my_list[::-1] returns a reversed copy."),
    ("I'm sorry your order arrived damaged. I have issued a full refund, which should appear within five business days.",
     "Apologies that the package came broken. A complete refund is on its way and will show up in about five working days."),
    ("You can reset your password by clicking 'Forgot password' on the login page and following the emailed link.",
     "To change a forgotten password, choose 'Forgot password' on the sign-in screen and open the reset link sent to your email."),
    ("Regular exercise strengthens the heart, improves mood and lowers the risk of chronic disease.",
     "Working out regularly is good for your heart and your mood, and reduces the chance of chronic illness."),
]
UNRELATED = [(PARAPHRASES[i][0], PARAPHRASES[(i + 2) % len(PARAPHRASES)][1]) for i in range(len(PARAPHRASES))]


def text(s: str) -> Answer:
    return Answer("text", s)


@pytest.fixture(scope="module")
def local() -> LocalEmbedder:
    return LocalEmbedder().load()


class Recording:
    """A real embedder that also keeps the texts of each embed call (to count calls)."""

    def __init__(self, inner: Embedder):
        self.inner = inner
        self.backend = inner.backend
        self.calls: list[list[str]] = []

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def version(self) -> str:
        return self.inner.version

    async def embed(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        return await self.inner.embed(texts)


# ---- the local model ------------------------------------------------------------------------------

def test_local_embeddings_are_normalised_deterministic_and_zero_for_empty(local):
    texts = ["Paris is the capital of France.", "", "Paris is the capital of France.", "ok"]
    v = local.embed_sync(texts)
    assert v.shape == (4, 256) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v[[0, 2, 3]], axis=1), 1.0, atol=1e-5)
    assert not v[1].any()
    assert np.array_equal(v[0], v[2])
    assert isinstance(local, Embedder)
    assert repro(local) == {"backend": "local", "model": "wordllama/l2_supercat_256", "version": local.version}
    assert local.version.startswith("0.4")


def test_a_lone_surrogate_is_embedded_as_the_text_around_it(local):
    """JSON may carry half an emoji ("\ud83d", an answer cut at a cap): the tokenizer refuses it."""
    cut, whole = local.embed_sync(["The answer is 42 \ud83d", "The answer is 42 ?"])
    assert np.allclose(cut, whole)


def test_paraphrases_score_high_unrelated_low(local):
    para = score.similarities_with([(text(a), text(b)) for a, b in PARAPHRASES], local.embed_sync)
    unrelated = score.similarities_with([(text(a), text(b)) for a, b in UNRELATED], local.embed_sync)
    assert min(para) >= 0.5, para
    assert max(unrelated) <= 0.3, unrelated
    assert np.mean(para) - np.mean(unrelated) >= 0.5
    assert all(0.0 <= s <= 1.0 for s in para + unrelated)
    assert score.similarity(text("Same words."), text("Same words.")) == 1.0  # no embedding needed


def test_async_embed_matches_sync_inline_or_on_a_thread(local):
    texts = [a for a, _ in PARAPHRASES]
    expected = local.embed_sync(texts)

    class Where(LocalEmbedder):
        threads: list[int] = []

        def embed_sync(self, texts):
            self.threads.append(threading.get_ident())
            return super().embed_sync(texts)

    async def main():
        small = await Where().embed(texts)                     # a record's worth: on the loop's thread
        big = await asyncio.gather(*(Where(offload_chars=100).embed(texts) for _ in range(3)))
        return small, big

    small, big = asyncio.run(main())
    assert np.array_equal(small, expected) and all(np.array_equal(v, expected) for v in big)
    assert Where.threads[0] == threading.get_ident()
    assert all(t != threading.get_ident() for t in Where.threads[1:])


def test_long_answers_are_cut_at_max_chars(local):
    long = " ".join(a for a, _ in PARAPHRASES) * 50
    assert len(long) > 20_000
    cut = LocalEmbedder(max_chars=500)
    assert np.allclose(cut.embed_sync([long]), local.embed_sync([long[:500]]))
    assert np.allclose(np.linalg.norm(local.embed_sync([long]), axis=1), 1.0, atol=1e-5)


def test_threads_share_one_model(local):
    texts = [b for _, b in PARAPHRASES]
    expected = local.embed_sync(texts)
    results, models = [], []

    def work():
        models.append(local_mod.model())
        results.append(LocalEmbedder().embed_sync(texts))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is models[0] for m in models)
    assert all(np.array_equal(r, expected) for r in results)


def test_local_model_loads_offline_without_touching_home_or_logging(tmp_path):
    """A fresh process with an empty HOME and the hub offline: the model loads from the wheel's
    files, nothing is written to HOME, `wordllama` itself is never imported (its import would
    configure the root logger), and nothing is printed."""
    home = tmp_path / "home"
    home.mkdir()
    code = (
        "import logging, sys\n"
        "from collectors.similarity import LocalEmbedder\n"
        "v = LocalEmbedder().embed_sync(['hello there'])\n"
        "assert v.shape == (1, 256)\n"
        "assert 'wordllama' not in sys.modules\n"
        "assert not logging.getLogger().handlers\n"
    )
    env = {**os.environ, "HOME": str(home), "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(home / ".cache"),
           "HF_HOME": str(home / "hf")}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and r.stderr == ""
    assert list(home.iterdir()) == []


# ---- kinds ----------------------------------------------------------------------------------------

def test_json_one_wrong_field_costs_one_field():
    live = Answer("json", json.dumps({"name": "Ada", "age": 36, "city": "London", "lang": "en"}))
    cand = Answer("json", json.dumps({"lang": "en", "city": "Paris", "age": 36.0, "name": "Ada"}))
    assert score.similarity(live, cand) == 0.75                       # key order and 36 vs 36.0 don't matter
    assert score.similarity(live, live) == 1.0
    missing = Answer("json", json.dumps({"name": "Ada", "age": 36, "city": "London"}))
    assert score.similarity(live, missing) == 0.75                    # a key on one side only is a mismatched leaf
    extra = Answer("json", json.dumps({"name": "Ada", "age": 36, "city": "London", "lang": "en", "x": 1}))
    assert score.similarity(live, extra) == 0.8
    fenced = Answer("json", "```json\n" + live.text + "\n```")
    assert score.similarity(live, fenced) == 1.0


def test_json_structure_details():
    assert score.json_similarity({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}}) == 0.5
    assert score.json_similarity({"a": {"b": 1, "c": 2}}, {"a": 5}) == 0.0       # object vs scalar: all mismatched
    assert score.json_similarity([1, 2, 3], [1, 2, 4]) == pytest.approx(2 / 3)   # arrays position by position
    assert score.json_similarity([1, 2, 3], [1, 2]) == pytest.approx(2 / 3)
    assert score.json_similarity({"x": True}, {"x": 1}) == 0.0                   # true is not 1
    assert score.json_similarity({"x": " café "}, {"x": "cafe\u0301"}) == 1.0   # NFC, stripped
    assert score.json_similarity({}, {}) == 1.0 and score.json_similarity({}, []) == 0.0
    assert score.json_similarity(None, None) == 1.0 and score.json_similarity({"a": None}, {"a": 0}) == 0.0


def test_json_that_does_not_parse(local):
    good = Answer("json", '{"a": 1}')
    assert score.similarity(good, Answer("json", "{not json")) == 0.0
    # neither parses: both are compared as text, by embeddings
    a, b = Answer("json", PARAPHRASES[0][0]), Answer("json", PARAPHRASES[0][1])
    assert score.texts_to_embed([(a, b)]) == [a.text, b.text]
    assert score.similarities_with([(a, b)], local.embed_sync)[0] >= 0.5


def test_tool_calls():
    weather = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert score.tool_calls_similarity([weather], [ToolCall("get_forecast", weather.arguments)]) == 0.0
    reordered = ToolCall("get_weather", '{"unit": "celsius", "city": "Paris"}')
    assert score.tool_calls_similarity([weather], [reordered]) == 1.0
    other_city = ToolCall("get_weather", '{"city": "Rome", "unit": "celsius"}')
    assert score.tool_calls_similarity([weather], [other_city]) == 0.5
    assert score.tool_calls_similarity([weather], [ToolCall("get_weather", "{broken")]) == 0.0
    assert score.tool_calls_similarity([ToolCall("ping", "")], [ToolCall("ping", "{}")]) == 1.0
    # parallel calls in another order are paired by name
    time_ = ToolCall("get_time", '{"tz": "CET"}')
    assert score.tool_calls_similarity([weather, time_], [time_, weather]) == 1.0
    assert score.tool_calls_similarity([weather, time_], [weather]) == 0.0     # another set of names
    a = Answer("tool_calls", tool_calls=(weather,))
    assert score.similarity(a, Answer("tool_calls", tool_calls=(ToolCall("get_forecast", weather.arguments),))) == 0.0


def test_refusals_empties_and_kind_mismatches():
    refusal = Answer("refusal", "I can't help with that.")
    assert score.similarity(refusal, text("Sure, here is how.")) == 0.0
    assert score.similarity(text("Sure, here is how."), refusal) == 0.0
    assert score.similarity(refusal, Answer("refusal", "Sorry, I cannot do this.")) == 1.0
    assert score.similarity(text(""), text("")) == 1.0
    assert score.similarity(text(""), text("Paris.")) == 0.0
    assert score.similarity(Answer("json", ""), Answer("json", "")) == 1.0
    assert score.similarity(text("call it"), Answer("tool_calls", tool_calls=(ToolCall("f", "{}"),))) == 0.0
    assert score.texts_to_embed([(refusal, text("x")), (text(""), text("y"))]) == []


def test_answer_of_parses_openai_messages():
    assert score.answer_of({"role": "assistant", "content": "  Paris.  "}) == Answer("text", "Paris.")
    assert score.answer_of({"content": '{"a": 1}'}, wants_json=True) == Answer("json", '{"a": 1}')
    parts = [{"type": "text", "text": "Par"}, {"type": "text", "text": "is"}]
    assert score.answer_of({"content": parts}).text == "Paris"
    assert score.answer_of({"content": None, "refusal": "I can't."}) == Answer("refusal", "I can't.")
    assert score.answer_of({"content": None}) == Answer("text", "")
    calls = score.answer_of({"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]})
    assert calls == Answer("tool_calls", tool_calls=(ToolCall("get_weather", '{"city":"Paris"}'),))
    legacy = score.answer_of({"content": None, "function_call": {"name": "f", "arguments": {"x": 1}}})
    assert legacy.tool_calls == (ToolCall("f", '{"x": 1}'),)
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
    assert score.answer_of_completion(completion) == Answer("text", "hi")
    assert score.answer_of_completion(None) is None and score.answer_of_completion({"choices": []}) is None
    assert score.wants_json({"response_format": {"type": "json_object"}})
    assert score.wants_json({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}})
    assert not score.wants_json({"response_format": {"type": "text"}}) and not score.wants_json({})


# ---- batching -------------------------------------------------------------------------------------

def test_one_record_is_one_embed_call_with_the_live_answer_once(local):
    live, cand = text(PARAPHRASES[0][0]), text(PARAPHRASES[0][1])
    again = text("The capital city of France is Paris.")
    rec = Recording(local)
    scores = asyncio.run(score.score_record(live, cand, again, rec))
    assert rec.calls == [[live.text, cand.text, again.text]]
    assert 0.5 <= scores.candidate_vs_stable <= 1.0 and 0.5 <= scores.stable_vs_stable <= 1.0
    assert scores.as_dict().keys() == {"candidate_vs_stable", "stable_vs_stable"}

    rec.calls.clear()  # a missing stable-again answer: no score for it, nothing embedded for it
    scores = asyncio.run(score.score_record(live, cand, None, rec))
    assert rec.calls == [[live.text, cand.text]] and scores.stable_vs_stable is None

    rec.calls.clear()  # nothing textual to compare: no embed call at all
    scores = asyncio.run(score.score_record(live, Answer("refusal", "No."), live, rec))
    assert rec.calls == [] and scores.candidate_vs_stable == 0.0 and scores.stable_vs_stable == 1.0


def test_many_records_one_embed_call(local):
    records = [(text(a), text(b), text(u)) for (a, b), (_, u) in zip(PARAPHRASES, UNRELATED)]
    rec = Recording(local)
    out = asyncio.run(score.score_records(records, rec))
    # one call; each distinct text once (the unrelated answers reuse other records' candidates)
    assert len(rec.calls) == 1 and len(rec.calls[0]) == len(set(rec.calls[0])) == 10
    for r in out:
        assert r.candidate_vs_stable >= 0.5 > 0.3 >= r.stable_vs_stable


def test_stability_is_mean_pairwise_similarity(local):
    same = [text(PARAPHRASES[0][0]), text(PARAPHRASES[0][1]), text("Paris is the capital of France.")]
    wild = [text(PARAPHRASES[0][0]), text(PARAPHRASES[3][1]), text(PARAPHRASES[4][0])]
    rec = Recording(local)
    steady = asyncio.run(score.mean_pairwise_similarity(same, rec))
    assert len(rec.calls) == 1
    assert steady > asyncio.run(score.mean_pairwise_similarity(wild, local)) + 0.3
    assert asyncio.run(score.mean_pairwise_similarity(same[:1], local)) is None


# ---- the endpoint backend -------------------------------------------------------------------------

def test_endpoint_against_the_simulator(servers):
    sim = servers.simulator(sim_config(api_key="sk-sim-secret"))
    base = sim.url + "/v1"
    texts = ["alpha", "beta", "", "alpha"]

    async def main():
        async with EndpointEmbedder(base, "good-model", api_key="sk-sim-secret", max_batch=2) as e:
            v = await e.embed(texts)
            assert e.version == "good-model"
            again = await e.embed(["beta"])
        return v, again

    v, again = asyncio.run(main())
    assert v.shape == (4, 256)
    assert np.allclose(np.linalg.norm(v[[0, 1, 3]], axis=1), 1.0, atol=1e-5) and not v[2].any()
    assert np.allclose(v[0], v[3]) and not np.allclose(v[0], v[1])     # per-text, in input order
    assert np.allclose(again[0], v[1])

    async def wrong_key():
        async with EndpointEmbedder(base, "good-model", api_key="sk-wrong") as e:
            await e.embed(["alpha"])

    with pytest.raises(EmbeddingError, match="HTTP 401") as err:
        asyncio.run(wrong_key())
    assert "sk-wrong" not in str(err.value)

    async def unknown_model():
        async with EndpointEmbedder(base, "no-such-model", api_key="sk-sim-secret") as e:
            await e.embed(["alpha"])

    with pytest.raises(EmbeddingError, match="no-such-model"):
        asyncio.run(unknown_model())


def embeddings_app(local: LocalEmbedder, requests: list[dict]) -> web.Application:
    """A minimal OpenAI-compatible /v1/embeddings served with the local model."""

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        requests.append({"body": body, "auth": request.headers.get("Authorization")})
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        vectors = (await local.embed(inputs)) * 3.0     # not normalised: the client must normalise
        if body.get("encoding_format") == "base64" or request.headers.get("X-B64"):  # some servers answer base64
            data = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in vectors]
        else:
            data = [v.tolist() for v in vectors]
        items = [{"object": "embedding", "index": i, "embedding": d} for i, d in enumerate(data)]
        return web.json_response({"object": "list", "model": "wordllama-served", "data": items[::-1],
                                  "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    return app


def test_endpoint_over_http_keeps_the_semantics(local):
    requests: list[dict] = []

    async def main():
        runner = web.AppRunner(embeddings_app(local, requests))
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            base = f"http://127.0.0.1:{port}/v1"
            async with EndpointEmbedder(base, "team-embedder", api_key="sk-team") as e:
                pairs = [(text(a), text(b)) for a, b in PARAPHRASES + UNRELATED]
                remote_scores = await score.similarities(pairs, e)
                vectors = await e.embed([a for a, _ in PARAPHRASES])
                version = e.version
            async with EndpointEmbedder(base + "/", "team-embedder", headers={"X-B64": "1"}) as e:
                b64 = await e.embed([PARAPHRASES[0][0]])
            return remote_scores, vectors, version, b64
        finally:
            await runner.cleanup()

    remote_scores, vectors, version, b64 = asyncio.run(main())
    local_scores = score.similarities_with([(text(a), text(b)) for a, b in PARAPHRASES + UNRELATED], local.embed_sync)
    assert np.allclose(remote_scores, local_scores, atol=1e-5)
    assert min(remote_scores[:len(PARAPHRASES)]) >= 0.5 and max(remote_scores[len(PARAPHRASES):]) <= 0.3
    assert np.allclose(vectors, local.embed_sync([a for a, _ in PARAPHRASES]), atol=1e-5)
    assert version == "wordllama-served"
    assert np.allclose(b64[0], vectors[0], atol=1e-5)
    assert requests[0]["auth"] == "Bearer sk-team" and requests[-1]["auth"] is None
    assert requests[0]["body"]["model"] == "team-embedder" and requests[0]["body"]["encoding_format"] == "float"


def test_endpoint_unreachable_or_malformed():
    port = free_port()

    async def unreachable():
        async with EndpointEmbedder(f"http://127.0.0.1:{port}/v1", "m", timeout_s=2) as e:
            await e.embed(["x"])

    with pytest.raises(EmbeddingError, match="could not be reached"):
        asyncio.run(unreachable())

    async def short_answer():
        async def handler(request):
            return web.json_response({"data": [{"index": 0, "embedding": [1.0, 0.0]}]})

        app = web.Application()
        app.router.add_post("/v1/embeddings", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        p = free_port()
        await web.TCPSite(runner, "127.0.0.1", p).start()
        try:
            async with EndpointEmbedder(f"http://127.0.0.1:{p}/v1", "m") as e:
                await e.embed(["x", "y"])
        finally:
            await runner.cleanup()

    with pytest.raises(EmbeddingError, match="1 embeddings for 2 inputs"):
        asyncio.run(short_answer())
