"""`POST /v1/responses` of the simulator: the Responses API rendered from the chat engine's answer.

Input items become chat messages (function calls and their outputs included); function tools,
`tool_choice`, `text.format` and `max_output_tokens` map onto their chat forms. The answer is a
`message` output item (text or refusal) or `function_call` items; `finish_reason` `length` is
`status: incomplete` with reason `max_output_tokens`, `content_filter` its own reason. Answers are
stored (unless `store: false`) so that `previous_response_id` continues a conversation on the
model that made it; another model answers 400 `previous_response_not_found`, as OpenAI does for
an id it does not hold. `GET` and `DELETE /v1/responses/{id}` fetch and delete a stored answer; an
id this simulator does not hold is a 404, as OpenAI's for another organization's.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace

from service.proxy.segments import content_text
from service.simulator import translate
from service.simulator.engine import Engine, Reply, bad_json_reply, error_reply, missing_param

STORED_RESPONSES = 10_000


def _messages(body: dict) -> list[dict]:
    """The request's input as chat messages (without the stored conversation it continues)."""
    out: list[dict] = []
    inp = body.get("input")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    for item in inp if isinstance(inp, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message" and isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": content_text(item.get("content"))})
        elif kind == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}}]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else content_text(output)})
    return out


def _chat_body(body: dict, messages: list[dict]) -> dict:
    chat: dict = {"model": body.get("model"), "messages": messages}
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        chat["messages"] = [{"role": "system", "content": body["instructions"]}, *messages]
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                               "parameters": t.get("parameters")}}
             for t in body.get("tools") or () if isinstance(t, dict) and t.get("type") == "function"]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
        elif isinstance(choice, dict) and choice.get("type") == "function":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and (
            response_format := translate.json_format(fmt.get("type"), fmt.get("schema"), fmt.get("name"))):
        chat["response_format"] = response_format
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream") is True:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(chat_usage: dict | None) -> dict:
    u = chat_usage or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def _message_item(rid: str, status: str, part: dict | None) -> dict:
    return {"type": "message", "id": "msg_" + rid[5:], "status": status, "role": "assistant",
            "content": [part] if part is not None else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(rid: str, call: dict, status: str) -> dict:
    fn = call.get("function") or {}
    return {"type": "function_call", "id": "fc_" + rid[5:], "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments") or "", "status": status}


def _output(rid: str, message: dict) -> list[dict]:
    calls = message.get("tool_calls") or []
    if calls:
        return [_call_item(rid, calls[0], "completed")]
    if message.get("refusal"):
        return [_message_item(rid, "completed", {"type": "refusal", "refusal": message["refusal"]})]
    return [_message_item(rid, "completed", _text_part(message.get("content") or ""))]


