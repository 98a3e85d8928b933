"""`modelcanary status | promote | pause | resume | rollback | report`: the admin API as rich tables.

Each function returns the process exit code: 0 on success, 1 with a one-line
error on stderr for anything the operator can fix (unreachable URL, missing or
wrong token, unknown route, a transition the phase does not allow, a server that
is no modelcanary admin API), 2 for a `--url` that is not an http(s) URL or is an OpenAI base URL
(`.../v1`), or a token no HTTP header can carry (bad input, as argparse's own errors: nothing was sent).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from service.config import redacted_url

TIMEOUT_S = 10.0
TOKEN_ENV = "MODELCANARY_ADMIN_TOKEN"
TERMINAL = ("promoted", "rolled_back", "partial")
JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
VERDICT_STYLE = {"worse": "bold red", "within": "green", "inconclusive": "yellow"}
DECISION_STYLE = {"rollback": "bold red", "promote": "bold green", "step": "green", "hold": "yellow"}
PHASE_STYLE = {"rolled_back": "bold red", "promoted": "bold green", "canary": "cyan", "shadow": "blue",
               "paused": "magenta", "partial": "bold yellow"}


class AdminError(Exception):
    """A failed admin call, already phrased for the operator."""

    exit_code = 1


class BadURLError(AdminError):
    """A URL flag that is not an http(s) URL: bad input, nothing was asked."""

    exit_code = 2


class BadTokenError(AdminError):
    """An admin token that no HTTP header can carry: bad input, nothing was sent."""

    exit_code = 2


def check_url(flag: str, url: str) -> str:
    """`url` when it is an http(s)://HOST[:PORT][/PATH] URL and not an OpenAI base URL (`.../v1`), else
    BadURLError naming the flag and value."""
    hint = "give http://HOST:PORT, e.g. http://127.0.0.1:8080"
    shown = redacted_url(repr(url))  # a user:password@ in it is never printed
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is what checks it
    except ValueError as e:
        raise BadURLError(f"{flag}: {shown} is not a URL ({e}); {hint}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadURLError(f"{flag}: {shown} is not an http(s) URL; {hint}")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise BadURLError(f"{flag}: {shown} contains spaces or control characters; {hint}")
    if parts.path.rstrip("/").endswith("/v1"):  # sent, /v1/admin/... would go upstream, the token with it
        root = redacted_url(urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/")[:-3], "", "")))
        raise BadURLError(f"{flag}: {shown} ends in /v1, the base URL of OpenAI clients; the admin API is at the "
                          f"proxy's root: give {root}")
    return url


def check_token(token: str | None) -> str | None:
    """`token` without surrounding whitespace (a token file's line break), None when nothing is left;
    BadTokenError naming where it came from (never its value) when an HTTP header cannot carry it."""
    if token is None or not (stripped := token.strip()):
        return None
    at, char = next(((i, c) for i, c in enumerate(stripped) if ord(c) > 255 or not c.isprintable()), (-1, ""))
    if not char:
        return stripped
    source = TOKEN_ENV if os.environ.get(TOKEN_ENV) == token else "--token"  # the variable is --token's default
    what = "a character outside Latin-1" if ord(char) > 255 else f"a control character (U+{ord(char):04X})"
    raise BadTokenError(f"{source}: the admin token holds {what} at position {at + 1}, which an HTTP header "
                        "cannot carry; nothing was sent: give the token the proxy's admin token variable holds")


def _request(method: str, url: str, path: str, token: str | None, flag: str = "--url",
             token_hint: str = f"pass --token or set {TOKEN_ENV}",
             shape: Callable[[dict], bool] = lambda body: True) -> dict[str, Any]:
    """The answer's JSON object; AdminError (naming what was asked) for an HTTP error, an unreachable
    URL, or an answer that is no JSON object or fails `shape`: a server that is no modelcanary admin API."""
    full = check_url(flag, url).rstrip("/") + path
    token = check_token(token)
    req = urllib.request.Request(full, method=method, data=b"" if method == "POST" else None)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        message = _error_message(e)
        hint = ""
        if e.code == 401 and not token:
            hint = f" ({token_hint})"
        raise AdminError(f"{method} {full}: HTTP {e.code}: {message}{hint}") from None
    except urllib.error.URLError as e:
        raise AdminError(f"cannot reach {full}: {e.reason}") from None
    except (TimeoutError, OSError) as e:
        raise AdminError(f"cannot reach {full}: {e}") from None
    body, what = _json_object(raw)
    if body is None or not shape(body):
        what = what or "a JSON object of another shape"
        raise AdminError(f"{method} {full}: {what}: {url.rstrip('/')} is not a modelcanary admin API")
    return body


def _json_object(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """The answer's JSON object, else None and what the answer is instead."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None, "an empty answer" if not raw.strip() else "an answer that is not JSON"
    if not isinstance(body, dict):
        return None, f"a JSON {JSON_TYPES.get(type(body), 'value')}, not an object"
    return body, ""


def _is_state(body: object) -> bool:
    """A rollout state as the admin API gives it: a route's, with its segments' (rollout.scope segment)."""
    if not isinstance(body, dict) or not isinstance(body.get("route"), str):
        return False
    segments = body.get("segments") or {}
    return isinstance(segments, dict) and all(isinstance(seg, dict) for seg in segments.values())


def _is_state_list(body: dict) -> bool:
    rollouts = body.get("rollouts")
    return isinstance(rollouts, list) and all(_is_state(s) for s in rollouts)


def _is_report(body: dict) -> bool:
    return _is_state(body.get("state")) and isinstance(body.get("report") or {}, dict)


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read() or b"{}")
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("detail"), str):
            return body["detail"]
    except (ValueError, AttributeError):
        pass
    return e.reason or "request failed"


