"""A golden set: one case per line of a JSONL file (README "Before the canary: replay").

A case is a live request with what the stable model answered (`live`), where it came from
(`request_id`, `route`, `segment`, `config_version`) and, when the application said so, its
`feedback`. A team curates the file: deletes cases, adds hand-written ones, tags them
(`tags: [edge]`) and adds `checks` that make a case verifiable:

- `expected`: the expected answer (text, or a JSON value for a JSON request), passed when the
  answer is at least `min_similarity` similar to it (default: the route's `agree_at`);
- `json_schema`: the answer's content must be JSON that fits this schema;
- `tool_call`: the answer must call the tool `name`, with each of `arguments` present and
  matching (a string is a regular expression for the whole value, anything else must be equal).

`load(path)` validates every line and raises DatasetError with one "line N: field: reason" per
problem; `write(path, cases)` writes a file that `load` reads back (`check_writable(path)` first
tells whether it can), replacing the old file only once the new one is whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.config import ConfigError, check_regex, valid_schema, validated
from service.records import PrimaryResult

SCHEMA = "modelcanary.case/v1"
MAX_PROBLEMS = 20  # reported per file; the rest are counted


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ToolCallCheck(Strict):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = {}

    @field_validator("arguments")
    @classmethod
    def _patterns_compile(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, pattern in v.items():
            if isinstance(pattern, str):
                check_regex(pattern, f"argument {key!r}: ")
        return v


class CaseChecks(Strict):
    expected: Any = None
    min_similarity: float | None = Field(None, ge=0.0, le=1.0)
    json_schema: dict | None = None
    tool_call: ToolCallCheck | None = None

    _schema_is_valid = field_validator("json_schema")(valid_schema)

    @property
    def kinds(self) -> list[str]:
        """The checks this case carries, by name."""
        return [k for k in ("expected", "json_schema", "tool_call") if getattr(self, k) is not None]


class Feedback(Strict):
    success: bool
    reason: str | None = None


class Case(Strict):
    schema_: Literal["modelcanary.case/v1"] = Field(SCHEMA, alias="schema")
    request_id: str = Field(min_length=1)
    ts: float = 0.0
    route: str
    segment: str = "chat"
    fingerprint: str | None = None
    config_version: str | None = None
    request: dict
    headers: dict[str, str] | None = None   # the client's headers a replay repeats (anthropic-version, -beta)
    live: PrimaryResult | None = None       # the stable model's live answer (none for a hand-written case)
    feedback: Feedback | None = None
    checks: CaseChecks | None = None
    tags: list[str] = []

    @field_validator("headers")
    @classmethod
    def _repeatable_headers(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for name, value in (v or {}).items():
            if not name.lower().startswith("anthropic-"):
                raise ValueError(f"{name!r}: only the client's anthropic-* headers are repeated")
            if "\r" in value or "\n" in value:
                raise ValueError(f"{name!r}: the value has a line break")
        return v

    @field_validator("live")
    @classmethod
    def _token_counts(cls, v: PrimaryResult | None) -> PrimaryResult | None:
        for key in ("prompt_tokens", "completion_tokens"):
            n = (v.usage or {}).get(key) if v is not None else None
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
                raise ValueError(f"usage.{key} must be a whole number of tokens, got {n!r}")
        return v

    @property
    def check_kinds(self) -> list[str]:
        return self.checks.kinds if self.checks is not None else []


class DatasetError(Exception):
    """A dataset that can't be used; `problems` are 'line N: field: reason' lines."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))

    def explain(self) -> str:
        shown = self.problems[:MAX_PROBLEMS]
        more = len(self.problems) - len(shown)
        return "\n".join([f"error: dataset {self.source} is not valid:", *(f"  {p}" for p in shown),
                          *([f"  (+{more} more)"] if more > 0 else [])])


# Request fields that do not change what is asked: left out of the fingerprint.
_DELIVERY_FIELDS = ("stream", "stream_options", "user", "metadata", "store")


