"""Streams whose upstream sends no usage (llama.cpp's server ignores `stream_options.include_usage`):
the proxy estimates their tokens from the text. The estimate stays within the request's cap and
counts the chat template and the tools, and it is never what an identical candidate's measured cost
is judged against (an A/A rollout was rolled back on cost).

`llama_shaped` is a tiny upstream with llama's shape: a plain answer tells its usage, counting a chat
template of its own; a streamed one tells none (unless made to tell it when the client asks)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import openai
import pytest

from tests.fixtures.servers import QuietHandler, canned_upstream, http_server, metric_value, scrape

pytestmark = pytest.mark.timeout(120)
T = TypeVar("T")

TOKEN = "estimated-usage-token"
ENV = {"MODELCANARY_ADMIN_TOKEN": TOKEN}
ANSWER = "Your order ships tomorrow; the tracking number follows by email."  # 64 characters
TEMPLATE_TOKENS = 30  # what llama-shaped counts around the messages (SmolLM2's template and system prompt: ~29)
PRICE = {"input_per_mtok": 3.0, "output_per_mtok": 1.0}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def answer(body: dict) -> tuple[str, str]:
    """(text, finish_reason) of llama-shaped's answer: ANSWER, cut by the cap at 6 characters a token."""
    cap = body.get("max_tokens")
    if isinstance(cap, int) and cap * 6 < len(ANSWER):
        return ANSWER[:cap * 6], "length"
    return ANSWER, "stop"


def plain(body: dict) -> bytes:
    text, finish = answer(body)
    prompt = TEMPLATE_TOKENS + sum(len(m.get("content") or "") for m in body["messages"]) // 4
    return json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": finish}],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": len(text) // 6,
                                 "total_tokens": prompt + len(text) // 6}}).encode()