def _fail(e: AdminError) -> int:
    print(f"error: {e}", file=sys.stderr)
    return e.exit_code


def _q(route: str) -> str:
    return urllib.parse.quote(route, safe="")


def _console() -> Console:
    return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)


# ---- status ----------------------------------------------------------------------------------------

def status(url: str, token: str | None, route: str | None = None) -> int:
    try:
        if route:
            states = [_request("GET", url, f"/admin/rollouts/{_q(route)}", token, shape=_is_state)]
        else:
            states = _request("GET", url, "/admin/rollouts", token, shape=_is_state_list)["rollouts"]
    except AdminError as e:
        return _fail(e)
    _console().print(status_table(states))
    return 0


def _ago(ts: float | None) -> str:
    if not ts:
        return "–"
    s = max(0.0, time.time() - float(ts))
    if s < 90:
        return f"{s:.0f}s ago"
    if s < 5400:
        return f"{s / 60:.0f}m ago"
    if s < 2 * 86400:
        return f"{s / 3600:.1f}h ago"
    return f"{s / 86400:.1f}d ago"


def _decision_text(d: dict | None, label: str = "") -> Text:
    if not d:
        return Text("–")
    t = Text()
    if label:
        t.append(label + " ", style="dim")
    t.append(d.get("decision", "?"), style=DECISION_STYLE.get(d.get("decision"), ""))
    by = d.get("by")
    if by and by != "controller":
        t.append(f" by {by}", style="dim")
    for line in (d.get("reasons") or [])[:6]:
        t.append("\n  " + line)
    more = len(d.get("reasons") or []) - 6
    if more > 0:
        t.append(f"\n  (+{more} more)", style="dim")
    return t


def status_table(states: list[dict]) -> Table:
    table = Table(title="rollouts", show_lines=True)
    for col in ("route", "stable → candidate", "phase", "weight", "step", "since", "last decision"):
        table.add_column(col, justify="right" if col in ("weight", "step") else "left")
    for s in states:
        candidates = s.get("candidates") or [s.get("candidate") or "–"]
        table.add_row(s.get("route", "?"), f"{s.get('stable')} → {', '.join(candidates)}", *_state_cells(s))
        for name, seg in (s.get("segments") or {}).items():  # rollout.scope segment: each its own
            table.add_row(f"  segment {name}", f"{s.get('stable')} → {seg.get('candidate') or '–'}",
                          *_state_cells(seg))
    return table


def _state_cells(s: dict) -> tuple:
    """phase, weight, step, since and decisions of a route's (or a segment's) state."""
    phase = s.get("phase", "?")
    if phase == "paused" and s.get("paused_from"):
        phase_t = Text(f"paused (from {s['paused_from']})", style=PHASE_STYLE["paused"])
    else:
        phase_t = Text(phase, style=PHASE_STYLE.get(phase, ""))
    decision = _decision_text(s.get("last_decision"))
    rec = s.get("recommendation")
    if rec:
        decision.append("\n")
        decision.append_text(_decision_text(rec, "judge now:"))
    return (phase_t, f"{100 * _candidate_share(s):.0f}%", _step_text(s), _ago(s.get("since")), decision)


def _candidate_share(s: dict) -> float:
    """The share of live traffic a route's (or a segment's) candidate gets: all of it once promoted;
    none on a route without a candidate (which shows as promoted: its stable is all there is)."""
    if not s.get("candidate") or s.get("phase") == "rolled_back":
        return 0.0
    return 1.0 if s.get("phase") == "promoted" else float(s.get("canary_weight", 0.0))


def _step_text(s: dict) -> str:
    step = s.get("step_index", -1)
    return "–" if step is None or step < 0 else str(step + 1)


# ---- promote | pause | resume | rollback --------------------------------------------------------------

