"""Checks on a model's answer: JSON validity, schema conformance, tool-call validity."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from referencing.exceptions import Unresolvable

from service.config import MAX_SCHEMA_CHARS  # larger ones (a client's to choose) are not checked

VALIDATORS = 128  # compiled schemas kept, the least recently used forgotten first
_validators: OrderedDict[bytes, Draft202012Validator | None] = OrderedDict()


def _validator(schema_json: str) -> Draft202012Validator | None:
    key = hashlib.blake2b(schema_json.encode(), digest_size=16).digest()
    if key in _validators:
        _validators.move_to_end(key)
        return _validators[key]
    try:
        schema = json.loads(schema_json)
        Draft202012Validator.check_schema(schema)
        validator: Draft202012Validator | None = Draft202012Validator(schema)
    except (ValueError, SchemaError, RecursionError):  # RecursionError: nested deeper than the checker goes
        validator = None
    _validators[key] = validator
    if len(_validators) > VALIDATORS:
        _validators.popitem(last=False)
    return validator


def fits_schema(value: object, schema: dict) -> tuple[bool, str | None]:
    """(ok, first problem). An unusable schema, or one too large to check, is not held against the model."""
    schema_json = json.dumps(schema, sort_keys=True)
    if len(schema_json) > MAX_SCHEMA_CHARS:
        return True, None
    validator = _validator(schema_json)
    if validator is None:
        return True, None
    try:
        error = next(iter(validator.iter_errors(value)), None)
    except (Unresolvable, RecursionError):  # a `$ref` to nothing or to another document, or a loop of them
        return True, None
    if error is None:
        return True, None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return False, f"{where}: {error.message[:200]}"


def requested_schema(request: dict, configured: dict | None) -> dict | None:
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if isinstance(schema, dict):
            return schema
    return configured


def check_json(content: str | None, schema: dict | None) -> tuple[str | None, str | None]:
    """(cause, detail) for a JSON answer: invalid_json, schema_violation or None."""
    try:
        value = json.loads(content or "")
    except ValueError as e:
        return "invalid_json", f"not JSON: {e}"[:200]
    if schema is not None:
        ok, problem = fits_schema(value, schema)
        if not ok:
            return "schema_violation", problem
    return None, None


def _tool_schemas(request: dict) -> dict[str, dict | None]:
    tools = {}
    for tool in request.get("tools") or ():
        if isinstance(tool, dict):
            fn = tool.get("function") or {}
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                tools[fn["name"]] = params if isinstance(params, dict) else None
    for fn in request.get("functions") or ():
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            tools[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else None
    return tools


def check_tool_calls(tool_calls: list, request: dict, check_args: bool) -> str | None:
    """A problem with the model's tool calls, or None: unknown name, non-JSON or schema-misfit arguments."""
    known = _tool_schemas(request)
    for call in tool_calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return "tool call without a function"
        name = fn.get("name")
        if not isinstance(name, str):
            return "tool call without a function name"
        if known and name not in known:
            return f"unknown function {name!r}"
        if not check_args:
            continue
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, str):
            return f"arguments of {name!r} are not a string of JSON"
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            return f"arguments of {name!r} are not JSON"
        schema = known.get(name)
        if schema is not None:
            ok, problem = fits_schema(args, schema)
            if not ok:
                return f"arguments of {name!r} do not fit its schema: {problem}"
    return None
