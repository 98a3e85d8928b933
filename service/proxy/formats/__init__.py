"""API formats behind one Protocol (base.py), one file per format. Translating between them is not
in scope: a route's stable and candidate share one provider `api`."""

from __future__ import annotations

from service.proxy.formats.base import ApiFormat, Reassembled, Usage
from service.proxy.formats.chat import ChatFormat
from service.proxy.formats.messages import MessagesFormat
from service.proxy.formats.responses import ResponsesFormat

__all__ = ["CHAT", "MESSAGES", "RESPONSES", "ApiFormat", "Reassembled", "Usage", "format_of"]

CHAT: ApiFormat = ChatFormat()
RESPONSES: ApiFormat = ResponsesFormat()
MESSAGES: ApiFormat = MessagesFormat()


def format_of(body: dict, provider_api: str) -> ApiFormat:
    """The format of a recorded request: Messages for an anthropic provider, Responses for a body
    with `input` and no `messages`, else Chat Completions."""
    if provider_api == "anthropic":
        return MESSAGES
    if "messages" not in body and ("input" in body or "prompt" in body):
        return RESPONSES
    return CHAT
