"""OpenAI Responses API (`POST /v1/responses`).

Outcomes: `status` `failed` takes its cause from `error.code`; `incomplete` from
`incomplete_details.reason` in chat's order (`content_filter` is `content_filtered`; else a refusal
part is `refusal`; `max_output_tokens` is the client's `max_tokens` cause when the request set
`max_output_tokens`, else `truncated`); a completed
answer is checked like a chat answer (refusal parts, function-call arguments against the function
tools, JSON and its schema for `text.format`). A model's settings go into Responses fields
(`RESPONSES_PARAMS`; its system prompt goes first in `instructions`, which a follow-up does not
inherit); chat params with no Responses field are not sent. TTFT is the first output delta (text, refusal or
function arguments); a stream ends at `response.completed`, `response.incomplete` or `response.failed`.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from service.config import Checks, ModelConfig
from service.errors import error_body, openai_error
from service.proxy.formats import base
from service.proxy.outcome import COMPLETED, MAX_TOKENS, Verdict, classify_chat, failed
from service.proxy.sse import sse_events
from service.upstream.errors import error_cause, in_answer_cause, json_object
from service.upstream.model_settings import CAP_FIELDS

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta")
FIRST_OUTPUT = (b'"response.output_text.delta"', b'"response.refusal.delta"', b'"response.function_call_arguments.delta"')
# kept from the live request in a shadow call: never streamed, never stored, no upstream state
SHADOW_DROPPED = ("stream", "stream_options", "previous_response_id", "conversation", "background")

# a model's chat `params` -> (Responses field, key inside it or None)
RESPONSES_PARAMS: dict[str, tuple[str, str | None]] = {
    "max_tokens": ("max_output_tokens", None), "max_completion_tokens": ("max_output_tokens", None),
    "reasoning_effort": ("reasoning", "effort"), "verbosity": ("text", "verbosity"),
    **{f: (f, None) for f in ("temperature", "top_p", "top_logprobs", "parallel_tool_calls", "metadata", "store",
                              "service_tier", "user", "safety_identifier", "prompt_cache_key")},
}


def _item_message(item: dict) -> dict | None:
    """An input item as a chat view message."""
    kind = item.get("type", "message")
    if kind == "message":
        return {"role": item.get("role"), "content": item.get("content")}
    if kind == "function_call":
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": item.get("call_id"), "type": "function",
             "function": {"name": item.get("name"), "arguments": item.get("arguments")}}]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, (str, list)) else None}
    return None


class ResponsesFormat:
    name = "responses"
    path = "/responses"
    provider_api = "openai"
    end_of_stream: tuple[bytes, ...] = tuple(f'"{t}"'.encode() for t in TERMINAL)

    def has_output(self, events: bytes) -> bool:
        return any(m in events for m in FIRST_OUTPUT)

    def check(self, body: dict) -> tuple[str, str] | None:
        inp = body.get("input")
        if inp is None and not body.get("prompt"):
            return "input", "field 'input' is required: a string or an array of input items"
        if inp is not None and not isinstance(inp, (str, list)):
            return "input", "field 'input' must be a string or an array of input items"
        previous = body.get("previous_response_id")
        if previous is not None and (not isinstance(previous, str) or not previous):
            return "previous_response_id", "field 'previous_response_id' must be a response id string"
        return base.tools_problem(body)

    def view(self, body: dict) -> dict:
        messages: list[dict] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            messages.append({"role": "system", "content": instructions})
        inp = body.get("input")
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
        elif isinstance(inp, list):
            messages.extend(m for item in inp if isinstance(item, dict) and (m := _item_message(item)) is not None)
        view: dict = {"messages": messages}
        tools = [base.function_tool(t.get("name"), t.get("parameters")) for t in body.get("tools") or ()
                 if isinstance(t, dict) and t.get("type") == "function"]
        if tools:
            view["tools"] = tools
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and (json_format := base.json_response_format(fmt.get("type"), fmt.get("schema"))):
            view["response_format"] = json_format
        if isinstance(body.get("max_output_tokens"), int):
            view["max_tokens"] = body["max_output_tokens"]
        return view

    def stateful(self, body: dict) -> str | None:
        if body.get("previous_response_id"):
            return "previous_response_id"
        if body.get("conversation"):
            return "conversation"
        if body.get("background") is True:  # the answer is fetched later from the upstream that holds it
            return "background"
        listed = body.get("tools")
        tools = [t for t in listed if isinstance(t, dict)] if isinstance(listed, list) else []
        if any(isinstance(t.get("container"), str) for t in tools):
            return "container"  # a tool runs in the client's own container: a shadow call would change it
        if any(t.get("type") == "mcp" for t in tools):
            return "mcp"  # the provider calls the client's MCP server or connector: a shadow call would call it again
        return None

    def classify(self, view: dict, response: dict, checks: Checks) -> Verdict:
        if not isinstance(response.get("output"), list):
            return failed("bad_response", "no output in the response")
        status = response.get("status")
        if status in ("queued", "in_progress"):  # a background answer: what the client asked for, for now
            return COMPLETED
        if status == "failed":
            err = found if isinstance(found := response.get("error"), dict) else {}
            return failed(in_answer_cause(err.get("code")), str(err.get("message") or "response failed")[:200])
        if status == "incomplete":  # in chat's order: the content filter, a refusal, then the cap
            details = response.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            if reason == "content_filter":
                return failed("content_filtered")
            refusal = _refusal(response["output"])
            if refusal:
                return failed("refusal", refusal[:200])
            if reason == "max_output_tokens" and view.get("max_tokens") is not None:
                return MAX_TOKENS
            return failed("truncated", f"incomplete: {reason}")
        chat = self.chat_view(response)
        assert chat is not None  # output is a list
        return classify_chat(view, chat, checks)

    def error_cause(self, status: int, body: dict | None) -> str:
        return error_cause(status, body)

    def usage(self, view: dict, response: dict | None) -> base.Usage:
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
            details = usage.get("input_tokens_details")
            cached = base.token_count(details.get("cached_tokens")) if isinstance(details, dict) else 0
            total = base.token_count(usage["input_tokens"])
            output = usage.get("output_tokens")
            told = isinstance(output, int)  # an input count alone: the output is estimated from the text
            return base.Usage(max(0, total - cached),
                              base.token_count(output) if told else base.estimated_output(view, self.chat_view(response)),
                              cache_read=min(cached, total), estimated=not told)
        return base.untold_usage(view, response, self.chat_view(response))

    def reassemble(self, raw: bytes) -> base.Reassembled:  # noqa: C901 - one pass over the SSE events, a branch per event type
        final: dict | None = None
        done_items: dict[int, dict] = {}
        begun: dict[int, dict] = {}         # items added, not done yet
        deltas: dict[int, list[str]] = {}   # their text or arguments so far
        for name, data in sse_events(raw):
            if data == b"[DONE]":
                continue
            event = json_object(data)
            if event is None:
                return base.Reassembled(_unfinished(done_items, begun, deltas), False, "malformed SSE data",
                                        broken=True)
            kind = event.get("type") or name
            if kind == "error":
                err = found if isinstance(found := event.get("error"), dict) else event
                return base.Reassembled(_unfinished(done_items, begun, deltas), False,
                                        str(err.get("message") or "error event")[:200], in_answer_cause(err.get("code")),
                                        broken=True)
            index = event.get("output_index")
            if kind == "response.output_item.done" and isinstance(event.get("item"), dict):
                done_items[index if isinstance(index, int) else len(done_items)] = event["item"]
            elif kind == "response.output_item.added" and isinstance(event.get("item"), dict):
                begun[index if isinstance(index, int) else len(begun)] = event["item"]
            elif kind in DELTAS and isinstance(event.get("delta"), str):
                deltas.setdefault(index if isinstance(index, int) else 0, []).append(event["delta"])
            elif kind in TERMINAL and isinstance(event.get("response"), dict):
                final = event["response"]
        if final is None:
            return base.Reassembled(_unfinished(done_items, begun, deltas), False, "stream ended before "
                                    "response.completed, response.incomplete or response.failed")
        if not final.get("output") and done_items:
            final = {**final, "output": [done_items[i] for i in sorted(done_items)]}
        return base.Reassembled(final, True)

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        err = json.loads(error_body(status, message, code))["error"]
        payload = {"type": "error", "code": code, "message": message, "param": None, "error": err}
        return b"event: error\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def error_response(self, status: int, message: str, code: str | None = None, param: str | None = None,
                       headers: dict[str, str] | None = None) -> Response:
        return openai_error(status, message, code, param, headers)

    def model_body(self, request: dict, model: ModelConfig) -> dict:
        body = {**request, "model": model.name}
        if any(f in model.params for f in CAP_FIELDS):
            body.pop("max_output_tokens", None)
        for key, value in model.params.items():
            if key not in RESPONSES_PARAMS:
                continue
            field, inner = RESPONSES_PARAMS[key]
            if inner is None:
                body[field] = value
            else:
                outer = body.get(field)
                body[field] = {**(outer if isinstance(outer, dict) else {}), inner: value}
        if model.system_prompt is not None:
            own = request.get("instructions")
            body["instructions"] = f"{model.system_prompt}\n\n{own}" if isinstance(own, str) and own else model.system_prompt
        return body

    def shadow_body(self, request: dict, upstream_model: str) -> dict:
        body = {k: v for k, v in request.items() if k not in SHADOW_DROPPED}
        body["model"] = upstream_model
        body["store"] = False
        return body

    def chat_view(self, response: dict | None) -> dict | None:
        output = response.get("output") if isinstance(response, dict) else None
        if not isinstance(response, dict) or not isinstance(output, list):  # a list only in a dict
            return None
        texts: list[str] = []
        refusals: list[str] = []
        calls: list[dict] = []
        for item in output:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                for part in item.get("content") or ():
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        texts.append(str(part.get("text") or ""))
                    elif isinstance(part, dict) and part.get("type") == "refusal":
                        refusals.append(str(part.get("refusal") or ""))
            elif item.get("type") == "function_call":
                calls.append({"id": item.get("call_id") or item.get("id"), "type": "function",
                              "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}})
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        finish = {"max_output_tokens": "length", "content_filter": "content_filter"}.get(reason or "") or \
            ("tool_calls" if calls else "stop")
        return base.chat_completion(response.get("id"), response.get("model"), "".join(texts) if texts else None,
                                    "".join(refusals) or None, calls, finish)

    def response_id(self, response: dict | None) -> str | None:
        rid = response.get("id") if isinstance(response, dict) else None
        return rid if isinstance(rid, str) and rid else None


def _refusal(output: list) -> str:
    """The text of the refusal parts of an answer's messages ("" without any)."""
    said = ""
    for item in output:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, dict) and part.get("type") == "refusal":
                    said += str(part.get("refusal") or "")
    return said


def _unfinished(done: dict[int, dict], begun: dict[int, dict], deltas: dict[int, list[str]]) -> dict | None:
    """The output of a stream that stopped before its end, as far as it went (None: none yet): the
    items done, and those begun with their text or arguments so far."""
    output = []
    for index in sorted(done.keys() | begun.keys() | deltas.keys()):
        if index in done:
            output.append(done[index])
            continue
        item = dict(begun.get(index) or {"type": "message", "role": "assistant"})
        text = "".join(deltas.get(index, ()))
        if item.get("type") == "function_call":
            item["arguments"] = text
        else:
            item["content"] = [{"type": "output_text", "text": text}]
        output.append(item)
    return {"object": "response", "status": "incomplete", "output": output} if output else None
