"""What `capture` redacts in a request or an answer before it goes into a golden set.

- Every string gets the text patterns: the route's `shadow.redact` ones, then the credential ones
  (bearer tokens, `sk-…` keys).
- The value under a credential key (`password`, `api_key`, `authorization`, …, in any case style:
  `accessToken`, `client-secret`) is replaced by [REDACTED], at any depth.
- Keys get the text patterns too (an email used as a key); two keys that become the same keep both
  values (`[REDACTED]`, `[REDACTED] 2`).
- Tool-call arguments and tool results are JSON inside a string (`tool_calls[].function.arguments`,
  Responses `function_call.arguments` and `function_call_output.output`, a streamed Anthropic
  `tool_use.input`, a `tool` or legacy `function` message's content, Anthropic `tool_result.content`): when such a string
  is a JSON object or array it is parsed, redacted like the rest and written back as a string (the
  original text when nothing in it was redacted).
- Schemas are not data: under a tool's parameters (`tools[].function.parameters`, Responses
  `tools[].parameters`, Anthropic `tools[].input_schema`, legacy `functions[].parameters`) and a JSON
  output schema (`response_format.json_schema.schema`, Responses `text.format.schema`, Anthropic
  `output_format.schema` / `output_config.format.schema`) keys are kept and no value is replaced
  (a property named `password` stays a schema); their strings and keys still get the text patterns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from service.proxy.recorder import unique_key

REDACTED = "[REDACTED]"
# Keys whose value is a credential wherever they appear in a request or an answer, in any case
# style: compared lower-cased without `_` and `-` (`accessToken`, `access-token`, `ACCESS_TOKEN`).
CREDENTIAL_KEYS = frozenset({"authorization", "proxyauthorization", "apikey", "xapikey", "accesstoken",
                             "refreshtoken", "idtoken", "authtoken", "sessiontoken", "bearertoken",
                             "clientsecret", "password", "passwd", "secret", "secretkey", "awssecretaccesskey",
                             "privatekey"})
# Credentials pasted into text: bearer tokens and API keys of the common "sk-…" shape.
CREDENTIAL_PATTERNS = [re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"),
                       re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}")]

# Where a request or an answer holds a JSON schema, from its top ("[]": any item of a list).
SCHEMA_PATHS = frozenset({
    ("tools", "[]", "function", "parameters"),        # Chat Completions
    ("functions", "[]", "parameters"),                # Chat Completions, legacy functions
    ("tools", "[]", "parameters"),                    # Responses (a request, and a response's echo)
    ("tools", "[]", "input_schema"),                  # Anthropic Messages
    ("response_format", "json_schema", "schema"),     # Chat Completions
    ("text", "format", "schema"),                     # Responses
    ("output_format", "schema"),                      # Anthropic Messages
    ("output_config", "format", "schema"),            # Anthropic Messages
})
# Content blocks and items whose `input` is a tool call's arguments (an object, or text when streamed).
_TOOL_USE_TYPES = frozenset({"tool_use", "server_tool_use", "mcp_tool_use", "custom_tool_call"})
# Items whose `output` is a tool's result.
_TOOL_OUTPUT_TYPES = frozenset({"function_call_output", "custom_tool_call_output", "mcp_call"})

Path = tuple[str, ...] | None  # None: not a position from the top of a request or an answer


def redact(value: object, patterns: Sequence[re.Pattern] = ()) -> object:
    """`value` (a request or an answer) redacted: `patterns` (a route's `shadow.redact`) and the
    credential rules, as the module's docstring says."""
    return _walk(value, [*patterns, *CREDENTIAL_PATTERNS], ())


def scrub_credentials(value: object) -> object:
    """The credential rules alone: values under credential keys, and credential-shaped strings, redacted."""
    return redact(value)


def _credential_key(key: object) -> bool:
    return isinstance(key, str) and key.lower().replace("_", "").replace("-", "") in CREDENTIAL_KEYS


def _walk(value: object, patterns: list[re.Pattern], path: Path, json_text: bool = False) -> object:
    """`value` at `path` redacted; `json_text`: its strings may be JSON (tool arguments, tool results)."""
    if isinstance(value, str):
        return _json_text(value, patterns) if json_text else _text(value, patterns)
    if isinstance(value, list):
        item = None if path is None else (*path, "[]")
        return [_walk(v, patterns, item, json_text) for v in value]
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            sub = None if path is None else (*path, str(k))
            if _credential_key(k):
                v = REDACTED
            elif sub in SCHEMA_PATHS:
                v = _schema(v, patterns)
            else:
                v = _walk(v, patterns, sub, json_text or _holds_json(value, k))
            out[_key(out, k, patterns)] = v
        return out
    return value


def _key(taken: dict, key: object, patterns: list[re.Pattern]) -> object:
    """A key with the text patterns applied, not one `taken` already holds."""
    return unique_key(taken, _text(key, patterns) if isinstance(key, str) else key)


def _holds_json(parent: dict, key: object) -> bool:
    """Whether `parent[key]` is a place where a string is JSON: a tool call's arguments or a tool's result."""
    kind, role = parent.get("type"), parent.get("role")
    if not isinstance(kind, str):
        kind = None
    return (key == "arguments"
            or (key == "input" and kind in _TOOL_USE_TYPES)
            or (key == "output" and kind in _TOOL_OUTPUT_TYPES)
            or (key == "content" and (role in ("tool", "function") or kind == "tool_result")))


def _schema(value: object, patterns: list[re.Pattern]) -> object:
    """A schema: keys and structure kept, no value replaced; only its strings get the text patterns."""
    if isinstance(value, str):
        return _text(value, patterns)
    if isinstance(value, list):
        return [_schema(v, patterns) for v in value]
    if isinstance(value, dict):
        out: dict = {}
        for k, v in value.items():
            out[_key(out, k, patterns)] = _schema(v, patterns)
        return out
    return value


def _json_text(text: str, patterns: list[re.Pattern]) -> str:
    """A string that may be a JSON object or array: parsed, redacted inside and written back (the same
    text when nothing was redacted); then, like any string, the text patterns."""
    if text.lstrip()[:1] in ("{", "["):
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, (dict, list)):
            cleaned = _walk(parsed, patterns, None)
            if cleaned != parsed:
                text = json.dumps(cleaned, ensure_ascii=False)
    return _text(text, patterns)


def _text(text: str, patterns: list[re.Pattern]) -> str:
    for p in patterns:
        text = p.sub(REDACTED, text)
    return text
