"""What a non-2xx upstream answer means: its cause (DESIGN §6), and whether it is worth a retry.

The error bodies of the servers we front, as they document or send them:

- OpenAI: `{"error": {"message", "type", "param", "code"}}`; codes `context_length_exceeded`,
  `rate_limit_exceeded`, `insufficient_quota` (both 429), `invalid_api_key`; 503 when overloaded.
- llama-cpp-python's server (tested for real): the OpenAI shape with code `context_length_exceeded`;
  a request it cannot validate is a 500 whose message is pydantic's "N validation error(s)".
- llama.cpp's own `llama-server`: `{"error": {"code": 400, "type": "exceed_context_size_error", ...}}`.
- vLLM: `{"error": {"message": "This model's maximum context length is …", "type": "BadRequestError",
  "code": 400}}`; older releases put those fields at the top level (`"object": "error"`).
- Ollama: `{"error": "the input length exceeds the context length"}`, a string; its /v1 endpoints use
  the OpenAI shape with types `invalid_request_error`, `not_found_error`, `api_error`.
- Anthropic-style gateways: 529 `overloaded_error`.

An error none of these explain gets the cause of its HTTP class: `bad_request` (4xx, client),
`provider_5xx` (5xx), `bad_response` (anything else, e.g. a redirect).
"""

from __future__ import annotations

import json
import re

# Upstream statuses worth another attempt (DESIGN §5 retry rules); 529: overloaded.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504, 529})

CLIENT_CAUSES = frozenset({"auth_error", "bad_request", "context_length_exceeded"})

_QUOTA_CODES = frozenset({"insufficient_quota", "quota_exceeded", "billing_hard_limit_reached",
                          "billing_not_active"})
_CONTEXT_CODES = frozenset({"context_length_exceeded", "context_window_exceeded", "exceed_context_size_error"})
_CONTENT_FILTER_CODES = frozenset({"content_filter", "content_policy_violation"})
_CONTEXT_MESSAGE = re.compile(
    r"maximum context length|context length|context window|context size|prompt is too long"
    r"|exceeds? (?:the )?(?:model'?s? )?(?:max(?:imum)? )?(?:context|input length)", re.IGNORECASE)
# pydantic's message, which llama-cpp-python's server answers with status 500 for a request it rejects
_VALIDATION_MESSAGE = re.compile(r"^\d+ validation errors?\b.*'loc': \('body'", re.DOTALL)


def json_object(raw: bytes) -> dict | None:
    """An answer's body as a JSON object, or None when it is not one."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def unexplained(status: int, body: bytes) -> str:
    """The message for an upstream error that is no JSON: its start (an HTML page, plain text) kept."""
    text = body[:500].decode("utf-8", "replace").strip()
    return f"upstream answered HTTP {status}" + (f": {text}" if text else "")


def error_fields(body: dict | None) -> tuple[str, str]:
    """(code or type, message) of an upstream error body, whatever its shape; empty when absent."""
    if not isinstance(body, dict):
        return "", ""
    err = body.get("error")
    if isinstance(err, str):  # Ollama
        return "", err
    if not isinstance(err, dict):  # older vLLM: the fields at the top level
        err = body if "message" in body else {}
    code = err.get("code")
    kind = err.get("type")
    label = code if isinstance(code, str) and code else kind if isinstance(kind, str) else ""
    message = err.get("message")
    return label, message if isinstance(message, str) else ""


def error_cause(status: int, body: dict | None) -> str:
    """Cause of a non-2xx upstream answer, from its status and error body."""
    label, message = error_fields(body)
    if status == 429 or status == 402:
        return "quota_exceeded" if status == 402 or label in _QUOTA_CODES else "rate_limited"
    if label in _QUOTA_CODES:
        return "quota_exceeded"
    if label in _CONTEXT_CODES or (400 <= status < 500 and _CONTEXT_MESSAGE.search(message)):
        return "context_length_exceeded"
    if status in (401, 403):
        return "auth_error"
    if label in _CONTENT_FILTER_CODES:
        return "content_filtered"
    if status == 408:
        return "timeout"
    if 400 <= status < 500:
        return "bad_request"
    if status >= 500:
        return "bad_request" if _VALIDATION_MESSAGE.search(message) else "provider_5xx"
    return "bad_response"


# an error reported inside a 200 answer (a stream's error event, a failed response): no status says
# what it was, only its code
IN_ANSWER_CODES = {"rate_limit_exceeded": "rate_limited", "server_error": "provider_5xx", "vector_store_timeout": "timeout",
                   "context_length_exceeded": "context_length_exceeded", "insufficient_quota": "quota_exceeded"}


def in_answer_cause(code: object) -> str:
    if isinstance(code, str):
        if code in IN_ANSWER_CODES:
            return IN_ANSWER_CODES[code]
        if code.startswith("invalid_") or code.endswith("_not_found"):
            return "bad_request"
    return "provider_5xx"