def act(url: str, token: str | None, route: str, action: str, segment: str | None = None) -> int:
    query = f"?segment={_q(segment)}" if segment is not None else ""  # an empty one: the server's 400

    def acted_on(body: dict) -> bool:
        return _is_state(body) and (not segment or isinstance((body.get("segments") or {}).get(segment), dict))

    try:
        state = _request("POST", url, f"/admin/rollouts/{_q(route)}/{_q(action)}{query}", token, shape=acted_on)
    except AdminError as e:
        return _fail(e)
    shown = state["segments"][segment] if segment else state
    where = f"{route} segment {segment}" if segment else route
    print(f"{where}: {action} → phase {shown.get('phase')}, weight {100 * _candidate_share(shown):.0f}%, "
          f"step {_step_text(shown)}" + (f" ({shown['candidate']})" if shown.get("candidate") else ""))
    return 0


# ---- report -------------------------------------------------------------------------------------------

def get_report(url: str, token: str | None, route: str, flag: str = "--url",
               token_hint: str = f"pass --token or set {TOKEN_ENV}") -> dict:
    """`GET /admin/rollouts/{route}/report`: {"route", "state", "report"}; AdminError when it fails
    (BadURLError, naming `flag`, when `url` is not an http(s) URL; BadTokenError for a token no header
    can carry; `token_hint` says where a missing token goes)."""
    return _request("GET", url, f"/admin/rollouts/{_q(route)}/report", token, flag, token_hint, shape=_is_report)


def report(url: str, token: str | None, route: str, as_json: bool = False) -> int:
    try:
        body = get_report(url, token, route)
    except AdminError as e:
        return _fail(e)
    if as_json:
        print(json.dumps(body, indent=2))
        return 0
    console = _console()
    state = body.get("state") or {}
    rep = body.get("report")
    console.print(status_table([state]))
    if not rep:
        console.print("no report yet: the controller has not judged this route (no candidate, or no evidence yet)")
        return 0
    ended = state.get("phase") in TERMINAL
    console.print(_report_heading(rep, state.get("phase") if ended else None))
    judge_part = rep.get("judge") or {}
    shadow = rep.get("shadow")
    if shadow:
        for table in _shadow_tables(shadow):
            console.print(table)
    live = rep.get("live") or {}
    if live.get("segments"):
        console.print(live_table(live))
    if rep.get("matrix"):
        console.print(matrix_table(rep["matrix"]))
    if judge_part.get("comparisons"):
        console.print(judge_table(judge_part))
    if judge_part.get("decision"):
        label = "judge (last before the rollout ended): " if ended else "judge: "
        console.print(Text.assemble((label, "bold"), _decision_text(
            {"decision": judge_part["decision"], "reasons": judge_part.get("reasons", [])})))
    return 0


def _report_heading(rep: dict, ended: str | None) -> Text:
    """How old the report is and the phase it was made in; `ended`: the phase the rollout has ended in
    since, so that the report's judgement is not read as today's."""
    text = Text(f"report generated {_ago(rep.get('generated_at'))}, in phase {rep.get('phase', '?')}", style="dim")
    if ended:
        since = "" if rep.get("phase") == ended else " since"
        text.append(f"; the rollout has ended ({ended}){since}: the judgement below is the last before it ended",
                    style="bold")
    return text


def _shadow_tables(summary: dict) -> list:
    try:
        from service.judge.quality import quality_table
        from service.judge.shadow_report import failures_table, shadow_table
    except ImportError:
        return [_generic_table("shadow", summary)]
    try:
        tables = [shadow_table(summary)]
        if any((seg.get("failure_rate") or {}) for seg in (summary.get("segments") or {}).values()):
            tables.append(failures_table(summary))
        quality = quality_table(summary)
        if quality.row_count:
            tables.append(quality)
        return tables
    except (KeyError, TypeError, AttributeError):
        return [_generic_table("shadow", summary)]


def _generic_table(title: str, data: dict) -> Table:
    table = Table(title=title)
    table.add_column("key")
    table.add_column("value")
    for k, v in data.items():
        table.add_row(str(k), json.dumps(v, default=str)[:200])
    return table


def _pct(p: dict | None, with_interval: bool = True) -> str:
    if not p or p.get("value") is None:
        return "–"
    text = f"{100 * p['value']:.1f}%"
    iv = p.get("interval")
    if with_interval and iv:
        text += f" [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]"
    return text


