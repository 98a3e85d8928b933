"""Schema checks on the proxy's loop stay bounded whatever schema a client sends: too deep is not a
crash, too large is not checked (nor compiled), and the compiled ones kept are few."""

from __future__ import annotations

import pytest

from service.config import MAX_SCHEMA_CHARS, Checks
from service.proxy import verifiers
from service.proxy.verifiers import fits_schema


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_past_the_checkers_reach_is_unusable_not_a_crash():
    assert fits_schema([[1]], nested(400)) == (True, None)
    assert fits_schema([1], nested(1)) == (False, "0: 1 is not of type 'string'")


def test_a_schema_too_large_to_check_is_neither_checked_nor_kept():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    before = len(verifiers._validators)
    assert fits_schema({"p1": 1}, huge) == (True, None)
    assert len(verifiers._validators) == before


def test_compiled_schemas_kept_are_bounded():
    for i in range(verifiers.VALIDATORS + 50):
        fits_schema({"a": 1}, {"type": "object", "properties": {f"a{i}": {"type": "string"}}})
    assert len(verifiers._validators) == verifiers.VALIDATORS


def test_a_configured_check_too_large_to_be_checked_is_refused():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_SCHEMA_CHARS // 20)}}
    with pytest.raises(ValueError, match="over 32 KiB is not checked"):
        Checks(json_schema=huge)


def test_a_configured_schema_is_taken_as_json_has_it():
    """YAML may give keys that are no strings (`1:`), even mixed with strings: JSON's form is checked
    and kept, never a TypeError out of config loading (found by tests/test_config_fuzz.py)."""
    checks = Checks(json_schema={"type": "object", "properties": {1: {"type": "string"}, "b": {"type": "integer"}}})
    assert checks.json_schema == {"type": "object", "properties": {"1": {"type": "string"}, "b": {"type": "integer"}}}
    assert fits_schema({"1": 5}, checks.json_schema) == (False, "1: 5 is not of type 'string'")