def fingerprint(route: str, request: dict) -> str:
    """The same question on the same route: a hash of the request without its delivery fields."""
    body = {k: v for k, v in request.items() if k not in _DELIVERY_FIELDS}
    text = json.dumps([route, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:16]  # a lone surrogate hashes too


def _read(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(str(p), ["file not found"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(str(p), [f"cannot read file: {e}"]) from None


def load(path: str | Path) -> list[Case]:
    """Every case of the file, or DatasetError naming each bad line and field."""
    p = Path(path)
    text = _read(p)
    cases: list[Case] = []
    problems: list[str] = []
    first_line: dict[str, int] = {}
    for n, line in enumerate(text.split("\n"), start=1):  # not splitlines(): U+2028 may stand in a string
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as e:
            problems.append(f"line {n}: not JSON: {e}")
            continue
        try:
            case = validated(Case, data, f"line {n}")
        except ConfigError as e:
            problems.extend(f"line {n}: {problem}" for problem in e.problems)
            continue
        if case.request_id in first_line:
            problems.append(f"line {n}: request_id: {case.request_id!r} is already the case on line "
                            f"{first_line[case.request_id]}")
            continue
        first_line[case.request_id] = n
        if case.fingerprint is None:
            case.fingerprint = fingerprint(case.route, case.request)
        cases.append(case)
    if problems:
        raise DatasetError(str(p), problems)
    if not cases:
        raise DatasetError(str(p), ["no cases (the file is empty)"])
    return cases


def line_of(case: Case) -> str:
    data = case.model_dump(mode="json", by_alias=True, exclude_none=True)
    line = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    try:
        line.encode()
    except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800" in a request): kept as its escape
        return json.dumps(data, separators=(",", ":"))
    return line


def check_writable(path: str | Path) -> None:
    """Whether `write(path, ...)` can create or replace the file: ValueError saying why not.
    An existing file is left as it was, and no new one behind."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{str(path)!r} is a directory; give a file, e.g. {p / 'golden.jsonl'}")
    parent = p.parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise ValueError(f"cannot write {str(path)!r}: the directory {str(parent)!r} {what}")
    existed = p.exists()
    probe = _beside(Path(os.path.realpath(p)))
    try:
        with open(p, "a", encoding="utf-8"):
            pass
        with probe.open("x"):  # `write` needs a file of its own there
            pass
    except OSError as e:
        raise ValueError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        probe.unlink(missing_ok=True)
    if not existed:
        p.unlink(missing_ok=True)


def write(path: str | Path, cases: Iterable[Case]) -> int:
    """Write the cases, one JSON object per line; returns how many. They go to a file beside `path`
    that replaces it once complete: a write that fails or is interrupted leaves the old file as it was."""
    target = Path(os.path.realpath(path))  # a symlinked golden set stays a link, to the new file
    partial = _beside(target)
    n = 0
    try:
        with partial.open("x", encoding="utf-8") as out:
            for case in cases:
                out.write(line_of(case) + "\n")
                n += 1
            out.flush()
            os.fsync(out.fileno())
        if target.exists():
            os.chmod(partial, target.stat().st_mode & 0o7777)  # the curated file's permissions
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return n


def _beside(path: Path) -> Path:
    """A new hidden file's name in `path`'s directory: `write`'s new set until it is complete."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")


def stats(cases: list[Case]) -> dict:
    """Counts per route and segment: cases, cases with checks (and of each kind), with feedback, tags."""
    routes: dict[str, dict[str, dict]] = {}
    for case in cases:
        row = routes.setdefault(case.route, {}).setdefault(case.segment, {
            "cases": 0, "with_checks": 0, "checks": {}, "feedback": {"success": 0, "failure": 0}, "tags": {}})
        row["cases"] += 1
        kinds = case.check_kinds
        if kinds:
            row["with_checks"] += 1
        for kind in kinds:
            row["checks"][kind] = row["checks"].get(kind, 0) + 1
        if case.feedback is not None:
            row["feedback"]["success" if case.feedback.success else "failure"] += 1
        for tag in case.tags:
            row["tags"][tag] = row["tags"].get(tag, 0) + 1
    return {"cases": len(cases), "with_checks": sum(1 for c in cases if c.check_kinds),
            "routes": {route: dict(sorted(segs.items())) for route, segs in sorted(routes.items())}}
