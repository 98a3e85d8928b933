"""Anthropic Messages API (`POST /v1/messages`), for providers with `api: anthropic`.

Outcomes: `stop_reason` `max_tokens` is the `max_tokens` cause (blame client): `max_tokens` is
required in this API, so an answer that stops there reached the client's own cap;
`model_context_window_exceeded` is `truncated`; `refusal` is `refusal`; a `tool_use` whose input
does not fit the tool's `input_schema` (or, streamed, is not JSON) is `invalid_tool_call`. Errors
map by their `error.type`; `overloaded_error` (HTTP 529) is `provider_5xx`, the provider being out
of capacity for everyone, which is not this client's rate limit. Usage records
`cache_read_input_tokens` and `cache_creation_input_tokens` as the cache_read / cache_write token
types. A model's settings go into Messages fields (`MESSAGES_PARAMS`; its system prompt becomes the
first `system` block); chat params with no Messages field are not sent. TTFT is the first text or
tool-input delta; a stream ends at `message_stop`.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from service.config import Checks, ModelConfig
from service.errors import anthropic_error, anthropic_error_body
from service.proxy.formats import base
from service.proxy.outcome import MAX_TOKENS, Verdict, classify_chat, failed
from service.proxy.segments import content_text
from service.proxy.sse import sse_events
from service.upstream.errors import error_cause, json_object

# `error.type` -> cause (DESIGN §6)
ERROR_TYPES = {"overloaded_error": "provider_5xx", "api_error": "provider_5xx", "rate_limit_error": "rate_limited",
               "billing_error": "quota_exceeded", "authentication_error": "auth_error",
               "permission_error": "auth_error", "timeout_error": "timeout", "not_found_error": "bad_request",
               "request_too_large": "bad_request", "invalid_request_error": "bad_request"}
# a model's chat `params` -> Messages fields
MESSAGES_PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                   "top_p": "top_p", "stop": "stop_sequences"}
# `length` is the cap's (usage estimates count such an answer as its cap): an answer cut short below
# it keeps its own reason
FINISH = {"tool_use": "tool_calls", "max_tokens": "length",
          "model_context_window_exceeded": "model_context_window_exceeded"}


def _view_messages(message: dict) -> list[dict]:
    """One Messages-API message as chat view messages: tool results become `tool` messages."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(content, list):
        return [{"role": role, "content": content}]
    blocks = [b for b in content if isinstance(b, dict)]
    results = [b for b in blocks if b.get("type") == "tool_result"]
    if results and len(results) == len(blocks):
        return [{"role": "tool", "content": content_text(b.get("content"))} for b in results]
    out: dict = {"role": role, "content": [b for b in blocks if b.get("type") == "text"]}
    calls = [{"id": b.get("id"), "type": "function",
              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input"))}}
             for b in blocks if b.get("type") == "tool_use"]
    if calls:
        out["tool_calls"] = calls
    return [out]


class MessagesFormat:
    name = "messages"
    path = "/messages"
    provider_api = "anthropic"
    end_of_stream: tuple[bytes, ...] = (b'"message_stop"',)

    def has_output(self, events: bytes) -> bool:
        return b'"text_delta"' in events or b'"input_json_delta"' in events

    def check(self, body: dict) -> tuple[str, str] | None:
        if not isinstance(body.get("messages"), list):
            return "messages", "field 'messages' is required and must be an array"
        cap = body.get("max_tokens")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            return "max_tokens", "field 'max_tokens' is required and must be an integer >= 1"
        return base.tools_problem(body)

    def view(self, body: dict) -> dict:
        messages: list[dict] = []
        system = body.get("system")
        if system:
            messages.append({"role": "system", "content": system})
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                messages.extend(_view_messages(m))
        view: dict = {"messages": messages, "max_tokens": body.get("max_tokens")}
        tools = [base.function_tool(t.get("name"), t.get("input_schema")) for t in body.get("tools") or ()
                 if isinstance(t, dict) and "input_schema" in t]
        if tools:
            view["tools"] = tools
        config = body.get("output_config")
        fmt = body.get("output_format") or (config.get("format") if isinstance(config, dict) else None)
        if isinstance(fmt, dict) and (json_format := base.json_response_format(fmt.get("type"), fmt.get("schema"))):
            view["response_format"] = json_format
        return view

    def stateful(self, body: dict) -> str | None:
        """The conversation is always whole; but a container the client already has is state (its code
        execution would see and change that container's files), and the provider calls the client's
        own `mcp_servers` for each request that names them."""
        container = body.get("container")
        if isinstance(container, str) or (isinstance(container, dict) and container.get("id")):
            return "container"
        if body.get("mcp_servers"):
            return "mcp"
        return None

    def classify(self, view: dict, response: dict, checks: Checks) -> Verdict:
        if not isinstance(response.get("content"), list):
            return failed("bad_response", "no content in the message")
        stop = response.get("stop_reason")
        if stop == "refusal":
            return failed("refusal", content_text(response["content"])[:200] or None)
        if stop == "max_tokens":
            return MAX_TOKENS
        if stop == "model_context_window_exceeded":
            return failed("truncated", "the model's context window was exceeded")
        chat = self.chat_view(response)
        assert chat is not None  # content is a list
        return classify_chat(view, chat, checks)

    def error_cause(self, status: int, body: dict | None) -> str:
        err = body.get("error") if isinstance(body, dict) else None
        kind = err.get("type") if isinstance(err, dict) else None
        if status == 529:
            return "provider_5xx"
        if kind == "invalid_request_error" and isinstance(err, dict) \
                and "prompt is too long" in str(err.get("message") or "").lower():  # a kind only in a dict
            return "context_length_exceeded"
        return (ERROR_TYPES.get(kind) if kind is not None else None) or error_cause(status, body)

    def usage(self, view: dict, response: dict | None) -> base.Usage:
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
            output = usage.get("output_tokens")
            told = isinstance(output, int)  # a stream's count at its start is dropped: only the final one is told
            return base.Usage(base.token_count(usage["input_tokens"]),
                              base.token_count(output) if told else base.estimated_output(view, self.chat_view(response)),
                              cache_read=base.token_count(usage.get("cache_read_input_tokens")),
                              cache_write=base.token_count(usage.get("cache_creation_input_tokens")),
                              estimated=not told)
        return base.untold_usage(view, response, self.chat_view(response))

    def reassemble(self, raw: bytes) -> base.Reassembled:  # noqa: C901 - one pass over the SSE events, a branch per event type
        message: dict | None = None
        blocks: dict[int, dict] = {}
        tool_json: dict[int, list[str]] = {}
        ended = False
        problem: str | None = None
        cause = "bad_response"
        for name, data in sse_events(raw):
            event = json_object(data)
            if event is None:
                problem = "malformed SSE data"
                break
            kind = event.get("type") or name
            if kind == "error":
                err = found if isinstance(found := event.get("error"), dict) else {}
                problem, cause = str(err.get("message") or "error event")[:200], self.error_cause(500, event)
                break
            index = found if isinstance(found := event.get("index"), int) else 0
            if kind == "message_start" and isinstance(event.get("message"), dict):
                message = dict(event["message"])
                started = message.get("usage")  # its output_tokens is a placeholder: message_delta tells the count
                message["usage"] = {k: v for k, v in started.items() if k != "output_tokens"} \
                    if isinstance(started, dict) else {}
            elif kind == "content_block_start" and isinstance(event.get("content_block"), dict):
                blocks[index] = dict(event["content_block"])
            elif kind == "content_block_delta" and isinstance(event.get("delta"), dict):
                delta = event["delta"]
                block = blocks.setdefault(index, {"type": "text", "text": ""})
                if delta.get("type") == "text_delta":
                    block["text"] = (block.get("text") or "") + str(delta.get("text") or "")
                elif delta.get("type") == "input_json_delta":
                    tool_json.setdefault(index, []).append(str(delta.get("partial_json") or ""))
                elif delta.get("type") == "thinking_delta":
                    block["thinking"] = (block.get("thinking") or "") + str(delta.get("thinking") or "")
            elif kind == "message_delta" and message is not None:
                delta = found if isinstance(found := event.get("delta"), dict) else {}
                message.update({k: v for k, v in delta.items() if k in ("stop_reason", "stop_sequence")})
                if isinstance(event.get("usage"), dict):
                    message["usage"].update({k: v for k, v in event["usage"].items() if v is not None})
            elif kind == "message_stop":
                ended = True
        if message is None:
            return base.Reassembled(None, ended, problem or "no message_start in the stream", cause, problem is not None)
        for index, parts in tool_json.items():
            text = "".join(parts)
            try:
                blocks[index]["input"] = json.loads(text) if text else {}
            except ValueError:
                blocks[index]["input"] = text  # not JSON: kept as the model wrote it
        message["content"] = [blocks[i] for i in sorted(blocks)]
        if problem is not None:  # the answer as far as it went, its input as told at the start
            return base.Reassembled(message, False, problem, cause, broken=True)
        if not ended:
            return base.Reassembled(message, False, "stream ended before message_stop")
        return base.Reassembled(message, True)

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        return base.named_event("error", anthropic_error_body(status, message, code))

    def error_response(self, status: int, message: str, code: str | None = None, param: str | None = None,
                       headers: dict[str, str] | None = None) -> Response:
        return anthropic_error(status, message, code, param, headers)

    def model_body(self, request: dict, model: ModelConfig) -> dict:
        body = {**request, "model": model.name}
        for key, value in model.params.items():
            if key in MESSAGES_PARAMS:
                body[MESSAGES_PARAMS[key]] = [value] if key == "stop" and isinstance(value, str) else value
        if model.system_prompt is not None:
            own = request.get("system")
            if isinstance(own, str) and own:
                own = [{"type": "text", "text": own}]
            body["system"] = [{"type": "text", "text": model.system_prompt}, *own] if isinstance(own, list) and own \
                else model.system_prompt
        return body

    def shadow_body(self, request: dict, upstream_model: str) -> dict:
        body = {k: v for k, v in request.items() if k != "stream"}
        body["model"] = upstream_model
        return body

    def chat_view(self, response: dict | None) -> dict | None:
        content = response.get("content") if isinstance(response, dict) else None
        if not isinstance(response, dict) or not isinstance(content, list):  # a list only in a dict
            return None
        text = content_text(content)
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"),
                               "arguments": b["input"] if isinstance(b.get("input"), str) else json.dumps(b.get("input"))}}
                 for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
        stop = response.get("stop_reason")
        if stop == "refusal":
            return base.chat_completion(response.get("id"), response.get("model"), None, text or "refused", [], "stop")
        return base.chat_completion(response.get("id"), response.get("model"), text or None, None, calls,
                                    FINISH.get(stop or "") or ("tool_calls" if calls else "stop"))

    def response_id(self, response: dict | None) -> str | None:
        return None  # the Messages API keeps no state between requests
