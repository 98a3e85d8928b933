"""The API format extension point: how one wire format (Chat Completions, Responses, Anthropic
Messages) is read, classified and replayed. One Protocol, one file per format beside it.

Every format maps its request onto a *view* shaped like a chat request (`messages`, `tools` with
`function.parameters`, `response_format`, `max_tokens`), so that segments (`classify_segment`) and
the verifiers are the same code for every format, and its answer onto a *chat view* shaped like a
chat completion, which the shadow evaluators read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from starlette.responses import Response

from service.config import Checks, ModelConfig
from service.proxy.outcome import Verdict, choice_chars
from service.proxy.segments import estimate_tokens, message_chars
from service.proxy.sse import Reassembled as Reassembled  # what each format's `reassemble` answers


@dataclass(slots=True, frozen=True)
class Usage:
    """Tokens of one answer. `input` excludes those read from or written to a prompt cache."""

    input: int
    output: int
    cache_read: int = 0
    cache_write: int = 0
    estimated: bool = False  # counted from the text (`estimated_usage`): the upstream told none, or not its output

    @property
    def total_input(self) -> int:
        return self.input + self.cache_read + self.cache_write


class ApiFormat(Protocol):
    name: str                           # chat | responses | messages
    path: str                           # the upstream path under the provider's base_url
    provider_api: str                   # the provider `api` that speaks it: openai | anthropic
    end_of_stream: tuple[bytes, ...]    # bytes that mark the stream's terminal event

    def has_output(self, events: bytes) -> bool:
        """Whether stream events carry output: the first such event is the time to first token."""

    def check(self, body: dict) -> tuple[str, str] | None:
        """(field, problem) when the request can't be served as this format, else None."""

    def view(self, body: dict) -> dict:
        """The request as a chat-shaped view (segments, verifiers, token estimates)."""

    def stateful(self, body: dict) -> str | None:
        """Why this request is never shadowed, or None: the field naming state the upstream keeps, or
        `container` / `mcp` for tools that act on the client's own container or servers."""

    def classify(self, view: dict, response: dict, checks: Checks) -> Verdict:
        """Verdict on a 2xx answer (streamed answers reassembled first)."""

    def error_cause(self, status: int, body: dict | None) -> str:
        """Cause of a non-2xx upstream answer."""

    def usage(self, view: dict, response: dict | None) -> Usage:
        """Tokens from the answer's usage, else estimated from the text."""

    def reassemble(self, raw: bytes) -> Reassembled: ...

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        """An SSE event that tells this format's clients the stream failed."""

    def error_response(self, status: int, message: str, code: str | None = None, param: str | None = None,
                       headers: dict[str, str] | None = None) -> Response:
        """An error answer in this format's shape (an `ErrorResponse`)."""

    def model_body(self, request: dict, model: ModelConfig) -> dict:
        """The request as `model` gets it: its upstream name, its `system_prompt` first and its
        `params` (chat fields) over the client's, in this format's fields; `request` is left as it was."""

    def shadow_body(self, request: dict, upstream_model: str) -> dict:
        """The live request for another model: its upstream name, never streamed, nothing stored."""

    def chat_view(self, response: dict | None) -> dict | None:
        """The answer shaped like a chat completion (what the evaluators read), None if unreadable."""

    def response_id(self, response: dict | None) -> str | None:
        """The id the upstream stored the answer under, for follow-ups that refer to it."""


# ---- helpers the formats share -----------------------------------------------------------------


def named_event(name: str, payload: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def tools_problem(body: dict) -> tuple[str, str] | None:
    """`check`'s answer on a request's `tools`: an array when given."""
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        return "tools", "field 'tools' must be an array of tools"
    return None


def function_tool(name: object, parameters: object) -> dict:
    """A tool of the chat view."""
    return {"type": "function", "function": {"name": name, "parameters": parameters if isinstance(parameters, dict)
                                             else None}}


def json_response_format(kind: object, schema: object) -> dict | None:
    """The chat view's `response_format` for a JSON request (None for plain text)."""
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"schema": schema} if isinstance(schema, dict) else {}}
    return None


# A chat template's tokens around each message (its role, separators) and before the answer.
MESSAGE_OVERHEAD_TOKENS = 4
PROMPT_OVERHEAD_TOKENS = 3


def estimated_usage(view: dict, chat: dict | None) -> Usage:
    """The usage of an answer (`chat`: its chat view; None: no output came) whose upstream told none,
    from the text at ~4 characters a token: the messages with the chat template's tokens around them
    and the tools' JSON; each choice's output at most the request's cap, and that cap when the cap cut it."""
    return Usage(estimated_input(view), estimated_output(view, chat), estimated=True)


def estimated_input(view: dict) -> int:
    messages = view.get("messages")
    if not isinstance(messages, list):
        return 0
    calls = [m["tool_calls"] for m in messages if isinstance(m, dict) and m.get("tool_calls")]
    tools = view.get("tools")
    chars = message_chars(messages) + (len(json.dumps(calls)) if calls else 0) + \
        (len(json.dumps(tools)) if isinstance(tools, list) and tools else 0)
    return estimate_tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(messages) + PROMPT_OVERHEAD_TOKENS


def estimated_output(view: dict, chat: dict | None) -> int:
    choices = chat.get("choices") if isinstance(chat, dict) else None
    cap = output_cap(view)
    total = 0
    for choice in choices if isinstance(choices, list) else ():
        tokens = estimate_tokens(choice_chars(choice))
        if cap is not None:
            tokens = cap if isinstance(choice, dict) and choice.get("finish_reason") == "length" else min(tokens, cap)
        total += tokens
    return total


def output_cap(view: dict) -> int | None:
    """The request's cap on each choice's output tokens, if it set one."""
    for name in ("max_completion_tokens", "max_tokens"):
        cap = token_count(view.get(name))
        if cap:
            return cap
    return None


def untold_usage(view: dict, response: dict | None, chat: dict | None) -> Usage:
    """The usage of an answer that did not tell its own (`chat`: its chat view), estimated from the
    text; none without an answer (an upstream that refused or never answered bills none we know of)."""
    return Usage(0, 0) if response is None else estimated_usage(view, chat)


def token_count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def chat_completion(rid: object, model: object, content: str | None, refusal: str | None, tool_calls: list[dict],
                    finish: str) -> dict:
    """A chat view of one answer."""
    message: dict = {"role": "assistant", "content": content, "refusal": refusal}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion", "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}]}