def _status(finish: str) -> tuple[str, dict | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _unknown(rid: str) -> Reply:
    return error_reply(404, f"Response with id '{rid}' not found.", "invalid_request_error")


class ResponsesEndpoint:
    def __init__(self, engine: Engine):
        self.engine = engine
        # response id -> (model, the conversation so far as chat messages, the response), oldest forgotten first
        self._stored: OrderedDict[str, tuple[str, list[dict], dict]] = OrderedDict()

    def respond(self, raw: bytes, task_type: str | None = None) -> Reply:
        body = translate.parsed(raw)
        if body is None:
            return bad_json_reply()
        history: list[dict] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            stored = self._stored.get(previous) if isinstance(previous, str) else None
            if stored is None or stored[0] != body.get("model"):
                return error_reply(400, f"Previous response with id '{previous}' not found.", "invalid_request_error",
                                   "previous_response_not_found", "previous_response_id")
            history = stored[1]
        messages = history + _messages(body)
        if not messages:
            return missing_param("input")
        reply = translate.ask_chat(self.engine, _chat_body(body, messages), task_type)
        if reply.status != 200 or reply.hang:
            return reply  # errors have the same shape in both APIs
        rid = "resp_" + self.engine._next_id()
        if reply.frames is not None:
            return self._stream(reply, body, rid, messages)
        chat = translate.parsed(reply.body)
        if chat is None:  # bad_response: the engine cut its body, so cut ours
            out = translate.dumps(self._response(body, rid, "in_progress", None, [], None)).encode()
            return replace(reply, body=out[: len(out) // 2])
        message, finish = translate.first_choice(chat)
        status, details = _status(finish)
        response = self._response(body, rid, status, details, _output(rid, message), chat.get("usage"))
        self._store(body, rid, messages, message, response)
        return replace(reply, body=translate.dumps(response).encode())

    def retrieve(self, rid: str) -> Reply:
        stored = self._stored.get(rid)
        return _unknown(rid) if stored is None else Reply(body=translate.dumps(stored[2]).encode())

    def delete(self, rid: str) -> Reply:
        if self._stored.pop(rid, None) is None:
            return _unknown(rid)
        return Reply(body=translate.dumps({"id": rid, "object": "response.deleted", "deleted": True}).encode())

    def _response(self, body: dict, rid: str, status: str, details: dict | None, output: list[dict],
                  chat_usage: dict | None) -> dict:
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
                "incomplete_details": details, "instructions": body.get("instructions"),
                "max_output_tokens": body.get("max_output_tokens"), "model": body.get("model"), "output": output,
                "parallel_tool_calls": True, "previous_response_id": body.get("previous_response_id"),
                "store": body.get("store", True) is not False, "temperature": 1.0,
                "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
                "tools": body.get("tools") or [], "top_p": 1.0, "truncation": "disabled",
                "usage": _usage(chat_usage) if status != "in_progress" else None, "metadata": {}}

    def _store(self, body: dict, rid: str, messages: list[dict], message: dict, response: dict) -> None:
        if body.get("store") is False:
            return
        said = {"role": "assistant", "content": message.get("content") or message.get("refusal")}
        if message.get("tool_calls"):
            said["tool_calls"] = message["tool_calls"]
        self._stored[rid] = (body.get("model"), [m for m in messages if m.get("role") != "system"] + [said], response)
        while len(self._stored) > STORED_RESPONSES:
            self._stored.popitem(last=False)

    def _stream(self, reply: Reply, body: dict, rid: str, messages: list[dict]) -> Reply:  # noqa: C901 - one SSE stream, event by event in the wire order
        seq = 0
        text: list[str] = []
        refusal: list[str] = []
        call: dict | None = None
        opened: str | None = None  # text | refusal | call
        finish = "stop"
        usage: dict | None = None
        item_id = "msg_" + rid[5:]

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return translate.named_event(kind, {"type": kind, "sequence_number": seq - 1, **fields})

        def open_item(kind: str) -> list[str]:
            nonlocal opened
            opened = kind
            if kind == "call":
                assert call is not None
                return [event("response.output_item.added", output_index=0, item=_call_item(rid, call, "in_progress"))]
            part = _text_part("") if kind == "text" else {"type": "refusal", "refusal": ""}
            return [event("response.output_item.added", output_index=0, item=_message_item(rid, "in_progress", None)),
                    event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part)]

        def closing() -> list[str]:
            message: dict = {"content": "".join(text), "refusal": "".join(refusal) or None}
            out: list[str] = []
            if opened == "call":
                assert call is not None
                call["function"]["arguments"] = "".join(text)
                message = {"tool_calls": [call]}
                out.append(event("response.function_call_arguments.done", item_id="fc_" + rid[5:], output_index=0,
                                 arguments=call["function"]["arguments"]))
            elif opened == "refusal":
                part = {"type": "refusal", "refusal": message["refusal"]}
                out += [event("response.refusal.done", item_id=item_id, output_index=0, content_index=0,
                              refusal=message["refusal"]),
                        event("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)]
            elif opened == "text":
                out += [event("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
                              text=message["content"], logprobs=[]),
                        event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                              part=_text_part(message["content"]))]
            output = _output(rid, message)
            out.append(event("response.output_item.done", output_index=0, item=output[0]))
            status, details = _status(finish)
            response = self._response(body, rid, status, details, output, usage)
            self._store(body, rid, messages, message, response)
            terminal = "response.completed" if status == "completed" else "response.incomplete"
            return out + [event(terminal, response=response)]

        def told(chunk: dict) -> list[str]:  # noqa: C901 - a branch per kind of chat delta
            nonlocal started, usage, call, finish
            events: list[str] = []
            if not started:
                started = True
                skeleton = self._response(body, rid, "in_progress", None, [], None)
                events += [event("response.created", response=skeleton),
                           event("response.in_progress", response=skeleton)]
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("tool_calls"):
                    tc = delta["tool_calls"][0]
                    if tc.get("id"):
                        call = {"id": tc["id"], "type": "function",
                                "function": {"name": (tc.get("function") or {}).get("name"), "arguments": ""}}
                        events += open_item("call")
                    piece = (tc.get("function") or {}).get("arguments") or ""
                    if piece:
                        text.append(piece)
                        events.append(event("response.function_call_arguments.delta", item_id="fc_" + rid[5:],
                                            output_index=0, delta=piece))
                elif delta.get("refusal") is not None or delta.get("content") is not None:
                    refused = delta.get("refusal") is not None
                    piece = delta["refusal"] if refused else delta["content"]
                    if opened is None:
                        events += open_item("refusal" if refused else "text")
                    if piece:
                        (refusal if refused else text).append(piece)
                        extra = {} if refused else {"logprobs": []}
                        events.append(event("response.refusal.delta" if refused else "response.output_text.delta",
                                            item_id=item_id, output_index=0, content_index=0, delta=piece, **extra))
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                    if opened is None:
                        events += open_item("text")
            return events

        started = False
        return translate.retold(reply, "response.output_text.delta", closing, told)
