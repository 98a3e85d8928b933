"""Server-sent events: split a captured stream into its events, and put a streamed chat completion
back together as one response dict."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

from service.upstream.errors import in_answer_cause

# the first output of a chat stream: a non-empty text, refusal or reasoning delta, or a tool call's
# name or arguments (the first chunk's `"content":""` beside the role is not output)
_CHAT_OUTPUT = re.compile(rb'"(?:content|refusal|reasoning_content|reasoning|name|arguments)":\s*"(?!")')


@dataclass(slots=True)
class Reassembled:
    """A streamed answer put back together. `response` is shaped like the non-streamed body (as far
    as the stream went); `ended`: the format's end-of-stream event was seen; `problem`: why it can't
    be read, with its cause (an upstream error event names one); `broken`: the events hold an upstream
    error event or data that can't be read, so the stream failed there, whatever came after."""

    response: dict | None
    ended: bool
    problem: str | None = None
    cause: str = "bad_response"
    broken: bool = False


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
        gathered = call["function"][key]
        if key == "name" and part == gathered:
            continue  # llama.cpp's server repeats the whole name in every delta
        if isinstance(part, str) and isinstance(gathered, str):
            call["function"][key] += part
        elif part is not None and part != "":
            call["function"][key] = part  # not text: kept as sent, for the verifiers to reject


@dataclass(slots=True)
class _Choice:
    """One choice of a chat stream as its deltas came."""

    content: list[str]
    refusal: list[str]
    calls: dict[int, dict]
    finish: str | None = None

    def completion(self, index: int) -> dict:
        message: dict = {"role": "assistant", "content": "".join(self.content) if self.content else None,
                         "refusal": "".join(self.refusal) if self.refusal else None}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return {"index": index, "message": message, "finish_reason": self.finish}


def reassemble(raw: bytes) -> Reassembled:  # noqa: C901 - one pass over the SSE events, a branch per field of a chunk
    """A chat stream as a non-streamed chat completion, every choice (n > 1) by its index; `ended`
    once every choice gave a finish_reason, or at `[DONE]`. An error event (its cause as DESIGN §6
    names it) or unreadable data ends the reading: the answer is what came before it."""
    choices: dict[int, _Choice] = {}
    usage = None
    model = None
    rid = None
    saw_done = False
    saw_chunk = False
    problem: str | None = None
    cause = "bad_response"
    for _, data in sse_events(raw):
        if data == b"[DONE]":
            saw_done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            problem = "malformed SSE data line"
            break
        if not isinstance(chunk, dict):
            problem = "SSE data is not an object"
            break
        if chunk.get("error"):  # as the openai SDKs read it: `"error": null` is no error
            err = chunk["error"]
            if isinstance(err, dict):
                problem, cause = str(err.get("message"))[:200], in_answer_cause(err.get("code") or err.get("type"))
            else:
                problem, cause = str(err)[:200], "provider_5xx"
            break
        saw_chunk = True
        model = chunk.get("model", model)
        rid = chunk.get("id", rid)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index, delta = choice.get("index", 0), choice.get("delta")
            if not isinstance(index, int) or not isinstance(delta, dict):
                continue
            state = choices.get(index)
            if state is None:
                state = choices[index] = _Choice([], [], {})
            if isinstance(delta.get("content"), str):
                state.content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                state.refusal.append(delta["refusal"])
            tool_calls = delta.get("tool_calls")
            for tc in tool_calls if isinstance(tool_calls, list) else ():
                if isinstance(tc, dict):
                    _merge_tool_call(state.calls, tc)
            if choice.get("finish_reason"):
                state.finish = choice["finish_reason"]
    broken = problem is not None
    if not saw_chunk:
        return Reassembled(None, saw_done, problem or "no chunks in the stream", cause, broken)
    response = {"id": rid, "object": "chat.completion", "model": model,
                "choices": [choices[i].completion(i) for i in sorted(choices)] or [_Choice([], [], {}).completion(0)],
                "usage": usage}
    finished = bool(choices) and all(c.finish is not None for c in choices.values())
    return Reassembled(response, not broken and (saw_done or finished), problem, cause, broken)