def _sec(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _usd(v: float | None) -> str:
    return "–" if v is None else f"{v:.6f}"


def live_table(live: dict) -> Table:
    table = Table(title=f"live canary: candidate vs stable over {live.get('windows', 0)} window(s) "
                        f"(95% Wilson intervals; decisions use the judge's intervals below)", show_lines=False)
    for col in ("segment", "arm", "n", "completion", "model failures", "client retries", "p50 s", "p95 s",
                "$/completion", "task success"):
        table.add_column(col, justify="left" if col in ("segment", "arm") else "right")
    for seg, arms in live.get("segments", {}).items():
        for i, name in enumerate(("stable", "candidate")):
            a = arms.get(name)
            if a is None:
                continue
            table.add_row(seg if i == 0 or "stable" not in arms else "", name, str(a.get("n", 0)),
                          _pct(a.get("completion_rate")), _pct(a.get("model_failure_rate")),
                          _pct(a.get("client_retry_rate"), False), _sec(a.get("latency_p50_s")),
                          _sec(a.get("latency_p95_s")), _usd(a.get("cost_per_completion_usd")),
                          _pct(a.get("task_success_rate")))
    return table


def _fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "–"
    return f"${v:.6f}" if unit == "ratio" else f"{100 * v:.1f}%"


def _fmt_effect(c: dict) -> str:
    e, iv, unit = c.get("effect"), c.get("interval"), c.get("unit")
    if e is None:
        return "–"
    if unit == "score":
        text = f"{e:+.3f}".replace("-", "−")
        return text + (f"  [{iv[0]:.3f}, {iv[1]:.3f}]".replace("-", "−") if iv else "")
    if unit == "ratio":
        text = f"×{e:.2f}"
        if iv:
            hi = "∞" if iv[1] is None or iv[1] == float("inf") else f"{iv[1]:.2f}"
            text += f"  [{iv[0]:.2f}, {hi}]"
        return text
    text = f"{100 * e:+.1f} pts".replace("-", "−")
    if iv:
        text += f"  [{100 * iv[0]:.1f}, {100 * iv[1]:.1f}]".replace("-", "−")
    return text


def matrix_table(matrix: dict) -> Table:
    """Candidates × segments: each metric's effect against stable with its interval, coloured by verdict,
    and what blocks promotion with its forecast."""
    metrics = matrix.get("metrics", [])
    table = Table(title="capability × cost: each candidate vs stable per segment (anytime-valid intervals)",
                  show_lines=True)
    for col in ("candidate", "segment", "status", *metrics, "forecast"):
        table.add_column(col, justify="left" if col in ("candidate", "segment", "status", "forecast") else "right")
    for row in matrix.get("rows", []):
        cells = row.get("cells") or {}
        shown = []
        for metric in metrics:
            c = cells.get(metric)
            shown.append(Text(_fmt_effect(c), style=VERDICT_STYLE.get(c.get("verdict"), "")) if c else Text("–"))
        deciding = row.get("status") not in ("ruled out", "promoted", "not picked")
        forecasts = [c["forecast"] for c in cells.values() if c.get("forecast") and deciding]
        table.add_row(row.get("candidate", "?"), row.get("segment", "?"), row.get("status", "?"), *shown,
                      "\n".join(forecasts) or "–")
    return table


def judge_table(judge_part: dict) -> Table:
    alpha = judge_part.get("alpha_per_comparison")
    k = judge_part.get("comparisons_budget")
    title = "judge: candidate vs stable per metric and segment (anytime-valid intervals"
    if alpha:
        title += f", α={alpha:.2g} each over {k} comparisons"
    title += ")"
    table = Table(title=title)
    for col in ("metric", "segment", "stable", "candidate", "effect [interval]", "margin", "n", "verdict",
                "forecast"):
        table.add_column(col, justify="left" if col in ("metric", "segment", "verdict", "forecast") else "right")
    order = {"worse": 0, "inconclusive": 1, "within": 2}
    rows = sorted(judge_part.get("comparisons", []),
                  key=lambda c: (order.get(c.get("verdict"), 3), c.get("metric", ""), c.get("segment", "")))
    for c in rows:
        unit = c.get("unit")
        margin = c.get("margin")
        margin_s = "–" if margin is None else (f"×{margin:g}" if unit == "ratio" else f"{100 * margin:g} pts")
        verdict = c.get("verdict", "?")
        table.add_row(c.get("metric", "?"), c.get("segment", "?"), _fmt_value(c.get("stable"), unit),
                      _fmt_value(c.get("candidate"), unit), _fmt_effect(c), margin_s,
                      f"{c.get('n', 0)} / {c.get('n_stable', 0)}", Text(verdict, style=VERDICT_STYLE.get(verdict, "")),
                      _fmt_forecast(c))
    return table


def _fmt_forecast(c: dict) -> str:
    """A comparison that blocks promotion: '~11k more (~1 h 50 min)', or why more data will not do."""
    from service.judge.forecast import count_text, duration_text

    if c.get("needed_n") is not None:
        eta = c.get("eta_s")
        return f"~{count_text(c['needed_n'])} more" + (f" (~{duration_text(eta)})" if eta is not None else "")
    return "not at this effect" if c.get("forecast") else ""
