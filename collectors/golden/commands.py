"""`modelcanary capture | dataset stats | replay`: flags in, exit code out (modelcanary/compose.py calls these).

Exit codes: 0 done (replay: nothing confidently worse), 1 replay found something confidently worse
(capture: the records could not be read), 2 bad input (a flag, the config, the dataset, the
live report to compare with), with the problem on stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from collectors.golden import capture as capturing
from collectors.golden import dataset, printing, sources, verdicts
from collectors.golden.replay import ReplayInputError, RouteRun, repro, run, shadow_summary
from service.admin.cli import AdminError, get_report
from service.config import Config, ConfigError, load_config
from service.records import dump
from service.rollout.controller import finite

BAD_INPUT = 2
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
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a time: give unix seconds, an ISO 8601 time "
                         f"(2025-01-31T12:00:00Z) or an age (90m, 2h, 7d)") from None
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
    if per_segment is not None and per_segment < 1:
        return _bad(f"--per-segment: must be at least 1, got {per_segment}")
    try:
        if config.events.backend == "kafka":
            where = f"Kafka {config.events.kafka.bootstrap_servers} ({config.events.kafka.topic_prefix}.traffic)"
            records, bad = sources.from_kafka(config)
        else:
            url = url or f"http://{config.server.host}:{config.server.port}"
            where = f"the proxy at {url}"
            records, bad = sources.from_proxy(url, token or os.environ.get(config.server.admin_token_env), t0, t1)
    except sources.SourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sel = capturing.select(records, config, per_segment, t0, t1)
    n = dataset.write(out, sel.cases)
    print(f"captured from {where}: {sel.summary()}" + (f"; {bad} undecodable records skipped" if bad else ""))
    if n:
        printing.console().print(printing.stats_table(dataset.stats(sel.cases)))
    print(f"wrote {n} cases to {out}")
    return 0


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
           as_json: bool, against_report: str | None) -> int:
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
        live = _live_reports(against_report, {c.route for c in cases}, candidate)
    except ReplayInputError as e:
        return _bad(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    reporter = printing.Reporter("replay")
    try:
        runs, client = asyncio.run(run(cases, config, candidate, stable, repeats, reporter))
    except ReplayInputError as e:
        return _bad(str(e))
    finally:
        reporter.close()
    results = {}
    worse = False
    out = printing.console()
    for route, rr in runs.items():
        segs = verdicts.per_segment(c.as_dict() for c in rr.comparisons)
        agreements = verdicts.against_live(segs, live[route], candidate) if live is not None else None
        worse = worse or verdicts.WORSE in segs.values()
        results[route] = _route_result(rr, segs, agreements)
        if not as_json:
            printing.print_run(out, rr, segs, agreements)
    code = 1 if worse else 0
    if as_json:
        body = {"schema": "modelcanary.replay/v1", "dataset": dataset_path, "candidate": candidate,
                "exit_code": code, "routes": results,
                "records": [dump(r) for rr in runs.values() for r in rr.records],
                "repro": repro(runs, client, config, Path(dataset_path), repeats)}
        print(json.dumps(finite(body), indent=2))
    else:
        print(f"replay: {'something is confidently worse (exit 1)' if worse else 'nothing confidently worse (exit 0)'}")
    return code


def _route_result(rr: RouteRun, segs: dict[str, str], agreements: list[verdicts.Agreement] | None) -> dict:
    return {"stable": rr.stable, "candidate": rr.candidate, "cases": len(rr.records), "skipped": dict(rr.skipped),
            "verdicts": segs, "alpha_per_comparison": rr.alpha_each, "comparisons_budget": rr.budget,
            "comparisons": [c.as_dict() for c in rr.comparisons], "matrix": shadow_summary(rr),
            "against_report": [a.as_dict() for a in agreements] if agreements is not None else None}


def _live_reports(url: str | None, routes: set[str], candidate: str) -> dict[str, dict] | None:
    """Each route's live report, fetched before the replay spends anything."""
    if url is None:
        return None
    out = {}
    for route in sorted(routes):
        try:
            body = get_report(url, os.environ.get(TOKEN_ENV), route)
        except AdminError as e:
            raise ReplayInputError(f"--against-report: {e}") from None
        if not isinstance(body, dict) or not body.get("report"):
            raise ReplayInputError(f"--against-report: route {route} has no live report yet at {url}")
        live = verdicts.live_candidates(body)
        if candidate not in live:
            raise ReplayInputError(f"--against-report: the live rollout of route {route} canaries "
                                   f"{', '.join(map(repr, live)) or 'no candidate'}, not {candidate!r}")
        out[route] = body
    return out
