"""What a non-2xx upstream answer means: its cause (DESIGN §6), and whether it is worth a retry."""

from __future__ import annotations

# Upstream statuses worth another attempt (DESIGN §5 retry rules).
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})


def error_cause(status: int, body: dict | None) -> str:
    """Cause of a non-2xx upstream answer, from the status and OpenAI error code."""
    err = body.get("error") if isinstance(body, dict) else None
    code = str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""
    if status == 429:
        return "quota_exceeded" if code in ("insufficient_quota", "quota_exceeded", "billing_hard_limit_reached") else "rate_limited"
    if status >= 500:
        return "provider_5xx"
    if status in (401, 403):
        return "auth_error"
    if code == "context_length_exceeded" or "context_length" in code:
        return "context_length_exceeded"
    if status == 408:
        return "timeout"
    return "bad_request"