def streamed(body: dict, usage_when_asked: bool = False) -> bytes:
    """Two characters a chunk (llama sends about a token a chunk), each of the `n` choices in turn; no
    usage whatever the client asked, unless `usage_when_asked`: then a last chunk with the usage
    (its own count, 6 characters a token) when the client asked for it (`stream_options.include_usage`)."""
    text, finish = answer(body)
    n = body.get("n") or 1
    chunks = [{"choices": [{"index": i, "delta": {"content": text[k:k + 2]}}]}
              for k in range(0, len(text), 2) for i in range(n)]
    chunks += [{"choices": [{"index": i, "delta": {}, "finish_reason": finish}]} for i in range(n)]
    if usage_when_asked and (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n * (len(text) // 6),
                                                "total_tokens": 9 + n * (len(text) // 6)}})
    return b"".join(b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 0,
                                            "model": body["model"], **c}).encode() + b"\n\n"
                    for c in chunks) + b"data: [DONE]\n\n"


@contextlib.contextmanager
def llama_shaped(usage_when_asked: bool = False, asked: list[dict] | None = None) -> Iterator[str]:
    """The upstream's base URL; `asked` gets each request body it was sent."""
    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            if asked is not None:
                asked.append(body)
            out = streamed(body, usage_when_asked) if body.get("stream") else plain(body)
            time.sleep(0.02)  # a model's time to answer, the same for every call
            self.send_response(200)
            self.send_header("content-type", "text/event-stream" if body.get("stream") else "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)


    with http_server(Handler) as url:
        yield url + "/v1"


def aa_config(base_url: str, upstream_model: str, **route: object) -> dict:
    """Stable and candidate: the same upstream model at the same price."""
    model = {"provider": "up", "name": upstream_model, "price": PRICE}
    return {
        "server": {"admin_token_env": "MODELCANARY_ADMIN_TOKEN"},
        "providers": {"up": {"base_url": base_url, "timeout_s": 60, "max_retries": 0}},
        "models": {"stable-m": model, "candidate-m": dict(model)},
        "routes": {"aa": {"stable": "stable-m", "candidate": "candidate-m",
                          "shadow": {"sample_rate": 1.0, "noise_floor": True, "max_per_minute": 100000,
                                     "stability": {"sample_rate": 0.0}}, **route}},
    }


def admin(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def wait_for(what: Callable[[], T | None], timeout_s: float = 60.0) -> T:
    """`what()` once it is not None: polled, as a client of the admin API would."""
    deadline = time.monotonic() + timeout_s
    while (got := what()) is None:
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


def judgement(state: dict) -> dict:
    """The controller's latest judgement: the decision it took, else the one it recommended."""
    return state.get("last_decision") or state.get("recommendation") or {}


def cost_judged(url: str, n: int) -> Callable[[], tuple[dict, dict] | None]:
    """(rollout state, its cost per completion evidence over the route) once that evidence has `n` pairs."""
    def read() -> tuple[dict, dict] | None:
        state = admin(url, "/admin/rollouts/aa")
        cost = [e for e in judgement(state).get("evidence") or ()
                if e["metric"] == "cost_per_completion" and e["segment"] == "overall"]
        return (state, cost[0]) if cost and cost[0]["n"] >= n else None
    return read


def stream(client: openai.OpenAI, route: str, content: str, **kwargs: object) -> str:
    text = ""
    for chunk in client.chat.completions.create(model=route, stream=True, messages=[
            {"role": "user", "content": content}], **kwargs):  # type: ignore[call-overload]
        text += "".join(c.delta.content or "" for c in chunk.choices)
    return text


def test_an_identical_candidate_on_streams_without_usage_costs_the_same_and_is_not_rolled_back(servers):
    """A/A on streamed traffic from an upstream that tells no usage in streams: the shadow cost pair
    compares the candidate with the stable model asked again, both measured, so the ratio is 1 and
    the controller, judging on its own, finds no cost regression."""
    n = 40
    # held in shadow (a step would start the evidence over while the test reads it); a cost the judge
    # finds worse still rolls back at once
    rollout = {"steps": [50], "min_shadow_samples": 1000, "min_samples_per_step": 10000, "min_step_seconds": 0,
               "max_step_seconds": 600, "margins": {"cost_per_completion_ratio": 1.25}}
    with llama_shaped() as url:
        proxy = servers.proxy({**aa_config(url, "smollm2", rollout=rollout), "control": {"interval_s": 0.1}}, env=ENV)
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        for i in range(n):
            assert stream(client, "aa", f"Where is my order {i}?") == ANSWER
        state, cost = wait_for(cost_judged(proxy.url, 30))
    assert cost["effect"] == pytest.approx(1.0, abs=0.01), cost
    assert state["phase"] != "rolled_back", state["last_decision"]
    assert not any("cost" in r for r in judgement(state).get("reasons") or ()), judgement(state)


def test_a_stream_without_usage_is_estimated_within_its_cap_with_its_template_and_tools(servers):
    """The tokens recorded (and priced) for streams the upstream counted none of: never more output
    than the cap (an answer the cap cut is that cap), and the input with the chat
    template around each message and the tools' JSON."""
    with llama_shaped() as url:
        proxy = servers.proxy(aa_config(url, "m", shadow={"sample_rate": 0.0}))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        cut = stream(client, "stable-m", "Where is my order?", max_tokens=10)
        text = wait_for(lambda: t if metric_value(t := scrape(proxy.url), "modelcanary_requests_total",
                                                  model="stable-m") >= 1 else None)
        assert len(cut) == 60  # 10 tokens of 6 characters: 15 at 4 characters a token
        assert metric_value(text, "modelcanary_tokens_total", model="stable-m", type="output") == 10

        stream(client, "stable-m", "What is the weather in Paris?", tools=[WEATHER],
               stream_options={"include_usage": True})
        text = wait_for(lambda: t if metric_value(t := scrape(proxy.url), "modelcanary_requests_total",
                                                  model="stable-m") >= 2 else None)
    first = 5 + 4 + 3             # "Where is my order?" (18 characters), one message's template, the answer's
    tools = len(json.dumps([WEATHER])) // 4
    second = 8 + 4 + 3 + tools    # "What is the weather in Paris?" (29 characters)
    assert metric_value(text, "modelcanary_tokens_total", model="stable-m", type="input") == pytest.approx(
        first + second, abs=2)


def recorded(url: str, model: str, n: int) -> str:
    """The metrics once `n` requests of `model` are counted."""
    return wait_for(lambda: t if metric_value(t := scrape(url), "modelcanary_requests_total", model=model) >= n
                    else None)


def choice_texts(chunks: Iterable) -> list[str]:
    """The text of each choice of a streamed answer, by index."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)]


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_a_stream_of_several_choices_without_usage_counts_every_choice(servers):
    """n > 1 from an upstream that tells no usage in streams: every choice's output is counted and
    priced (each within the cap), not the first choice's alone."""
    with llama_shaped() as url:
        proxy = servers.proxy(aa_config(url, "m", shadow={"sample_rate": 0.0}))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        assert choice_texts(client.chat.completions.create(model="stable-m", stream=True, n=3,
                                                           messages=ask("Where is my order?"))) == [ANSWER] * 3
        text = recorded(proxy.url, "stable-m", 1)
        assert metric_value(text, "modelcanary_tokens_total", model="stable-m", type="output") == 3 * 16  # 64 chars each
        assert choice_texts(client.chat.completions.create(model="stable-m", stream=True, n=2, max_tokens=5,
                                                           messages=ask("Where is my order?"))) == [ANSWER[:30]] * 2
        text = recorded(proxy.url, "stable-m", 2)
    output = metric_value(text, "modelcanary_tokens_total", model="stable-m", type="output")
    assert output == 3 * 16 + 2 * 5  # the cap cut both choices: 5 tokens each
    spent = metric_value(text, "modelcanary_tokens_total", model="stable-m", type="input")
    assert metric_value(text, "modelcanary_cost_usd_total", model="stable-m") == pytest.approx(
        (spent * PRICE["input_per_mtok"] + output * PRICE["output_per_mtok"]) / 1e6)


def test_a_plain_answer_of_several_choices_without_usage_counts_every_choice(servers):
    choices = [{"index": i, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}
               for i in range(3)]
    body = json.dumps({"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": choices})
    with canned_upstream(body.encode()) as (url, _):
        proxy = servers.proxy(aa_config(url + "/v1", "m", shadow={"sample_rate": 0.0}))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        reply = client.chat.completions.create(model="stable-m", n=3, messages=ask("Where is my order?"))
        assert [c.message.content for c in reply.choices] == [ANSWER] * 3 and reply.usage is None
        text = recorded(proxy.url, "stable-m", 1)
    assert metric_value(text, "modelcanary_tokens_total", model="stable-m", type="output") == 3 * 16


def test_a_client_that_asks_for_usage_gets_it_and_the_told_usage_is_what_counts(servers):
    """`stream_options.include_usage`: the client gets the upstream's usage chunk, once and last, and
    the tokens recorded are the upstream's count of every choice, not an estimate. A client that did
    not ask gets no usage chunk, and the upstream is asked exactly what the client asked."""
    asked: list[dict] = []
    with llama_shaped(usage_when_asked=True, asked=asked) as url:
        proxy = servers.proxy(aa_config(url, "m", shadow={"sample_rate": 0.0}))
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=10)
        told = list(client.chat.completions.create(model="stable-m", stream=True, n=2, messages=ask("Where is my order?"),
                                                   stream_options={"include_usage": True}))
        recorded(proxy.url, "stable-m", 1)
        untold = list(client.chat.completions.create(model="stable-m", stream=True, n=2,
                                                     messages=ask("Where is my order?")))
        text = recorded(proxy.url, "stable-m", 2)
    assert choice_texts(told) == choice_texts(untold) == [ANSWER] * 2
    assert told[-1].choices == [] and told[-1].usage is not None and told[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in told[:-1]) and all(c.usage is None and c.choices for c in untold)
    assert asked[0]["stream_options"] == {"include_usage": True} and "stream_options" not in asked[1]
    # told: 2 choices of 10 tokens (the upstream's own count); not told: estimated, 16 tokens a choice
    assert metric_value(text, "modelcanary_tokens_total", model="stable-m", type="output") == 20 + 2 * 16


@pytest.mark.timeout(300)
def test_on_llama_an_identical_candidate_is_costed_against_the_measured_stable_call(servers, llama_server):
    """llama.cpp's server sends no usage in streams. An A/A pair on streamed requests is costed
    against the stable model asked again (answered alike at temperature 0: ratio 1), and the streamed
    request's estimated input is near what llama counts for the same request sent plain."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ask = {"messages": messages, "max_tokens": 16, "temperature": 0}
    proxy = servers.proxy({**aa_config(llama_server.base_url, llama_server.chat_model,
                                       rollout={"min_shadow_samples": 1000}),
                           "control": {"interval_s": 0.1}}, env=ENV)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=60)
    for _ in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="aa", stream=True, **ask) if c.choices)
    _, cost = wait_for(cost_judged(proxy.url, 2), timeout_s=240)
    assert cost["effect"] == pytest.approx(1.0, abs=0.01), cost

    estimated = metric_value(scrape(proxy.url), "modelcanary_tokens_total", model="stable-m", type="input") / 2
    measured = client.chat.completions.create(model="stable-m", **ask).usage.prompt_tokens
    assert estimated == pytest.approx(measured, rel=0.25), (estimated, measured)
