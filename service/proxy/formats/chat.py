"""OpenAI Chat Completions (`POST /v1/chat/completions`). The live hot path is `service.proxy.chat`;
this wraps the same functions for the shadow workers and for code that handles every format."""

from __future__ import annotations

from starlette.responses import Response

from service.config import Checks, ModelConfig
from service.errors import error_body, openai_error
from service.proxy.formats.base import Reassembled, Usage, estimated_usage, token_count
from service.proxy.outcome import Verdict, classify_chat
from service.proxy.sse import chat_has_output, reassemble
from service.upstream.errors import error_cause
from service.upstream.model_settings import model_body

SHADOW_DROPPED = ("stream", "stream_options", "store", "metadata")  # a shadow call is never streamed nor stored


class ChatFormat:
    name = "chat"
    path = "/chat/completions"
    provider_api = "openai"
    end_of_stream: tuple[bytes, ...] = (b"data: [DONE]",)

    def has_output(self, events: bytes) -> bool:
        return chat_has_output(events)

    def check(self, body: dict) -> tuple[str, str] | None:
        if not isinstance(body.get("messages"), list):
            return "messages", "field 'messages' is required and must be an array"
        return None

    def view(self, body: dict) -> dict:
        return body

    def stateful(self, body: dict) -> str | None:
        return None

    def classify(self, view: dict, response: dict, checks: Checks) -> Verdict:
        return classify_chat(view, response, checks)

    def error_cause(self, status: int, body: dict | None) -> str:
        return error_cause(status, body)

    def usage(self, view: dict, response: dict | None) -> Usage:
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            return Usage(token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens")))
        if response is None:
            return Usage(0, 0)
        return estimated_usage(view, response)

    def reassemble(self, raw: bytes) -> Reassembled:
        return reassemble(raw)

    def stream_error(self, status: int, message: str, code: str) -> bytes:
        return b"data: " + error_body(status, message, code) + b"\n\n"

    def error_response(self, status: int, message: str, code: str | None = None, param: str | None = None,
                       headers: dict[str, str] | None = None) -> Response:
        return openai_error(status, message, code, param, headers)

    def model_body(self, request: dict, model: ModelConfig) -> dict:
        return model_body(request, model)

    def shadow_body(self, request: dict, upstream_model: str) -> dict:
        body = {k: v for k, v in request.items() if k not in SHADOW_DROPPED}
        body["model"] = upstream_model
        return body

    def chat_view(self, response: dict | None) -> dict | None:
        return response if isinstance(response, dict) else None

    def response_id(self, response: dict | None) -> str | None:
        return None  # chat completions are not referred to by later requests
