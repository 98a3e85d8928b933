"""What the simulated models answer: deterministic content, seeded failures, latency draws.

The engine knows nothing about sockets. Each request becomes a `Reply`: a status and
body (or SSE frames with their send times), the delay before sending, or a hang.

Determinism. Content is a function of (seed, prompt, variant) only, so every model
gives the same content to the same prompt (variant 0), in its own wording on each call
(facts.py: text states facts, rephrased per call; JSON keeps its values, with its keys and
spacing laid out anew). Per call, each model's own RNG (derived from the seed and the model
name) draws, in a fixed order and always the same number of times: one uniform per failure
kind (FAILURE_KINDS order), divergence, variant, alternative, latency, time to first token,
wrong content, wording and the judge's error. The first failure that fires and applies to
the request wins. Same seed + same request sequence = same outcomes.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import math
import os
import random
import time
from array import array
from bisect import bisect_right
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from service.proxy.segments import CHARS_PER_TOKEN, classify_segment, estimate_tokens, message_chars
from service.simulator import judge
from service.simulator.config import FAILURE_KINDS, Effective, SimModel, SimulatorConfig, resolve
from service.simulator.facts import fact_count, facts, render, wrong_facts

_dumps = json.JSONEncoder(separators=(",", ":")).encode
_loads = json.loads
_inv_cdf = NormalDist().inv_cdf

# ---------------------------------------------------------------- replies


@dataclass(slots=True)
class Reply:
    """One response: a body sent after `delay`, SSE `frames` sent at `times`, or a hang."""

    status: int = 200
    body: bytes = b""
    content_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    delay: float = 0.0
    frames: list[bytes] | None = None   # SSE: frame k is written `times[k]` s after arrival
    times: list[float] | None = None
    hang: bool = False                  # never answer (the client's timeout fires)
    abort: bool = False                 # close the connection after the last frame, mid-stream


def error_reply(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                headers: tuple[tuple[bytes, bytes], ...] = (), delay: float = 0.0) -> Reply:
    body = _dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
    return Reply(status=status, body=body, headers=headers, delay=delay)


def bad_json_reply() -> Reply:
    return error_reply(
        400,
        "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
        "HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON.)",
        "invalid_request_error",
    )


def missing_param(param: str) -> Reply:
    return error_reply(400, f"Missing required parameter: '{param}'.", "invalid_request_error",
                       "missing_required_parameter", param)


def invalid_param(param: str | None, message: str) -> Reply:
    return error_reply(400, message, "invalid_request_error", "invalid_value", param)


def invalid_api_key_reply() -> Reply:
    return error_reply(401, "Incorrect API key provided. You can find your API key at "
                       "https://platform.openai.com/account/api-keys.", "invalid_request_error", "invalid_api_key")


# ---------------------------------------------------------------- text

WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which have not but all can "
    "their has more one will about when there so if what out up into than them some time only other new may "
    "would these two first any like our also could over such after where most should well use through back "
    "much before good because each work very through system data model answer service request value result "
    "account billing invoice order payment customer support search query report account policy refund plan "
    "price update status error issue ticket review change number user team project product release version "
    "feature option setting access level total amount balance period month week today account record field "
    "simple clear quick direct useful correct complete careful safe stable exact recent current possible "
    "check confirm explain provide describe compare return include require suggest consider follow review "
    "help show find make give take keep send note open close start stop move read write build test run"
).split()
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in order

REFUSAL_TEXT = "I'm sorry, but I can't help with that request."
_MASK64 = (1 << 64) - 1
_MAX_FRAMES = 128


def _key(seed: int, *parts: object) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(str(seed).encode())
    for p in parts:
        h.update(b"\x00")
        h.update(p if isinstance(p, bytes) else str(p).encode())
    return int.from_bytes(h.digest(), "little")


def _unit(key: int) -> float:
    """A uniform in (0, 1) from a 64-bit key."""
    return ((key >> 11) + 0.5) / 9007199254740992.0


def lognormal(mu_sigma: tuple[float, float], u: float) -> float:
    mu, sigma = mu_sigma
    if mu == -math.inf:
        return 0.0
    if sigma == 0.0:
        return math.exp(mu)
    return math.exp(mu + sigma * _inv_cdf(min(max(u, 1e-12), 1.0 - 1e-12)))


def text_pieces(key: int, n: int) -> list[str]:
    """n words as stream pieces (one token each): sentences, capitalised, with full stops.

    Prefix-consistent: the first k pieces for n words equal the pieces for k words,
    except the closing full stop of the last sentence.
    """
    rng = random.Random(key)
    words = rng.choices(WORDS, k=n)
    lengths = random.Random(key ^ 0x9E3779B97F4A7C15)
    pieces: list[str] = []
    i = 0
    while i < n:
        end = min(n, i + 6 + int(lengths.random() * 10))
        sentence = words[i:end]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        for w in sentence:
            pieces.append(" " + w if pieces else w)
        i = end
    return pieces


def within(pieces: list[str], max_tokens: int | None) -> list[str] | None:
    """The pieces cut to `max_tokens` counted as the proxy estimates tokens (4 characters a token),
    None when they fit."""
    if max_tokens is None or estimate_tokens(sum(len(p) for p in pieces)) <= max_tokens:
        return None
    out: list[str] = []
    room = max_tokens * CHARS_PER_TOKEN
    for p in pieces:
        if len(p) >= room:
            out.append(p[:room])
            break
        out.append(p)
        room -= len(p)
    return out


def split_pieces(s: str, size: int = 4) -> list[str]:
    """A string cut into pieces of about one token each (at most _MAX_FRAMES pieces)."""
    if not s:
        return []
    size = max(size, -(-len(s) // _MAX_FRAMES))
    return [s[i:i + size] for i in range(0, len(s), size)]


# ---------------------------------------------------------------- JSON schema instances


class InstanceGenerator:
    """A deterministic instance of a JSON schema (a practical subset of draft 2020-12)."""

    MAX_DEPTH = 8

    def __init__(self, rng: random.Random, root: Any):
        self.rng = rng
        self.root = root

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(lo, hi)))

    def _ref(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return {}
        node: Any = self.root
        for part in ref[1:].split("/"):
            if not part:
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return {}
        return node

    def value(self, schema: Any, depth: int = 0) -> Any:  # noqa: C901 - one branch per JSON Schema keyword
        rng = self.rng
        if schema is True or not isinstance(schema, dict):
            return self.words(1, 3)
        if "$ref" in schema and depth < self.MAX_DEPTH:
            merged = {**self._ref(schema["$ref"]), **{k: v for k, v in schema.items() if k != "$ref"}}
            return self.value(merged, depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                non_null = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
                base = {k: v for k, v in schema.items() if k != key}
                return self.value({**base, **_as_dict(rng.choice(non_null or options))}, depth + 1)
        if isinstance(schema.get("allOf"), list):
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for part in schema["allOf"]:
                part = _as_dict(part)
                if "$ref" in part:
                    part = _as_dict(self._ref(part["$ref"]))
                merged = _merge(merged, part)
            return self.value(merged, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kinds = [k for k in kind if k != "null"]
            kind = kinds[0] if kinds else "null"
        if kind is None:
            if "properties" in schema or "required" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                kind = "string"
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return self._number(schema)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _object(self, schema: dict, depth: int) -> dict:
        out: dict = {}
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = [r for r in schema.get("required", []) if isinstance(r, str)] if isinstance(
            schema.get("required"), list) else []
        if depth >= self.MAX_DEPTH:
            names = required  # stop recursing: only what is required
        else:
            names = list(props) + [r for r in required if r not in props]
        for name in names:
            out[name] = self.value(props.get(name, {}), depth + 1) if depth < self.MAX_DEPTH else \
                self._shallow(props.get(name, {}))
        extra = schema.get("additionalProperties")
        want = schema.get("minProperties", 0)
        i = 0
        while isinstance(want, int) and len(out) < want and extra is not False:
            out[f"key_{i}"] = self.value(extra if isinstance(extra, dict) else {}, depth + 1)
            i += 1
        return out

    def _shallow(self, schema: Any) -> Any:
        kind = schema.get("type") if isinstance(schema, dict) else None
        return {"object": {}, "array": [], "integer": 0, "number": 0, "boolean": False, "null": None}.get(
            kind if isinstance(kind, str) else "", "")

    def _array(self, schema: dict, depth: int) -> list:
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", max(lo, 3))
        lo = lo if isinstance(lo, int) else 0
        hi = hi if isinstance(hi, int) else max(lo, 3)
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        items = schema.get("items", {})
        if depth >= self.MAX_DEPTH:
            return []
        count = max(lo, len(prefix), min(hi, max(lo, 1) + self.rng.randint(0, 2)))
        count = min(count, hi) if hi >= lo else lo
        if isinstance(items, dict) and isinstance(items.get("enum"), list) and schema.get("uniqueItems"):
            pool = list(dict.fromkeys(json.dumps(e) for e in items["enum"]))
            return [json.loads(e) for e in self.rng.sample(pool, min(count, len(pool)))]
        out = []
        for i in range(count):
            sub = prefix[i] if i < len(prefix) else (items if items is not False else {})
            value = self.value(sub, depth + 1)
            if schema.get("uniqueItems") and value in out:
                value = self.value(sub, depth + 1)
                if value in out:
                    break
            out.append(value)
        return out

    def _integer(self, schema: dict) -> int:
        lo, hi = _bounds(schema, integer=True)
        step = schema.get("multipleOf")
        if isinstance(step, int) and step > 0:
            first = -(-lo // step)
            last = hi // step
            if first <= last:
                return self.rng.randint(first, last) * step
        return self.rng.randint(lo, hi)

    def _number(self, schema: dict) -> float | int:
        lo, hi = _bounds(schema, integer=False)
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0:
            first = math.ceil(lo / step)
            last = math.floor(hi / step)
            if first <= last:
                return self.rng.randint(first, last) * step
        value = round(lo + (hi - lo) * self.rng.random(), 2)
        if not lo <= value <= hi:
            value = lo
        if ("exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]) or (
                "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]):
            value = (lo + hi) / 2
        return value

    def _string(self, schema: dict) -> str:
        fmt = schema.get("format")
        rng = self.rng
        if fmt == "date-time":
            s = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
        elif fmt == "date":
            s = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif fmt == "time":
            s = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00"
        elif fmt == "email":
            s = f"{rng.choice(WORDS)}.{rng.choice(WORDS)}@example.com"
        elif fmt in ("uri", "url"):
            s = f"https://example.com/{rng.choice(WORDS)}/{rng.randint(1, 9999)}"
        elif fmt == "uuid":
            h = f"{rng.getrandbits(128):032x}"
            s = f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:32]}"
        elif fmt == "ipv4":
            s = ".".join(str(rng.randint(1, 254)) for _ in range(4))
        else:
            s = self.words(1, 4)
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength")
        while isinstance(lo, int) and len(s) < lo:
            s += " " + rng.choice(WORDS)
        if isinstance(hi, int) and len(s) > hi:
            s = s[:hi]
        return s


def _as_dict(x: Any) -> dict:
    return x if isinstance(x, dict) else {}


def _merge(a: dict, b: dict) -> dict:
    out = {**a, **b}
    if isinstance(a.get("properties"), dict) and isinstance(b.get("properties"), dict):
        out["properties"] = {**a["properties"], **b["properties"]}
    if isinstance(a.get("required"), list) and isinstance(b.get("required"), list):
        out["required"] = list(dict.fromkeys(a["required"] + b["required"]))
    return out


def _bounds(schema: dict, integer: bool) -> tuple:
    lo = schema.get("minimum")
    hi = schema.get("maximum")
    xlo = schema.get("exclusiveMinimum")
    xhi = schema.get("exclusiveMaximum")
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        lo = max(lo, xlo) if isinstance(lo, (int, float)) else xlo
        lo = math.floor(xlo) + 1 if integer and lo == xlo else lo
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        hi = min(hi, xhi) if isinstance(hi, (int, float)) else xhi
        hi = math.ceil(xhi) - 1 if integer and hi == xhi else hi
    if not isinstance(lo, (int, float)) or isinstance(lo, bool):
        lo = 0 if not isinstance(hi, (int, float)) or hi >= 0 else hi - 100
    if not isinstance(hi, (int, float)) or isinstance(hi, bool):
        hi = lo + 100
    if integer:
        lo, hi = math.ceil(lo), math.floor(hi)
        if hi < lo:
            hi = lo
    elif hi < lo:
        hi = lo
    return lo, hi


# ---------------------------------------------------------------- models and draws

HTTP_KINDS = frozenset({"auth_error", "quota_exceeded", "rate_limited", "provider_5xx", "timeout", "bad_response"})
COMPLETION_KINDS = HTTP_KINDS | {"content_filtered", "empty_output", "truncated"}
CHAT_TEXT_KINDS = COMPLETION_KINDS | {"refusal"}
CHAT_JSON_KINDS = CHAT_TEXT_KINDS | {"invalid_json"}
CHAT_TOOL_KINDS = CHAT_TEXT_KINDS | {"invalid_tool_call"}


@dataclass(slots=True)
class Draw:
    failure: str | None
    variant: int          # 0 = the shared answer; > 0 = a divergent one
    alt: float            # a spare uniform (e.g. 500 vs 503)
    latency: float        # seconds, unscaled
    ttft: float
    wrong: bool = False   # state a wrong fact (wrong_content)
    wording: int = 0      # the wording key of this call's rendering (0 = canonical)
    judge_u: float = 0.0  # the judge's error draw


class ModelState:
    """One simulated model: its seeded RNG and its behaviour per (segment, phase)."""

    def __init__(self, name: str, cfg: SimModel, seed: int):
        self.name = name
        self.cfg = cfg
        self.rng = random.Random(_key(seed, "model", name))
        names = set(cfg.segments)
        for phase in cfg.phases:
            names.update(phase.segments)
        self.segment_names = tuple(sorted(names))
        self.phase_times = [p.after_s for p in cfg.phases]
        self.effective: dict[tuple[str | None, int], Effective] = {}
        for k in range(len(cfg.phases) + 1):
            for seg in (None, *self.segment_names):
                self.effective[(seg, k)] = resolve(cfg, seg, k)

    def behaviour(self, segment: str, elapsed: float) -> Effective:
        k = bisect_right(self.phase_times, elapsed) if self.phase_times else 0
        return self.effective[(segment if segment in self.segment_names else None, k)]

    def draw(self, eff: Effective, applicable: frozenset[str]) -> Draw:
        r = self.rng.random
        failure = None
        for kind, p in zip(FAILURE_KINDS, eff.failures, strict=True):
            u = r()
            if failure is None and u < p and kind in applicable:
                failure = kind
        u_div, u_var, alt, u_lat, u_ttft = r(), r(), r(), r(), r()
        u_wrong, u_word, u_judge = r(), r(), r()
        variant = 1 + int(u_var * 2147483647) if u_div < eff.divergence else 0
        return Draw(failure, variant, alt, lognormal(eff.latency, u_lat), lognormal(eff.ttft, u_ttft),
                    wrong=u_wrong < eff.wrong_content, wording=1 + int(u_word * 2**62), judge_u=u_judge)

    def extra_variant(self, eff: Effective) -> int:
        """Variant of an additional choice (n > 1): its own divergence draw."""
        r = self.rng.random
        u_div, u_var = r(), r()
        return 1 + int(u_var * 2147483647) if u_div < eff.divergence else 0


# ---------------------------------------------------------------- the engine


@dataclass(slots=True)
class Answer:
    """One choice of a chat answer."""

    content: str | None
    pieces: list[str]              # content (or refusal / arguments) as stream deltas
    finish: str
    refusal: str | None = None
    tool_call: dict | None = None  # {"id", "type", "function": {"name", "arguments"}}
    legacy_function: bool = False  # answer with message.function_call (legacy `functions`)

    @property
    def tokens(self) -> int:
        """Its usage: its text counted as the proxy estimates tokens, so usage and text agree."""
        return estimate_tokens(sum(len(p) for p in self.pieces))


class Engine:
    def __init__(self, config: SimulatorConfig, clock=time.monotonic):
        self.config = config
        self.seed = config.seed
        self.time_scale = config.time_scale
        self.clock = clock
        self.started = clock()
        self.models = {name: ModelState(name, m, config.seed) for name, m in config.models.items()}
        self.auth = ("Bearer " + config.api_key).encode() if config.api_key else None
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid() & 0xFFFF:04x}{int(time.time()) & 0xFFFFFF:06x}"
        self._text_cache: dict[tuple[int, int], list[str]] = {}
        created = int(time.time())
        self.models_body = _dumps({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "modelcanary-simulator"}
            for name in self.models]}).encode()
        self._created = created

    # -------------------------------------------------------- helpers

    def authorized(self, authorization: bytes | None) -> bool:
        return self.auth is None or authorization == self.auth

    def list_models(self) -> Reply:
        return Reply(body=self.models_body)

    def get_model(self, name: str) -> Reply:
        if name not in self.models:
            return self._model_not_found(name)
        return Reply(body=_dumps({"id": name, "object": "model", "created": self._created,
                                  "owned_by": "modelcanary-simulator"}).encode())

    def _model_not_found(self, name: object) -> Reply:
        return error_reply(404, f"The model `{name}` does not exist or you do not have access to it.",
                           "invalid_request_error", "model_not_found", "model")

    def _next_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):014x}"

    def _pieces(self, key: int, n: int) -> list[str]:
        ck = (key, n)
        pieces = self._text_cache.get(ck)
        if pieces is None:
            if len(self._text_cache) >= 8192:
                self._text_cache.clear()
            pieces = self._text_cache[ck] = text_pieces(key, n)
        return pieces

    def _answer_key(self, prompt_key: int, variant: int) -> int:
        return prompt_key if variant == 0 else _key(self.seed, "variant", prompt_key, variant)

    def _n_tokens(self, eff: Effective, answer_key: int) -> int:
        return max(1, min(16384, round(lognormal(eff.output_tokens, _unit(answer_key)))))

    def _scaled(self, seconds: float) -> float:
        return seconds * self.time_scale

    def _failure_reply(self, draw: Draw, model: str) -> Reply | None:
        """Replies for failures that are decided at the HTTP level (None for the others)."""
        f = draw.failure
        if f is None or f not in HTTP_KINDS:
            return None
        fast = self._scaled(draw.ttft)
        if f == "rate_limited":
            return error_reply(
                429, f"Rate limit reached for {model} (simulated). Please try again in 20ms.", "requests",
                "rate_limit_exceeded", headers=((b"retry-after", b"0"), (b"retry-after-ms", b"20"),
                                                (b"x-ratelimit-remaining-requests", b"0")), delay=fast)
        if f == "quota_exceeded":
            return error_reply(429, "You exceeded your current quota, please check your plan and billing details.",
                               "insufficient_quota", "insufficient_quota", delay=fast)
        if f == "auth_error":
            return error_reply(401, "Incorrect API key provided (simulated).", "invalid_request_error",
                               "invalid_api_key", delay=fast)
        if f == "provider_5xx":
            if draw.alt < 0.5:
                return error_reply(500, "The server had an error while processing your request. Sorry about that!",
                                   "server_error", delay=fast)
            return error_reply(503, "The engine is currently overloaded, please try again later.",
                               "server_error", "service_unavailable", delay=fast)
        if f == "timeout":
            return Reply(hang=True)
        return None  # bad_response: built by the caller, which knows the body

    def _body_and_model(self, raw: bytes, field: str) -> tuple[dict, ModelState, Any] | Reply:
        """The JSON body, the simulated model it names and its required `field`, or the error OpenAI would answer."""
        try:
            body = _loads(raw)
        except (ValueError, UnicodeDecodeError):
            return bad_json_reply()
        if not isinstance(body, dict):
            return invalid_param(None, "The request body must be a JSON object.")
        model = body.get("model")
        if model is None:
            return missing_param("model")
        ms = self.models.get(model) if isinstance(model, str) else None
        if ms is None:
            return self._model_not_found(model)
        value = body.get(field)
        if value is None:
            return missing_param(field)
        return body, ms, value

    def _effective(self, body: dict, task_type: str | None, ms: ModelState) -> Effective:
        """The model's behaviour now, in the request's segment."""
        return ms.behaviour(classify_segment(body, task_type, ms.segment_names), self.clock() - self.started)

    def _body_reply(self, out: bytes, draw: Draw, latency: float) -> Reply:
        """A whole JSON answer, cut in half by a `bad_response` failure."""
        if draw.failure == "bad_response":
            out = out[: max(1, len(out) // 2)]
        return Reply(body=out, delay=self._scaled(latency))

    # -------------------------------------------------------- POST /v1/chat/completions

    def chat(self, raw: bytes, task_type: str | None = None) -> Reply:  # noqa: C901 - the simulated request's steps in order (parse, fail, answer, price)
        parsed = self._body_and_model(raw, "messages")
        if isinstance(parsed, Reply):
            return parsed
        body, ms, messages = parsed
        model = ms.name
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return invalid_param("messages", "'messages' must be a non-empty array of objects with a 'role'.")
        stream = body.get("stream") is True
        n = body.get("n", 1)
        if n is None:
            n = 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
            return invalid_param("n", f"Invalid 'n': {n!r}; expected an integer from 1 to 16.")
        max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
        if isinstance(max_tokens, Reply):
            return max_tokens

        eff = self._effective(body, task_type, ms)
        prompt_tokens = max(1, estimate_tokens(message_chars(messages)))
        if prompt_tokens > eff.context_tokens:
            return error_reply(
                400, f"This model's maximum context length is {eff.context_tokens} tokens. However, your messages "
                     f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                "invalid_request_error", "context_length_exceeded", "messages")

        # What kind of answer: tool call, JSON, or text.
        tool, legacy, err = _pick_tool(body, messages, self.seed)
        if err is not None:
            return err
        schema, json_mode = _json_schema(body)
        applicable = CHAT_TOOL_KINDS if tool is not None else CHAT_JSON_KINDS if json_mode else CHAT_TEXT_KINDS

        draw = ms.draw(eff, applicable)
        failed = self._failure_reply(draw, model)
        if failed is not None:
            return failed

        prompt_key = self._prompt_key(messages)
        verdict = self._judge(ms, messages, draw) if ms.cfg.judge else None
        variants = [draw.variant] + [ms.extra_variant(eff) for _ in range(n - 1)]
        answers = [self._chat_answer(eff, prompt_key, v, i, draw.failure, tool, legacy, schema, json_mode,
                                     max_tokens, wording=draw.wording + i, wrong=draw.wrong, verdict=verdict)
                   for i, v in enumerate(variants)]
        completion_tokens = sum(a.tokens for a in answers)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        cid = "chatcmpl-" + self._next_id()
        created = int(time.time())
        latency = max(draw.latency, draw.ttft)
        if stream:
            return self._chat_stream(cid, created, model, answers, usage if _include_usage(body) else None, draw,
                                     latency)
        choices = []
        for i, a in enumerate(answers):
            message: dict[str, Any] = {"role": "assistant", "content": a.content, "refusal": a.refusal,
                                       "annotations": []}
            if a.tool_call is not None:
                if a.legacy_function:
                    message["function_call"] = a.tool_call["function"]
                else:
                    message["tool_calls"] = [a.tool_call]
            choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": a.finish})
        out = _dumps({"id": cid, "object": "chat.completion", "created": created, "model": model,
                      "choices": choices, "usage": usage, "service_tier": "default",
                      "system_fingerprint": "fp_simulator"}).encode()
        return self._body_reply(out, draw, latency)

    def _facts(self, eff: Effective, akey: int, wrong_key: int) -> list:
        """The facts of a text answer (one of them wrong with a wrong_key)."""
        stated = facts(akey, fact_count(self._n_tokens(eff, akey)))
        return wrong_facts(stated, wrong_key) if wrong_key else stated

    def _prompt_key(self, messages: list) -> int:
        return _key(self.seed, "prompt", _dumps(_canonical(messages)))

    def _judge(self, ms: ModelState, messages: list, draw: Draw) -> dict | None:
        """A judge model's verdict on a pairwise prompt (None: not one, answer normally)."""
        prompt = judge.pairwise_prompt(messages)
        if prompt is None:
            return None
        conversation, a, b = prompt
        error = draw.judge_u < ms.cfg.judge_error
        pick = draw.judge_u / ms.cfg.judge_error if error else 0.0  # uniform again, given the error
        return judge.verdict(a, b, self._prompt_key(conversation), error, pick)

    def _chat_answer(self, eff: Effective, prompt_key: int, variant: int, index: int, failure: str | None,  # noqa: C901 - one branch per kind of answer (failure, tool, JSON, text)
                     tool: dict | None, legacy: bool, schema: Any, json_mode: bool,
                     max_tokens: int | None, wording: int = 0, wrong: bool = False,
                     verdict: dict | None = None) -> Answer:
        akey = self._answer_key(prompt_key, variant)
        wrong_key = _key(self.seed, "wrong", akey) if wrong else 0
        if failure == "content_filtered":
            return Answer(content="", pieces=[], finish="content_filter")
        if failure == "refusal":
            pieces, finish = split_pieces(REFUSAL_TEXT, 8), "stop"
            if (capped := within(pieces, max_tokens)) is not None:
                pieces, finish = capped, "length"
            return Answer(content=None, pieces=pieces, finish=finish, refusal="".join(pieces))
        if failure == "empty_output":
            return Answer(content="", pieces=[], finish="stop")
        if tool is not None and verdict is None:
            fn = tool.get("function") if not legacy else tool
            fn = fn if isinstance(fn, dict) else {}
            rng = random.Random(akey ^ 0x7F4A7C15 ^ wrong_key)
            args = _laid_out(InstanceGenerator(rng, fn.get("parameters") or {}).value(
                _object_schema(fn.get("parameters"))), wording, compact=True) if fn.get("parameters") is not None else "{}"
            finish = "function_call" if legacy else "tool_calls"
            if failure == "invalid_tool_call":
                args = args[:-1] if len(args) > 1 else "{"
            elif failure == "truncated":
                args, finish = args[: len(args) // 2], "length"
            if max_tokens is not None and estimate_tokens(len(args)) > max_tokens:
                args, finish = args[: max_tokens * CHARS_PER_TOKEN], "length"
            call = {"id": f"call_{akey & 0xFFFFFFFFFFFF:012x}{next(self._ids) & 0xFFFFFFFFFFFF:012x}",
                    "type": "function", "function": {"name": fn.get("name", ""), "arguments": args}}
            return Answer(content=None, pieces=split_pieces(args), finish=finish, tool_call=call,
                          legacy_function=legacy)
        if json_mode or verdict is not None:
            rng = random.Random(akey ^ 0x3C6EF372 ^ wrong_key)
            if verdict is not None:
                value: Any = verdict
            elif schema is None:
                value = {"answer": "".join(render(self._facts(eff, akey, wrong_key), 0)),
                         "confidence": round(random.Random(akey ^ 0x3C6EF372).random(), 2)}
            else:
                value = InstanceGenerator(rng, schema).value(schema)
            content = _laid_out(value, wording)
            finish = "stop"
            if failure == "invalid_json":
                content = "Sure! Here is the JSON you asked for:\n```json\n" + content + "\n```"
            elif failure == "truncated":
                content, finish = content[: max(1, len(content) // 2)], "length"
            if max_tokens is not None and estimate_tokens(len(content)) > max_tokens:
                content, finish = content[: max_tokens * CHARS_PER_TOKEN], "length"
            return Answer(content=content, pieces=split_pieces(content), finish=finish)
        pieces = render(self._facts(eff, akey, wrong_key), wording)
        finish = "stop"
        if failure == "truncated":
            pieces, finish = pieces[: max(1, len(pieces) // 2)], "length"
        if (capped := within(pieces, max_tokens)) is not None:
            pieces, finish = capped, "length"
        return Answer(content="".join(pieces), pieces=pieces, finish=finish)

    def _chat_stream(self, cid: str, created: int, model: str, answers: list[Answer], usage: dict | None,
                     draw: Draw, latency: float) -> Reply:
        head = ('{"id":"' + cid + '","object":"chat.completion.chunk","created":' + str(created) + ',"model":'
                + _dumps(model) + ',"system_fingerprint":"fp_simulator","choices":[')
        tail = "]" + (',"usage":null}' if usage is not None else "}")

        def event(choice: str) -> str:
            return "data: " + head + choice + tail + "\n\n"

        groups: list[list[str]] = []   # per answer: its events, first is the opening delta
        finals: list[str] = []
        for i, a in enumerate(answers):
            pre = '{"index":' + str(i) + ',"delta":'
            post = ',"logprobs":null,"finish_reason":null}'
            events = []
            if a.refusal is not None:
                events.append(event(pre + '{"role":"assistant","content":null,"refusal":""}' + post))
                events += [event(pre + '{"refusal":' + _dumps(p) + "}" + post) for p in a.pieces]
            elif a.tool_call is not None:
                fn = a.tool_call["function"]
                if a.legacy_function:
                    events.append(event(pre + '{"role":"assistant","content":null,"function_call":{"name":'
                                        + _dumps(fn["name"]) + ',"arguments":""},"refusal":null}' + post))
                    events += [event(pre + '{"function_call":{"arguments":' + _dumps(p) + "}}" + post)
                               for p in a.pieces]
                else:
                    events.append(event(
                        pre + '{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":'
                        + _dumps(a.tool_call["id"]) + ',"type":"function","function":{"name":' + _dumps(fn["name"])
                        + ',"arguments":""}}],"refusal":null}' + post))
                    events += [event(pre + '{"tool_calls":[{"index":0,"function":{"arguments":' + _dumps(p) + "}}]}"
                                     + post) for p in a.pieces]
            else:
                events.append(event(pre + '{"role":"assistant","content":"","refusal":null}' + post))
                events += [event(pre + '{"content":' + _dumps(p) + "}" + post) for p in a.pieces]
            if len(events) > 1:  # the first content arrives with the opening delta, at ttft
                events[:2] = [events[0] + events[1]]
            groups.append(events)
            finals.append(event(pre + '{},"logprobs":null,"finish_reason":"' + a.finish + '"}'))
        closing = "".join(finals)
        if usage is not None:
            closing += ("data: " + head + "]," + '"usage":' + _dumps(usage) + "}\n\n")
        closing += "data: [DONE]\n\n"
        events = [e for g in groups for e in g]
        if draw.failure == "bad_response":
            # a couple of good chunks, then a cut-off one, then the connection drops
            bad = events[:2] + ['data: {"id":"' + cid + '","object":"chat.completion.chunk","choi']
            return self._frames(bad, draw.ttft, latency, closing=None, abort=True)
        return self._frames(events, draw.ttft, latency, closing=closing)

    def _frames(self, events: list[str], ttft: float, latency: float, closing: str | None,
                abort: bool = False) -> Reply:
        """Group SSE events into at most _MAX_FRAMES frames timed from ttft to the total latency."""
        if len(events) > _MAX_FRAMES:
            per = -(-len(events) // _MAX_FRAMES)
            events = ["".join(events[i:i + per]) for i in range(0, len(events), per)]
        if closing is not None:
            if len(events) >= 2:
                events[-1] += closing
            else:
                events.append(closing)
        frames = [e.encode() for e in events]
        t0, t1 = self._scaled(ttft), self._scaled(latency)
        if len(frames) == 1:
            times = [t0]
        else:
            step = (t1 - t0) / (len(frames) - 1)
            times = [t0 + k * step for k in range(len(frames))]
        return Reply(content_type=b"text/event-stream; charset=utf-8", frames=frames, times=times, abort=abort,
                     delay=t0)

    # -------------------------------------------------------- POST /v1/completions (legacy)

    def completion(self, raw: bytes, task_type: str | None = None) -> Reply:  # noqa: C901 - the legacy completions twin of chat(), same steps
        parsed = self._body_and_model(raw, "prompt")
        if isinstance(parsed, Reply):
            return parsed
        body, ms, prompt = parsed
        model = ms.name
        if isinstance(prompt, str):
            prompt_chars = len(prompt)
        elif isinstance(prompt, list):
            prompt_chars = sum(len(p) if isinstance(p, str) else 4 * len(p) if isinstance(p, list) else 4
                               for p in prompt)
        else:
            return invalid_param("prompt", "'prompt' must be a string or an array.")
        max_tokens = _max_tokens(body, "max_tokens")
        if isinstance(max_tokens, Reply):
            return max_tokens
        eff = self._effective(body, task_type, ms)
        prompt_tokens = max(1, estimate_tokens(prompt_chars))
        if prompt_tokens > eff.context_tokens:
            return error_reply(
                400, f"This model's maximum context length is {eff.context_tokens} tokens, however you requested "
                     f"{prompt_tokens} tokens. Please reduce your prompt.",
                "invalid_request_error", "context_length_exceeded", "prompt")
        draw = ms.draw(eff, COMPLETION_KINDS)
        failed = self._failure_reply(draw, model)
        if failed is not None:
            return failed
        akey = self._answer_key(_key(self.seed, "prompt", _dumps(prompt)), draw.variant)
        if draw.failure in ("content_filtered", "empty_output"):
            pieces: list[str] = []
            finish = "content_filter" if draw.failure == "content_filtered" else "stop"
        else:
            n = self._n_tokens(eff, akey)
            pieces = self._pieces(akey, n)
            finish = "stop"
            if draw.failure == "truncated":
                pieces, finish = pieces[: max(1, n // 2)], "length"
            pieces = [" " + p if i == 0 else p for i, p in enumerate(pieces)]
            if (capped := within(pieces, max_tokens)) is not None:
                pieces, finish = capped, "length"
        completion_tokens = estimate_tokens(sum(len(p) for p in pieces))  # as the proxy estimates them
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        cid = "cmpl-" + self._next_id()
        created = int(time.time())
        latency = max(draw.latency, draw.ttft)
        if body.get("stream") is True:
            include_usage = _include_usage(body)
            head = ('{"id":"' + cid + '","object":"text_completion","created":' + str(created) + ',"model":'
                    + _dumps(model) + ',"choices":[')
            tail = "]" + (',"usage":null}' if include_usage else "}")
            events = ["data: " + head + '{"text":' + _dumps(p) + ',"index":0,"logprobs":null,"finish_reason":null}'
                      + tail + "\n\n" for p in pieces]
            closing = ("data: " + head + '{"text":"","index":0,"logprobs":null,"finish_reason":"' + finish + '"}'
                       + tail + "\n\n")
            if include_usage:
                closing += "data: " + head + '],"usage":' + _dumps(usage) + "}\n\n"
            closing += "data: [DONE]\n\n"
            if draw.failure == "bad_response":
                return self._frames(events[:2] + ['data: {"id":"' + cid + '","obj'], draw.ttft, latency,
                                    closing=None, abort=True)
            return self._frames(events, draw.ttft, latency, closing=closing)
        out = _dumps({"id": cid, "object": "text_completion", "created": created, "model": model,
                      "choices": [{"text": "".join(pieces), "index": 0, "logprobs": None, "finish_reason": finish}],
                      "usage": usage, "system_fingerprint": "fp_simulator"}).encode()
        return self._body_reply(out, draw, latency)

    # -------------------------------------------------------- POST /v1/embeddings

    def embeddings(self, raw: bytes, task_type: str | None = None) -> Reply:
        parsed = self._body_and_model(raw, "input")
        if isinstance(parsed, Reply):
            return parsed
        body, ms, inp = parsed
        model = ms.name
        if isinstance(inp, str) or (isinstance(inp, list) and inp and all(isinstance(t, int) for t in inp)):
            inputs = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, (str, list)) for t in inp):
            inputs = inp
        else:
            return invalid_param("input", "'input' must be a non-empty string or array.")
        dims = body.get("dimensions", ms.cfg.embedding_dims)
        if not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= 8192:
            return invalid_param("dimensions", f"Invalid 'dimensions': {dims!r}.")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64", None):
            return invalid_param("encoding_format", f"Invalid 'encoding_format': {fmt!r}.")
        draw = ms.draw(self._effective(body, task_type, ms), HTTP_KINDS)
        failed = self._failure_reply(draw, model)
        if failed is not None:
            return failed
        data = []
        tokens = 0
        for i, item in enumerate(inputs):
            tokens += estimate_tokens(len(item)) if isinstance(item, str) else len(item)
            rng = random.Random(_key(self.seed, "embedding", _dumps(item), draw.variant))
            vec = [rng.random() - 0.5 for _ in range(dims)]
            norm = math.sqrt(sum(x * x for x in vec)) or 1.0
            vec = [x / norm for x in vec]
            value: Any = base64.b64encode(array("f", vec).tobytes()).decode() if fmt == "base64" else vec
            data.append({"object": "embedding", "index": i, "embedding": value})
        out = _dumps({"object": "list", "data": data, "model": model,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}).encode()
        return self._body_reply(out, draw, draw.latency)


# ---------------------------------------------------------------- request helpers


def _max_tokens(body: dict, *keys: str) -> int | None | Reply:
    """The first of `keys` the body sets, checked: an integer >= 1 (None: no cap)."""
    value = next((body[k] for k in keys if body.get(k) is not None), None)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        return invalid_param("max_tokens", f"Invalid 'max_tokens': {value!r}; expected an integer >= 1.")
    return value


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _canonical(messages: list) -> list:
    """What the answer depends on: roles and contents (key order and extra fields don't matter)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [p.get("text") if isinstance(p, dict) else p for p in content]
        item = [m.get("role"), content]
        if m.get("tool_calls"):
            item.append([(tc.get("function") or {}).get("name") if isinstance(tc, dict) else None
                         for tc in m["tool_calls"]])
        out.append(item)
    return out


def _laid_out(value: Any, wording: int, compact: bool = False) -> str:
    """A JSON value as text: canonical for wording 0, else its keys in another order and other spacing."""
    if not wording:
        return _dumps(value) if compact else json.dumps(value)
    rng = random.Random(wording)
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        value = {k: value[k] for k in keys}
    style = rng.randrange(2 if compact else 3)
    return _dumps(value) if style == 0 else json.dumps(value) if style == 1 else json.dumps(value, indent=2)


def _object_schema(params: Any) -> Any:
    if isinstance(params, dict) and "type" not in params and ("properties" in params or not params):
        return {**params, "type": "object"}
    return params


def _json_schema(body: dict) -> tuple[Any, bool]:
    """(schema or None, JSON mode?) from response_format."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict):
        return None, False
    if fmt.get("type") == "json_object":
        return None, True
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return (schema if isinstance(schema, dict) else None), True
    return None, False


def _pick_tool(body: dict, messages: list, seed: int) -> tuple[dict | None, bool, Reply | None]:  # noqa: C901 - tool_choice's forms (auto, none, required, named, legacy)
    """(tool to call or None, legacy `functions`?, error reply)."""
    tools = body.get("tools")
    legacy = False
    if not tools and body.get("functions"):
        tools, legacy = body["functions"], True
    if not tools:
        return None, False, None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        return None, False, invalid_param("functions" if legacy else "tools", "'tools' must be an array of objects.")

    def name_of(t: dict) -> str | None:
        fn = t if legacy else t.get("function")
        return fn.get("name") if isinstance(fn, dict) else None

    choice = body.get("function_call" if legacy else "tool_choice", "auto")
    if choice == "none":
        return None, legacy, None
    if isinstance(choice, dict):
        wanted = choice.get("name") if legacy else (choice.get("function") or {}).get("name")
        for t in tools:
            if name_of(t) == wanted:
                return t, legacy, None
        param = "function_call" if legacy else "tool_choice"
        return None, legacy, invalid_param(param, f"Invalid value for '{param}': no function named {wanted!r} "
                                                  "was specified in the tools.")
    last = messages[-1] if messages else {}
    if choice != "required" and last.get("role") in ("tool", "function"):
        return None, legacy, None  # answer the tool's result in words, like a model in an agent loop
    named = [t for t in tools if name_of(t)]
    if not named:
        return None, legacy, invalid_param("tools", "Every tool needs a function name.")
    # deterministic pick shared by all models: by the conversation
    pick = _key(seed, "tool", _dumps(_canonical(messages))) % len(named)
    return named[pick], legacy, None
