"""`POST /v1/messages` of the simulator: Anthropic's Messages API rendered from the chat engine's answer.

System prompt, text blocks, `tool_use` and `tool_result` blocks become chat messages; tools with an
`input_schema` become function tools. The answer is a `text` block or a `tool_use` block. Stop
reasons: `tool_use`; `max_tokens` when the answer reached the request's `max_tokens`; a `truncated`
failure (cut short below the cap) is `model_context_window_exceeded`; `refusal` (and a
`content_filtered` failure, which this API has no other word for) is `refusal`. An
`invalid_tool_call` failure gives a streamed `tool_use` whose JSON is malformed, and a non-streamed
one whose input misses what its schema requires. Errors take Anthropic's shape; an overloaded
engine (503) answers 529 `overloaded_error`. Prompt caching: the prompt up to the last block marked
`cache_control` is written to the cache the first time a model sees it and read from it after.
"""

from __future__ import annotations

import json
from dataclasses import replace

from service.proxy.segments import content_text, estimate_tokens, message_chars
from service.simulator import translate
from service.simulator.engine import Engine, Reply

CACHE_MEMORY = 10_000
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               529: "overloaded_error"}


def anthropic_error(status: int, message: str, headers: tuple = (), delay: float = 0.0, kind: str | None = None) -> Reply:
    error = {"type": kind or ERROR_TYPES.get(status, "api_error"), "message": message}
    body = translate.dumps({"type": "error", "error": error})
    return Reply(status=status, body=body.encode(), headers=headers, delay=delay)


def invalid_key_reply() -> Reply:
    return anthropic_error(401, "invalid x-api-key")


def list_models(engine: Engine) -> Reply:
    """`GET /v1/models` as Anthropic's clients expect it."""
    data = [{"type": "model", "id": name, "display_name": name, "created_at": "2025-01-01T00:00:00Z"}
            for name in engine.models]
    return Reply(body=translate.dumps({"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
                                       "last_id": data[-1]["id"] if data else None}).encode())


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = content_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
        for b in blocks:
            if b.get("type") == "tool_result":
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": content_text(b.get("content"))})
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": translate.dumps(b.get("input") or {})}}
                 for b in blocks if b.get("type") == "tool_use"]
        text = content_text(content)
        if text or calls or not blocks:
            message: dict = {"role": m.get("role"), "content": text or None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def _chat_body(body: dict) -> dict:
    chat: dict = {"model": body.get("model"), "messages": _messages(body), "max_tokens": body.get("max_tokens")}
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                               "parameters": t.get("input_schema")}}
             for t in body.get("tools") or () if isinstance(t, dict) and "input_schema" in t]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
        elif kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}  # type: ignore[union-attr]
    fmt = body.get("output_format")
    if isinstance(fmt, dict) and (response_format := translate.json_format(fmt.get("type"), fmt.get("schema"))):
        chat["response_format"] = response_format
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _input_tokens(tool_input: object) -> int:
    """A tool_use block's output tokens as the proxy counts them: its input's JSON (a streamed input
    that is not JSON, as its text)."""
    if isinstance(tool_input, str):
        try:
            tool_input = json.loads(tool_input)
        except ValueError:
            return estimate_tokens(len(tool_input))
    return estimate_tokens(len(json.dumps(tool_input)))


def _cached_prefix(body: dict) -> list:
    """The blocks up to and including the last one marked `cache_control` (system, tools, messages)."""
    blocks: list = []
    system = body.get("system")
    blocks += system if isinstance(system, list) else [system] if system else []
    blocks += list(body.get("tools") or ())
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        blocks += content if isinstance(content, list) else [content]
    marked = [i for i, b in enumerate(blocks) if isinstance(b, dict) and b.get("cache_control")]
    return blocks[: marked[-1] + 1] if marked else []


