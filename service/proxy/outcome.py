"""Outcome and failure attribution (DESIGN §6), shared by live traffic and shadow calls."""

from __future__ import annotations

from dataclasses import dataclass

from service.config import Checks
from service.proxy.segments import content_text, wants_json
from service.proxy.verifiers import check_json, check_tool_calls, requested_schema
from service.records import Blame, Outcome
from service.upstream.model_settings import requested_cap

CAUSE_BLAME: dict[str, Blame] = {
    "timeout": "provider",
    "connection_error": "provider",
    "rate_limited": "provider",
    "quota_exceeded": "provider",
    "provider_5xx": "provider",
    "bad_response": "provider",
    "auth_error": "client",
    "bad_request": "client",
    "context_length_exceeded": "client",
    "max_tokens": "client",  # the answer reached the request's own cap (DESIGN §12)
    "content_filtered": "model",
    "refusal": "model",
    "truncated": "model",
    "empty_output": "model",
    "invalid_json": "model",
    "schema_violation": "model",
    "invalid_tool_call": "model",
    "client_cancelled": "client",
    "proxy_error": "proxy",
    "draining": "proxy",  # a stream still open when server.drain_seconds ran out, cut on shutdown
}

@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome  # completed | failed
    cause: str | None = None
    blame: Blame | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "completed"


COMPLETED = Verdict("completed")
# The answer reached the request's own length cap: whole as asked, so completed; the cause lets the
# judge compare how often each arm runs into the cap (`max_tokens_rate`), outside every failure rate.
MAX_TOKENS = Verdict("completed", "max_tokens", "client")


def failed(cause: str, detail: str | None = None) -> Verdict:
    return Verdict("failed", cause, CAUSE_BLAME[cause], detail)


def upstream_refused(cause: str, client_credential: bool) -> Verdict:
    """The verdict on an upstream's error answer. A refused credential is the client's fault only when
    the client's own key went upstream; else it was the key the proxy holds, or none: its configuration."""
    if cause == "auth_error" and not client_credential:
        return Verdict("failed", cause, "proxy", "the provider refused the proxy's credentials")
    return failed(cause)


def classify_chat(request: dict, response: dict, checks: Checks, chunks: int | None = None) -> Verdict:  # noqa: C901 - the outcome rules in their order of precedence (DESIGN §6)
    """Verdict on a successful (2xx) chat completion body, streamed answers reassembled first.
    `request` is what the model was asked (a model's `params` included); `chunks`, a streamed answer's
    number of chunks. Every choice (`n` > 1) is judged: the first that failed fails the answer (the
    client did not get all it asked for), else one cut at the request's cap makes it `max_tokens`."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        return failed("bad_response", "no choices in the answer")
    verdict = COMPLETED
    for choice in choices:
        if not isinstance(choice, dict):
            return failed("bad_response", "a choice is not an object")
        message = choice.get("message")
        if not isinstance(message, dict):
            return failed("bad_response", "choice without a message")
        finish = choice.get("finish_reason")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            if not isinstance(content, list):
                return failed("bad_response", "message content is neither text nor a list of parts")
            content = content_text(content)
        tool_calls = message.get("tool_calls") or []
        if finish == "content_filter":
            return failed("content_filtered")
        if message.get("refusal"):
            return failed("refusal", str(message["refusal"])[:200])
        if finish == "length":
            cap = requested_cap(request)
            if cap is None or not _reached(response, choices, cap, chunks):
                return failed("truncated")
            verdict = MAX_TOKENS
            continue
        if tool_calls:
            if not isinstance(tool_calls, list):
                return failed("bad_response", "tool_calls is not a list")
            problem = check_tool_calls(tool_calls, request, checks.require_tool_args_valid)
            if problem:
                return failed("invalid_tool_call", problem)
            continue
        if not content:
            return failed("empty_output")
        if wants_json(request) or checks.json_schema is not None:
            cause, detail = check_json(content, requested_schema(request, checks.json_schema))
            if cause:
                return failed(cause, detail)
    return verdict


def _reached(response: dict, choices: list, cap: int, chunks: int | None) -> bool:
    """Whether the choices cut by `length` used their whole cap: by the usage; without usage (llama.cpp's
    streams), by a stream's chunks, a token each or a few where a server groups them (under a quarter
    of the cap, the stop was not the cap's: the context filled up, say); an answer without either is
    taken as the cap's. Usage and chunks count every choice (`n` > 1): each cut choice must hold a cap
    of its share of them."""
    usage = response.get("usage")
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(used, int):
        return _each_cut_holds(used, cap, choices)
    return chunks is None or _each_cut_holds(4 * chunks, cap, choices)


def _each_cut_holds(total: int, need: int, choices: list) -> bool:
    """Whether `total` (tokens or chunks of every choice) holds `need` for each choice cut by `length`:
    all of it with one choice. Else the choices that were not cut hold their share of it by their
    characters (one model, one tokenizer: about as many characters a token in each), and the cut ones
    share the rest evenly: they ran to one limit, the cap or the context (the prompt is the same)."""
    if len(choices) == 1:
        return total >= need
    sizes = [choice_chars(c) for c in choices]
    cut = [size for c, size in zip(choices, sizes) if c.get("finish_reason") == "length"]
    if not any(sizes):
        return total >= need * len(choices)
    return total * sum(cut) >= need * len(cut) * sum(sizes)


def choice_chars(choice: object) -> int:
    """Characters of text, refusal and tool arguments in one choice of a chat view."""
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        return 0
    chars = len(content_text(message.get("content")))
    refusal = message.get("refusal")
    chars += len(refusal) if isinstance(refusal, str) else 0
    tool_calls = message.get("tool_calls")
    for tc in tool_calls if isinstance(tool_calls, list) else ():
        fn = tc.get("function") if isinstance(tc, dict) else None
        arguments = fn.get("arguments") if isinstance(fn, dict) else None
        chars += len(arguments) if isinstance(arguments, str) else 0
    return chars
