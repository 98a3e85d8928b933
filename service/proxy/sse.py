"""Server-sent events: split a captured stream into its events, and put a streamed chat completion
back together as one response dict."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from service.upstream.errors import in_answer_cause

# the first output of a chat stream: a non-empty text, refusal or reasoning delta, or a tool call's
# name or arguments (the first chunk's `"content":""` beside the role is not output)
_CHAT_OUTPUT = re.compile(rb'"(?:content|refusal|reasoning_content|reasoning|name|arguments)":\s*"(?!")')


def sse_events(raw: bytes) -> Iterator[tuple[str | None, bytes]]:
    """(event name, data) for each SSE event in `raw`; multi-line data joined with newlines, as the
    SSE spec joins them."""
    name: str | None = None
    data: list[bytes] = []
    for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
        if not line:
            if data:
                yield name, b"\n".join(data)
            name, data = None, []
        elif line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode("utf-8", "replace")
    if data:
        yield name, b"\n".join(data)


def chat_has_output(events: bytes) -> bool:
    """Whether chat stream events carry output (the first one is the time to first token): keep-alive
    comments and the role-only first chunk do not."""
    return _CHAT_OUTPUT.search(events) is not None


def _merge_tool_call(calls: dict[int, dict], delta: dict) -> None:
    idx = delta.get("index", 0)
    call = calls.setdefault(idx if isinstance(idx, int) else 0,
                            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function")
    if not isinstance(fn, dict):
        return
    for key in ("name", "arguments"):
        part = fn.get(key)
        if isinstance(part, str) and isinstance(call["function"][key], str):
            call["function"][key] += part
        elif part is not None and part != "":
            call["function"][key] = part  # not text: kept as sent, for the verifiers to reject


def reassemble(raw: bytes) -> tuple[dict | None, bool, str | None, str]:  # noqa: C901 - one pass over the SSE events, a branch per field of a chunk
    """(response, saw_done, problem, cause). `response` is shaped like a non-streamed chat completion;
    `problem` is an upstream error event's message, or a parse problem; `cause` is the error event's
    cause (DESIGN §6), `bad_response` for a stream that can't be read."""
    content: list[str] = []
    refusal: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    usage = None
    model = None
    rid = None
    saw_done = False
    saw_chunk = False
    for _, data in sse_events(raw):
        if data == b"[DONE]":
            saw_done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return None, saw_done, "malformed SSE data line", "bad_response"
        if not isinstance(chunk, dict):
            return None, saw_done, "SSE data is not an object", "bad_response"
        if "error" in chunk:
            err = chunk["error"]
            if not isinstance(err, dict):
                return None, saw_done, str(err)[:200], "provider_5xx"
            return None, saw_done, str(err.get("message"))[:200], in_answer_cause(err.get("code") or err.get("type"))
        saw_chunk = True
        model = chunk.get("model", model)
        rid = chunk.get("id", rid)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                refusal.append(delta["refusal"])
            tool_calls = delta.get("tool_calls")
            for tc in tool_calls if isinstance(tool_calls, list) else ():
                if isinstance(tc, dict):
                    _merge_tool_call(calls, tc)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not saw_chunk:
        return None, saw_done, "no chunks in the stream", "bad_response"
    message: dict = {"role": "assistant", "content": "".join(content) if content else None,
                     "refusal": "".join(refusal) if refusal else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    response = {"id": rid, "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
    return response, saw_done, None, "bad_response"
