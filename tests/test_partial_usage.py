"""Answers of several choices (`n` > 1) and answers whose usage is partly told: every choice is
judged and its finish reason recorded, streamed or not; a cut choice reached the cap by its own share
of the tokens, not the whole answer's; an answer cut short below its cap is not estimated as the cap;
a usage that tells no output has its output estimated; the simulator's refusals keep to the cap."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from service.config import Checks
from service.proxy.formats import MESSAGES, RESPONSES
from service.proxy.outcome import classify_chat
from service.proxy.segments import estimate_tokens
from service.simulator.engine import REFUSAL_TEXT
from tests.fixtures.servers import QuietHandler, http_server, metric_value, scrape, sim_config
from tests.test_tracing import Receiver, attrs

pytestmark = pytest.mark.timeout(120)

Choices = list[tuple[str, str]]  # (text, finish_reason) of each choice


def completion(choices: Choices, completion_tokens: int | None) -> dict:
    body: dict = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                  "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                              for i, (text, finish) in enumerate(choices)]}
    if completion_tokens is not None:
        body["usage"] = {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                         "total_tokens": 9 + completion_tokens}
    return body


def chunked(choices: Choices) -> bytes:
    """A stream without usage: 4 characters (about a token) a chunk, the choices in turn, then each
    choice's finish."""
    def chunk(index: int, delta: dict, finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                       "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
                                      ).encode() + b"\n\n"
    longest = max(len(text) for text, _ in choices)
    out = [chunk(i, {"content": text[k:k + 4]}) for k in range(0, longest, 4)
           for i, (text, _) in enumerate(choices) if text[k:k + 4]]
    out += [chunk(i, {}, finish) for i, (_, finish) in enumerate(choices)]
    return b"".join(out) + b"data: [DONE]\n\n"


@contextlib.contextmanager
def upstream(choices: Choices, completion_tokens: int | None) -> Iterator[str]:
    """Answers every request with `choices`: a plain answer telling `completion_tokens` (None: no
    usage), a stream telling none."""
    class Handler(QuietHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
            stream = bool(body.get("stream"))
            out = chunked(choices) if stream else json.dumps(completion(choices, completion_tokens)).encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream" if stream else "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    with http_server(Handler) as url:
        yield url + "/v1"


def proxy_config(base_url: str, receiver: Receiver) -> dict:
    return {"providers": {"up": {"base_url": base_url, "timeout_s": 10, "max_retries": 0}},
            "models": {"m": {"provider": "up", "name": "m"}},
            "routes": {"bot": {"stable": "m", "shadow": {"sample_rate": 0.0}}},
            "tracing": {"otlp_endpoint": receiver.url}}


def ask(url: str, stream: bool, **fields: object) -> None:
    body = {"model": "bot", "messages": [{"role": "user", "content": "Tell me"}], "stream": stream, **fields}
    with httpx.Client(timeout=10) as client:
        reply = client.post(url + "/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text


def outcomes(url: str, n: int) -> str:
    """The metrics once `n` requests are counted."""
    deadline = time.monotonic() + 30
    while metric_value(text := scrape(url), "modelcanary_requests_total", model="m") < n:
        assert time.monotonic() < deadline, "requests not counted"
        time.sleep(0.05)
    return text


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def failures(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.labels["cause"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "modelcanary_failures_total"}


def judged(servers, receiver: Receiver, choices: Choices, completion_tokens: int | None,
           **fields: object) -> tuple[list[str | None], list[list[str]]]:
    """The failure cause (None: completed) of the answer asked plain then streamed, and the finish
    reasons the span of each recorded."""
    with upstream(choices, completion_tokens) as url:
        proxy = servers.proxy(proxy_config(url, receiver))
        causes: list[str | None] = []
        before: dict[str, float] = {}
        for stream in (False, True):
            ask(proxy.url, stream, **fields)
            after = failures(outcomes(proxy.url, len(causes) + 1))
            causes.append(next((c for c, n in after.items() if n > before.get(c, 0)), None))
            before = after
    spans = [s for s in receiver.wait_spans(2) if s.name.startswith("chat ")]
    assert len(spans) == 2
    return causes, [attrs(s)["gen_ai.response.finish_reasons"] for s in spans]


# ---- 1. every choice is judged and its finish recorded, streamed or not -------------------------


def test_a_choice_the_content_filter_cut_fails_the_answer_and_every_finish_is_recorded(servers, receiver):
    """n = 2, the second choice cut by the content filter: the client did not get what it asked for,
    and a filter firing is what a rollout must see, streamed or not; the span names both finishes."""
    seen, finishes = judged(servers, receiver, [("Here is your answer.", "stop"), ("Here is", "content_filter")],
                            completion_tokens=8, n=2)
    assert finishes == [["stop", "content_filter"]] * 2
    assert seen == ["content_filtered"] * 2


def test_a_later_choice_cut_short_below_the_cap_fails_the_answer(servers, receiver):
    """n = 2, the first choice whole, the second cut by `length` far below the request's cap (the
    context filled up): `truncated`, streamed or not."""
    seen, finishes = judged(servers, receiver, [("A whole answer, short and done.", "stop"), ("Cut", "length")],
                            completion_tokens=9, n=2, max_tokens=400)
    assert seen == ["truncated"] * 2
    assert finishes == [["stop", "length"]] * 2


# ---- 2. a cut choice reached the cap by its own share, not the whole answer's --------------------

WHOLE = "x" * 120  # 30 tokens at 4 characters a token, under the cap of 40


def test_choices_under_the_cap_are_not_taken_as_reaching_it(servers, receiver):
    """n = 3, cap 40: the first choice cut by `length` at 6 tokens, the others whole at 30 each. The
    66 tokens (or 69 chunks) of the answer pass the cap; no choice reached it: `truncated`."""
    seen, _ = judged(servers, receiver, [("y" * 24, "length"), (WHOLE, "stop"), (WHOLE, "stop")],
                     completion_tokens=66, n=3, max_tokens=40)
    assert seen == ["truncated"] * 2


@pytest.mark.parametrize("choices,completion_tokens,expected", [
    ([("y" * 24, "length"), (WHOLE, "stop"), (WHOLE, "stop")], 66, ("failed", "truncated")),  # 6 of 40: the context's cut
    ([("y" * 160, "length"), (WHOLE, "stop"), (WHOLE, "stop")], 100, ("completed", "max_tokens")),  # 40 of 40
    ([("y" * 160, "length"), ("y" * 160, "length")], 80, ("completed", "max_tokens")),  # both at the cap
    ([("y" * 24, "length"), ("y" * 20, "length")], 11, ("failed", "truncated")),  # both where the context ended
])
@pytest.mark.parametrize("told", [True, False], ids=["usage", "chunks"])
def test_each_cut_choice_is_judged_by_its_share_of_the_tokens(choices, completion_tokens, expected, told):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    if told:
        verdict = classify_chat(request, completion(choices, completion_tokens), Checks())
    else:
        raw = chunked(choices)
        verdict = classify_chat(request, completion(choices, None), Checks(), chunks=raw.count(b'"delta"'))
    assert (verdict.outcome, verdict.cause) == expected


# ---- 3. an answer cut short below its cap is not estimated as the cap -----------------------------


@pytest.mark.parametrize("usage", [{"input_tokens": 12}, None], ids=["output untold", "no usage"])
def test_a_messages_answer_cut_short_below_its_cap_is_estimated_by_its_text(usage):
    view = MESSAGES.view({"model": "m", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]})
    response = {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "z" * 40}],
                "stop_reason": "model_context_window_exceeded", "usage": usage}
    told = MESSAGES.usage(view, response)
    assert (told.output, told.estimated) == (10, True)
    at_cap = MESSAGES.usage(view, {**response, "stop_reason": "max_tokens"})
    assert at_cap.output == 1000  # the cap cut it: exactly the cap


