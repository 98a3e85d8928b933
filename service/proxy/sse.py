"""Reassemble a streamed chat completion (SSE bytes) into one response dict."""

from __future__ import annotations

import json


def _merge_tool_call(calls: dict[int, dict], delta: dict) -> None:
    idx = delta.get("index", 0)
    call = calls.setdefault(idx, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    fn = delta.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def reassemble(raw: bytes) -> tuple[dict | None, bool, str | None]:  # noqa: C901 - one pass over the SSE events, a branch per field of a chunk
    """(response, saw_done, error). `response` is shaped like a non-streamed chat completion;
    `error` is an upstream error event's message, or a parse problem."""
    content: list[str] = []
    refusal: list[str] = []
    calls: dict[int, dict] = {}
    finish = None
    usage = None
    model = None
    rid = None
    saw_done = False
    saw_chunk = False
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            saw_done = True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            return None, saw_done, "malformed SSE data line"
        if not isinstance(chunk, dict):
            return None, saw_done, "SSE data is not an object"
        if "error" in chunk:
            err = chunk["error"]
            return None, saw_done, str(err.get("message") if isinstance(err, dict) else err)[:200]
        saw_chunk = True
        model = chunk.get("model", model)
        rid = chunk.get("id", rid)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                refusal.append(delta["refusal"])
            for tc in delta.get("tool_calls") or ():
                if isinstance(tc, dict):
                    _merge_tool_call(calls, tc)
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    if not saw_chunk:
        return None, saw_done, "no chunks in the stream"
    message: dict = {"role": "assistant", "content": "".join(content) if content else None,
                     "refusal": "".join(refusal) if refusal else None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    response = {"id": rid, "object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
    return response, saw_done, None
