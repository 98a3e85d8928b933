"""What the Responses and Messages endpoints share: each asks the chat engine (so failures, content,
tool arguments and timing are the engine's own decisions, drawn the same way) and renders its
answer in its own format. Streams keep the engine's frame times, cut-offs and aborts."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

from service.simulator.engine import Engine, Reply

_dumps = json.JSONEncoder(separators=(",", ":")).encode

Chunk = dict | str | None  # a chat chunk, "[DONE]", or None for a cut-off one


def ask_chat(engine: Engine, chat_body: dict, task_type: str | None) -> Reply:
    return engine.chat(_dumps(chat_body).encode(), task_type)


def parsed(body: bytes) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None  # the engine cut it (bad_response)
    return value if isinstance(value, dict) else None


def chat_error(reply: Reply) -> dict:
    """The engine's OpenAI-shaped error: {"message", "type", "code", "param"}."""
    body = parsed(reply.body) or {}
    return body.get("error") if isinstance(body.get("error"), dict) else {"message": "error", "type": "api_error"}


def stream_chunks(reply: Reply) -> list[list[Chunk]]:
    """The chat chunks of each frame of a streamed engine reply."""
    out: list[list[Chunk]] = []
    for frame in reply.frames or ():
        chunks: list[Chunk] = []
        for event in frame.decode().split("\n\n"):
            if not event.startswith("data: "):
                continue
            data = event[6:]
            chunks.append("[DONE]" if data == "[DONE]" else parsed(data.encode()))
        out.append(chunks)
    return out


def retold(reply: Reply, cut_event: str, done: Callable[[], list[str]], chunk: Callable[[dict], list[str]]) -> Reply:
    """The engine's chat stream told in another API's events, frame by frame at the same times.

    Each chat chunk becomes `chunk(...)`'s events, `[DONE]` becomes `done()`'s, and a chunk the
    engine cut off becomes the start of a `cut_event` event."""
    frames: list[bytes] = []
    for chunks in stream_chunks(reply):
        events: list[str] = []
        for c in chunks:
            if c is None:
                events.append(cut_off(cut_event))
            elif c == "[DONE]":
                events += done()
            else:
                events += chunk(c)
        frames.append("".join(events).encode())
    return replace(reply, frames=frames)


def named_event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {_dumps(payload)}\n\n"


def cut_off(name: str) -> str:
    """The start of an event, as a connection dropped mid-stream leaves it."""
    return f'event: {name}\ndata: {{"type":"{name[: len(name) // 2]}'


def json_format(kind: object, schema: object, name: object = None) -> dict | None:
    """A chat `response_format` for a JSON request."""
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": name or "output", "schema": schema}}
    return None


def first_choice(chat: dict) -> tuple[dict, str]:
    """(message, finish reason) of a chat completion's first choice."""
    choice = (chat.get("choices") or [{}])[0]
    return choice.get("message") or {}, choice.get("finish_reason") or "stop"


def dumps(value: object) -> str:
    return _dumps(value)