# ---- 4. a Responses usage without its output has the output estimated -----------------------------


def test_a_responses_usage_without_output_tokens_has_its_output_estimated():
    view = RESPONSES.view({"model": "m", "input": "hi"})
    response = {"id": "resp_1", "object": "response", "status": "completed",
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "w" * 40}]}],
                "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 2}}}
    told = RESPONSES.usage(view, response)
    assert (told.input, told.cache_read, told.output, told.estimated) == (10, 2, 10, True)
    whole = RESPONSES.usage(view, {**response, "usage": {"input_tokens": 12, "output_tokens": 7}})
    assert (whole.output, whole.estimated) == (7, False)


# ---- 5. the simulator's refusal keeps to the cap -------------------------------------------------


def test_the_simulators_refusal_keeps_to_the_cap(servers):
    model = {**sim_config()["models"]["good-model"], "failures": {"refusal": 1.0}}
    sim = servers.simulator(sim_config({"refuser": model}))
    cap = 3
    assert estimate_tokens(len(REFUSAL_TEXT)) > cap
    prompt = [{"role": "user", "content": "help"}]
    with httpx.Client(base_url=sim.url + "/v1", timeout=10) as client:
        plain = client.post("/chat/completions", json={"model": "refuser", "messages": prompt, "max_tokens": cap,
                                                       "n": 2}).json()
        for choice in plain["choices"]:
            assert estimate_tokens(len(choice["message"]["refusal"])) <= cap, choice
            assert choice["finish_reason"] == "length"
        assert plain["usage"]["completion_tokens"] == 2 * cap
        messages = client.post("/messages", json={"model": "refuser", "messages": prompt, "max_tokens": cap}).json()
        assert messages["usage"]["output_tokens"] <= cap, messages
        responses = client.post("/responses", json={"model": "refuser", "input": "help",
                                                    "max_output_tokens": cap}).json()
        assert responses["usage"]["output_tokens"] <= cap, responses
