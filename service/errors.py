"""OpenAI-shaped error responses, so the official SDKs raise their usual exception classes."""

from __future__ import annotations

import json

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

