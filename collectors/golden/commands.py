"""`modelcanary capture | dataset stats | replay`: flags in, exit code out (modelcanary/compose.py calls these).

Exit codes: 0 done (replay: nothing confidently worse), 1 replay found something confidently worse
(capture: the records could not be read, or none was selected), 2 bad input (a flag, the config,
the dataset, the live report to compare with), a replay that could not compare anything on a route
(the candidate or the stable model answered none of its cases) or that failed, with the problem on
stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import sys
import textwrap
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from collectors.golden import capture as capturing
from collectors.golden import dataset, printing, sources, verdicts
from collectors.golden.replay import (
    LatencyEvidence,
    ReplayInputError,
    RouteRun,
    Unanswered,
    latency_evidence,
    repro,
    run,
    servable,
    shadow_summary,
    unanswered,
)
from service.admin.cli import AdminError, BadURLError, check_url, get_report
from service.config import Config, ConfigError, load_config
from service.judge.comparisons import MIN_COUNT_FOR_VERDICT
from service.records import EvaluationRecord, dump
from service.rollout.controller import finite

BAD_INPUT = 2
RECORDS = "\x00records"   # where print_json puts the records in a body
TOKEN_ENV = "MODELCANARY_ADMIN_TOKEN"
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(flag: str, text: str | None, now: float | None = None) -> float | None:
    """A unix time in seconds, an ISO 8601 time (UTC unless it names a zone), or an age such as
    `90m`, `2h`, `7d` (that long before now)."""
    if text is None:
        return None
    if m := _DURATION.fullmatch(text.strip()):
        return (time.time() if now is None else now) - float(m.group(1)) * _UNIT_S[m.group(2)]
    not_a_time = ValueError(f"{flag}: {text!r} is not a time: give unix seconds, an ISO 8601 time "
                            f"(2025-01-31T12:00:00Z) or an age (90m, 2h, 7d)")
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):  # nan, inf, 1e400
            raise not_a_time
        return seconds
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise not_a_time from None
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


def _bad(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return BAD_INPUT


def _config(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        raise ReplayInputError(e.explain().removeprefix("error: ")) from None


# ---- capture ----------------------------------------------------------------------------------------

def capture(config_path: str, out: str, per_segment: int | None, since: str | None, until: str | None,
            url: str | None, token: str | None) -> int:
    try:
        config = _config(config_path)
        t0, t1 = parse_time("--since", since), parse_time("--until", until)
    except (ReplayInputError, ValueError) as e:
        return _bad(str(e))
    if t0 is not None and t1 is not None and t0 >= t1:
        return _bad(f"--since {since} is not before --until {until}: no traffic is in between")
    if per_segment is not None and per_segment < 1:
        return _bad(f"--per-segment: must be at least 1, got {per_segment}")
    try:
        dataset.check_writable(out)   # before the traffic is fetched, not after
    except ValueError as e:
        return _bad(f"--out: {e}")
    try:
        records, bad, where = _read_records(config, url, token, t0, t1)
    except AdminError as e:
        return _bad(str(e))
    except sources.SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sel = capturing.select(records, config, per_segment, t0, t1)
    print(f"captured from {where}: {sel.summary()}" + (f"; {bad} undecodable records skipped" if bad else ""))
    if not sel.cases:  # a curated file of the same name stays as it was
        print(f"error: no case to write; {out} was not written", file=sys.stderr)
        return 1
    try:
        n = dataset.write(out, sel.cases)
    except OSError as e:
        return _bad(f"--out: cannot write {out!r}: {e.strerror or e}")
    printing.console().print(printing.stats_table(dataset.stats(sel.cases)))
    print(f"wrote {n} cases to {out}")
    return 0


def _read_records(config: Config, url: str | None, token: str | None, t0: float | None,
                  t1: float | None) -> tuple[list, int, str]:
    """(records, undecodable, where from); AdminError for a bad --url, SourceError when unreadable."""
    if config.events.backend == "kafka":
        kafka = config.events.kafka
        records, bad = sources.from_kafka(config)
        return records, bad, f"Kafka {kafka.bootstrap_servers} ({kafka.topic_prefix}.traffic)"
    if url is not None:
        check_url("--url", url)
    else:
        url = check_url("--url (default: the config's server.host and server.port)", _proxy_url(config))
    names = tuple(dict.fromkeys((config.server.admin_token_env, TOKEN_ENV)))  # the proxy's variable, then the CLI's
    found = token or next((value for name in names if (value := os.environ.get(name))), None)
    records, bad = sources.from_proxy(url, found, t0, t1, token_hint="pass --token or set " + " or ".join(names))
    return records, bad, f"the proxy at {url}"


def _proxy_url(config: Config) -> str:
    host = config.server.host
    return f"http://{f'[{host}]' if ':' in host else host}:{config.server.port}"


# ---- dataset stats ------------------------------------------------------------------------------------

def dataset_stats(path: str) -> int:
    try:
        cases = dataset.load(path)
    except dataset.DatasetError as e:
        print(e.explain(), file=sys.stderr)
        return BAD_INPUT
    printing.console().print(printing.stats_table(dataset.stats(cases)))
    return 0


# ---- replay -------------------------------------------------------------------------------------------

def replay(dataset_path: str, candidate: str, stable: str | None, repeats: int | None, config_path: str | None,
           as_json: bool, against_report: str | None, routes: list[str] | None = None) -> int:
    try:
        cases = dataset.load(dataset_path)
    except dataset.DatasetError as e:
        print(e.explain(), file=sys.stderr)
        return BAD_INPUT
    config_path = config_path or os.environ.get("MODELCANARY_CONFIG")
    if not config_path:
        return _bad("replay needs --config FILE (or MODELCANARY_CONFIG): the providers and models to ask")
    try:
        config = _config(config_path)
        cases, left_out = servable(cases, config, candidate, stable, routes)
        live = _live_reports(against_report, {c.route for c in cases}, candidate)
    except ReplayInputError as e:
        return _bad(str(e))
    for route, why in left_out.items():
        print(f"replay: route {route} left out: {why} (name the routes to replay with --route)", file=sys.stderr)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    reporter = printing.Reporter("replay")
    try:
        runs, client = asyncio.run(run(cases, config, candidate, stable, repeats, reporter))
    except ReplayInputError as e:
        return _bad(str(e))
    except Exception:  # never exit 1 (which says "worse") for a failure of the replay itself
        logging.getLogger("modelcanary.replay").exception("the replay failed; no verdict")
        return BAD_INPUT
    finally:
        reporter.close()
    results, worse, silent = _judged(runs, live, candidate, config, None if as_json else printing.console())
    _warn_latency(runs)
    code = BAD_INPUT if silent else 1 if worse else 0
    if as_json:
        body = {"schema": "modelcanary.replay/v1", "dataset": dataset_path, "candidate": candidate,
                "exit_code": code, "routes": results, "routes_left_out": left_out, "records": RECORDS,
                "repro": repro(runs, client, config, Path(dataset_path), repeats)}
        print_json(body, (r for rr in runs.values() for r in rr.records))
    else:
        print(f"replay: {_summary(code)}")
    for message in silent.values():
        print(f"error: {message}", file=sys.stderr)
    return code


def print_json(body: dict, records: Iterable[EvaluationRecord]) -> None:
    """`body` as `json.dumps(finite(...), indent=2)` prints it, its RECORDS value the list of `records`,
    each serialised on its own: a large replay's records as one document would take several times
    the memory they take."""
    head, tail = json.dumps(finite(body), indent=2).split(json.dumps(RECORDS))
    out = sys.stdout
    out.write(head)
    sep = "[\n"
    for record in records:
        out.write(sep + textwrap.indent(json.dumps(finite(dump(record)), indent=2), "    "))
        sep = ",\n"
    out.write("[]" if sep == "[\n" else "\n  ]")
    out.write(tail + "\n")


def _summary(code: int) -> str:
    if code == BAD_INPUT:
        return "nothing could be compared on a route: see the error (exit 2)"
    return "something is confidently worse (exit 1)" if code == 1 else "nothing confidently worse (exit 0)"


def _judged(runs: dict[str, RouteRun], live: LiveReports | None, candidate: str, config: Config,
            out: Console | None) -> tuple[dict, bool, dict[str, str]]:
    """(each route's result, whether anything is worse, why nothing could be compared, per route where
    that is so); each route printed on `out` unless None (--json)."""
    results = {}
    worse = False
    silent = {}
    for route, rr in runs.items():
        sides = unanswered(rr)
        segs = verdicts.per_segment(c.as_dict() for c in rr.comparisons)
        if sides:  # a side that answered nothing: its failures are no verdict on the candidate
            segs = dict.fromkeys(segs, verdicts.NOT_COMPARED)
        body = live.reports.get(route) if live is not None else None
        agreements = verdicts.against_live(segs, body, candidate) if body is not None else None
        not_compared = live.skipped.get(route) if live is not None else None
        worse = worse or verdicts.WORSE in segs.values()
        if sides or not rr.records:
            silent[route] = _silent_message(route, rr, sides, config)
        results[route] = {**_route_result(rr, segs, agreements), "against_report_skipped": not_compared,
                          "unanswered": [vars(u) for u in sides]}
        if out is not None:
            printing.print_run(out, rr, segs, agreements)
            if not_compared:
                out.print(f"route {route}: not compared against a live report: {not_compared}")
    return results, worse, silent


def _silent_message(route: str, rr: RouteRun, sides: list[Unanswered], config: Config) -> str:
    """One line: why nothing could be compared on the route (every case skipped, or which side(s) got
    no answer, with the dominant cause), and what to check."""
    if not rr.records:
        why = ", ".join(f"{reason}: {n}" for reason, n in rr.skipped.items())
        return (f"replay: route {route}: every case was skipped ({why}), so nothing could be compared; "
                f"raise the limit in the config given to replay, or replay fewer cases")
    said = [f"the {u.role} {u.model!r} (provider {config.models[u.model].provider}: {u.cause} on "
            f"{u.n_cause} of {u.n_calls} calls)" for u in sides]
    return (f"replay: route {route}: no case got an answer from {' nor from '.join(said)}, so nothing "
            f"could be compared; check that the provider is reachable and its key is set")


def _warn_latency(runs: dict[str, RouteRun]) -> None:
    """A line on stderr for each route that discarded latencies left too few pairs for a latency verdict."""
    for rr in runs.values():
        ev = latency_evidence(rr)
        if ev.pairs < MIN_COUNT_FOR_VERDICT and any(ev.discarded.values()):
            print(f"warning: {_latency_warning(rr, ev)}", file=sys.stderr)


def _latency_warning(rr: RouteRun, ev: LatencyEvidence) -> str:
    return (f"route {rr.route}: {ev.pairs} latency pairs (fewer than {MIN_COUNT_FOR_VERDICT}: latency gets no "
            f"verdict): {ev.discarded['candidate']} of {ev.completed['candidate']} candidate and "
            f"{ev.discarded['stable']} of {ev.completed['stable']} stable latencies were discarded, measured while "
            f"this machine's event loop ran late; replay on a less busy machine or with a lower collect.concurrency")


def _route_result(rr: RouteRun, segs: dict[str, str], agreements: list[verdicts.Agreement] | None) -> dict:
    return {"stable": rr.stable, "candidate": rr.candidate, "cases": len(rr.records), "skipped": dict(rr.skipped),
            "latency": latency_evidence(rr).as_dict(),
            "verdicts": segs, "alpha_per_comparison": rr.alpha_each, "comparisons_budget": rr.budget,
            "comparisons": [c.as_dict() for c in rr.comparisons], "matrix": shadow_summary(rr),
            "against_report": [a.as_dict() for a in agreements] if agreements is not None else None}


@dataclass
class LiveReports:
    reports: dict[str, dict]    # route -> its live report, for the routes whose rollout canaries the candidate
    skipped: dict[str, str]     # route -> why it is not compared against a live report


def _live_reports(url: str | None, routes: set[str], candidate: str) -> LiveReports | None:
    """Each route's live report, fetched before the replay spends anything. A route whose live
    rollout is about other candidates is left out, saying so; an error when no route is left."""
    if url is None:
        return None
    live = LiveReports({}, {})
    waiting = []     # routes that canary the candidate but have no report yet
    for route in sorted(routes):
        try:
            body = get_report(url, os.environ.get(TOKEN_ENV), route, flag="--against-report",
                              token_hint=f"set {TOKEN_ENV}")
        except AdminError as e:
            message = str(e) if isinstance(e, BadURLError) else f"--against-report: {e}"
            raise ReplayInputError(message) from None
        others = _other_candidates(body, candidate)
        if others is not None:
            live.skipped[route] = f"its live rollout canaries {others}, not {candidate!r}"
        elif not isinstance(body, dict) or not body.get("report"):
            waiting.append(route)
            live.skipped[route] = f"its live rollout of {candidate!r} has no report yet"
        else:
            live.reports[route] = body
    if not live.reports:
        if waiting:
            raise ReplayInputError(f"--against-report: route {waiting[0]} has no live report yet at {url}")
        raise ReplayInputError(f"--against-report: no route of the dataset canaries {candidate!r} live at {url}: "
                               + "; ".join(f"route {r}: {why}" for r, why in sorted(live.skipped.items())))
    return live


def _other_candidates(body: object, candidate: str) -> str | None:
    """None when the route's live rollout canaries `candidate` (or says nothing), else the ones it does."""
    if not isinstance(body, dict):
        return None
    live = verdicts.live_candidates(body) if body.get("report") else _state_candidates(body)
    return None if candidate in live else ", ".join(map(repr, live)) or "no candidate"


def _state_candidates(body: dict) -> list[str]:
    state = body.get("state") or {}
    return list(state.get("candidates") or ()) or [c for c in (state.get("candidate"),) if c]
