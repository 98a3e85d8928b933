"""Segment of a chat request (DESIGN §6): one bounded label per request."""

from __future__ import annotations

LONG_CONTEXT_TOKENS = 8000
CHARS_PER_TOKEN = 4


def estimate_tokens(text_chars: int) -> int:
    return (text_chars + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def message_chars(messages: list) -> int:
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"])
    return total


def content_text(content: object) -> str:
    """Text of a content string or of a list of parts/blocks with `text`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def wants_json(body: dict) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def user_turns(messages: list) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user")


def classify_segment(body: dict, task_type: str | None = None, task_types: list[str] | tuple = (),
                     before: tuple[int, int] = (0, 0)) -> str:
    """`x-task-type` when allowed, else the first of tools, json, long_context, multi_turn, chat.
    `before`: (tokens, user turns) of the conversation the request continues upstream (a Responses
    follow-up sends only its new turn)."""
    if task_type and task_type in task_types:
        return task_type
    if body.get("tools") or body.get("functions"):
        return "tools"
    if wants_json(body):
        return "json"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "chat"
    if estimate_tokens(message_chars(messages)) + before[0] > LONG_CONTEXT_TOKENS:
        return "long_context"
    if user_turns(messages) + before[1] > 2:
        return "multi_turn"
    return "chat"