def _schema_misfit(schema: object) -> dict:
    """An input that does not fit `schema`: a required property missing, else one of the wrong type."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("required"):
        return {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    name = next(iter(props), "input")
    return {name: 12345 if (props.get(name) or {}).get("type") == "string" else "not-a-number"}


class MessagesEndpoint:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cached: dict[tuple[str, str], None] = {}  # (model, cached prefix) already written

    def respond(self, raw: bytes, task_type: str | None = None) -> Reply:
        body = translate.parsed(raw)
        if body is None:
            return anthropic_error(400, "There was an issue with the format or content of your request.")
        for field in ("model", "messages", "max_tokens"):
            if field not in body:
                return anthropic_error(400, f"{field}: Field required")
        if not isinstance(body["messages"], list) or not body["messages"]:
            return anthropic_error(400, "messages: at least one message is required")
        reply = translate.ask_chat(self.engine, _chat_body(body), task_type)
        if reply.hang:
            return reply
        if reply.status != 200:
            return self._error(reply)
        mid = "msg_" + self.engine._next_id()
        usage = self._usage(body)
        if reply.frames is not None:
            return self._stream(reply, body, mid, usage)
        chat = translate.parsed(reply.body)
        if chat is None:  # bad_response: the engine cut its body, so cut ours
            out = translate.dumps(self._message(body, mid, [], None, usage)).encode()
            return replace(reply, body=out[: len(out) // 2])
        message, finish = translate.first_choice(chat)
        usage["output_tokens"] = (chat.get("usage") or {}).get("completion_tokens", 0)
        content = self._content(body, message, finish)
        stop = self._stop(body, message, finish, usage)
        if stop == "tool_use":  # the input this API carries, not the chat arguments it was parsed from
            usage["output_tokens"] = _input_tokens(content[0]["input"])
        return replace(reply, body=translate.dumps(self._message(body, mid, content, stop, usage)).encode())

    # -------------------------------------------------------- rendering

    def _error(self, reply: Reply) -> Reply:
        err = translate.chat_error(reply)
        status = 529 if reply.status == 503 else reply.status
        message = str(err.get("message") or "error")
        kind = None
        if err.get("code") == "context_length_exceeded":
            message = f"prompt is too long: {message}"
        elif err.get("code") == "model_not_found":
            message = f"model: {err.get('message')}"
        elif err.get("code") == "insufficient_quota":
            status, kind = 400, "billing_error"
            message = "Your credit balance is too low to access the Anthropic API."
        return anthropic_error(status, message, reply.headers, reply.delay, kind)

    def _usage(self, body: dict) -> dict:
        prompt = max(1, estimate_tokens(message_chars(_messages(body))))
        prefix = _cached_prefix(body)
        prefix_chars = sum(len(b) if isinstance(b, str) else len(content_text([b])) for b in prefix)
        cached = min(prompt, estimate_tokens(prefix_chars))
        key = (str(body.get("model")), translate.dumps(prefix))
        read = cached if prefix and key in self._cached else 0
        if prefix and not read:
            if len(self._cached) >= CACHE_MEMORY:
                self._cached.clear()
            self._cached[key] = None
        return {"input_tokens": prompt - cached, "output_tokens": 0, "cache_creation_input_tokens": cached - read,
                "cache_read_input_tokens": read}

    def _content(self, body: dict, message: dict, finish: str) -> list[dict]:
        calls = message.get("tool_calls") or []
        if calls:
            fn = calls[0].get("function") or {}
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:  # invalid_tool_call: this API carries an object, so a misfit one
                schema = next((t.get("input_schema") for t in body.get("tools") or ()
                               if isinstance(t, dict) and t.get("name") == fn.get("name")), None)
                args = _schema_misfit(schema)
            return [{"type": "tool_use", "id": "toolu_" + str(calls[0].get("id"))[5:], "name": fn.get("name"),
                     "input": args}]
        text = message.get("refusal") or message.get("content") or ""
        return [{"type": "text", "text": text}] if text else []

    @staticmethod
    def _stop(body: dict, message: dict, finish: str, usage: dict) -> str:
        if message.get("refusal") or finish == "content_filter":
            return "refusal"
        if finish == "length":
            return "max_tokens" if usage["output_tokens"] >= body["max_tokens"] else "model_context_window_exceeded"
        return "tool_use" if finish == "tool_calls" else "end_turn"

    @staticmethod
    def _message(body: dict, mid: str, content: list[dict], stop: str | None, usage: dict) -> dict:
        return {"id": mid, "type": "message", "role": "assistant", "model": body.get("model"), "content": content,
                "stop_reason": stop, "stop_sequence": None, "usage": usage}

    def _stream(self, reply: Reply, body: dict, mid: str, usage: dict) -> Reply:  # noqa: C901 - one SSE stream, event by event in the wire order
        kind: str | None = None  # text | tool_use
        message: dict = {}
        finish = "stop"
        arguments: list[str] = []  # the tool_use input's JSON as streamed

        def opening(block: dict) -> str:
            nonlocal kind
            kind = block["type"]
            return translate.named_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                                 "content_block": block})

        def done() -> list[str]:
            stop = self._stop(body, message, finish, usage)
            if stop == "tool_use":
                usage["output_tokens"] = _input_tokens("".join(arguments))
            events = [] if kind is not None else [opening({"type": "text", "text": ""})]
            message_delta = {"type": "message_delta", "usage": usage,
                             "delta": {"stop_reason": stop, "stop_sequence": None}}
            return events + [translate.named_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                             translate.named_event("message_delta", message_delta),
                             translate.named_event("message_stop", {"type": "message_stop"})]

        def told(chunk: dict) -> list[str]:  # noqa: C901 - a branch per kind of chat delta
            nonlocal started, finish
            events: list[str] = []
            if chunk.get("usage"):
                usage["output_tokens"] = chunk["usage"].get("completion_tokens", 0)
            if not started:
                started = True
                start = self._message(body, mid, [], None, {**usage, "output_tokens": 1})
                events.append(translate.named_event("message_start", {"type": "message_start", "message": start}))
                events.append(translate.named_event("ping", {"type": "ping"}))
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("tool_calls"):
                    tc = delta["tool_calls"][0]
                    if tc.get("id"):
                        message["tool_calls"] = [tc]
                        events.append(opening({"type": "tool_use", "id": "toolu_" + tc["id"][5:],
                                               "name": (tc.get("function") or {}).get("name"), "input": {}}))
                    piece = (tc.get("function") or {}).get("arguments") or ""
                    if piece:
                        arguments.append(piece)
                        events.append(translate.named_event("content_block_delta", {
                            "type": "content_block_delta", "index": 0,
                            "delta": {"type": "input_json_delta", "partial_json": piece}}))
                    continue
                text = delta.get("refusal") if delta.get("refusal") is not None else delta.get("content")
                if delta.get("refusal") is not None:
                    message["refusal"] = True
                if text is not None and kind is None:
                    events.append(opening({"type": "text", "text": ""}))
                if text:
                    events.append(translate.named_event("content_block_delta", {
                        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}))
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            return events

        started = False
        return translate.retold(reply, "content_block_delta", done, told)

