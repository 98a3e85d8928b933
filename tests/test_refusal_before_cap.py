"""One answer, one cause, whatever API it came through (DESIGN §6): a refusal cut at the length cap is
a `refusal` (the model's), not `max_tokens` (the client's) nor `truncated`; content filtering comes
before both. Chat Completions' order (content filter, refusal, length) holds for Responses and Messages."""

from __future__ import annotations

import pytest

from service.config import Checks
from service.proxy.formats import CHAT, MESSAGES, RESPONSES
from service.proxy.formats.base import ApiFormat

REFUSED = "I can't help with that."


def _chat(finish: str) -> dict:
    return {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": finish, "message": {
        "role": "assistant", "content": None, "refusal": REFUSED}}], "usage": {"completion_tokens": 16}}


def _responses(reason: str) -> dict:
    return {"id": "resp_1", "object": "response", "status": "incomplete", "incomplete_details": {"reason": reason},
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": REFUSED}]}]}


def _messages(stop: str) -> dict:
    return {"id": "msg_1", "type": "message", "role": "assistant", "stop_reason": stop,
            "content": [{"type": "text", "text": REFUSED}]}


CHAT_ASKED = {"messages": [{"role": "user", "content": "hi"}]}
RESPONSES_ASKED = {"input": "hi"}
MESSAGES_ASKED = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}  # a cap is required there


@pytest.mark.parametrize(("fmt", "asked", "cap", "answer", "cause"), [
    (CHAT, CHAT_ASKED, {"max_tokens": 16}, _chat("length"), "refusal"),
    (CHAT, CHAT_ASKED, {}, _chat("length"), "refusal"),
    (CHAT, CHAT_ASKED, {}, _chat("content_filter"), "content_filtered"),
    (RESPONSES, RESPONSES_ASKED, {"max_output_tokens": 16}, _responses("max_output_tokens"), "refusal"),
    (RESPONSES, RESPONSES_ASKED, {}, _responses("max_output_tokens"), "refusal"),
    (RESPONSES, RESPONSES_ASKED, {}, _responses("content_filter"), "content_filtered"),
    (MESSAGES, MESSAGES_ASKED, {}, _messages("refusal"), "refusal"),  # one stop_reason: a refusal, or the cap
])
def test_a_refusal_cut_at_the_cap_is_a_refusal_in_every_format(fmt: ApiFormat, asked: dict, cap: dict,
                                                               answer: dict, cause: str):
    verdict = fmt.classify(fmt.view({**asked, **cap}), answer, Checks())
    assert (verdict.outcome, verdict.cause, verdict.blame) == \
        ("failed", cause, "model"), f"{fmt.name} {cap or 'without a cap'}"
