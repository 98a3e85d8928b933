"""Error responses in each API's own shape (OpenAI's for Chat Completions and Responses, Anthropic's for
Messages), so the official SDKs raise their usual exception classes."""

from __future__ import annotations

import json
from typing import Protocol

from starlette.responses import Response

TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
                  415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                  502: "upstream_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               type_: str | None = None) -> bytes:
    err = {"message": message, "type": type_ or TYPE_BY_STATUS.get(status, "api_error"), "code": code, "param": param}
    return json.dumps({"error": err}).encode()


def openai_error(status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type_: str | None = None) -> Response:
    return Response(error_body(status, message, code, param, type_), status_code=status,
                    media_type="application/json", headers=headers)



class ErrorResponse(Protocol):
    """How one API format answers an error: OpenAI's shape (`openai_error`) or Anthropic's."""

    def __call__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> Response: ...


ANTHROPIC_TYPE_BY_STATUS = {401: "authentication_error", 402: "billing_error", 403: "permission_error",
                            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                            503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`; the proxy's own
    `code` and `param` ride along in `error`, where Anthropic's clients ignore them."""
    kind = "timeout_error" if code == "timeout" else ANTHROPIC_TYPE_BY_STATUS.get(
        status, "api_error" if status >= 500 else "invalid_request_error")
    err: dict = {"type": kind, "message": message}
    if code is not None:
        err["code"] = code
    if param is not None:
        err["param"] = param
    return {"type": "error", "error": err}


def anthropic_error(status: int, message: str, code: str | None = None, param: str | None = None,
                    headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(anthropic_error_body(status, message, code, param)).encode(), status_code=status,
                    media_type="application/json", headers=headers)
