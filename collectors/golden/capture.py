"""`modelcanary capture`: sampled live traffic → a golden set (dataset.Case per request).

The input is what the bus carries: TrafficEvents (the sampled requests with the live stable
answer) and the OutcomeEvents of feedback, plus, in Kafka mode, the request outcomes that tie a
session's feedback to its latest request (sources.py reads them: from a running proxy's
`GET /admin/traffic` in memory mode, from the `{prefix}.traffic` and `{prefix}.outcomes` topics
in Kafka mode). `select` turns them into cases:

1. the time range: traffic with `since <= ts < until`;
2. redaction (`redaction.redact`): the route's `shadow.redact` patterns (applied again: the file
   may outlive a config that redacted less), then the credential rules, inside tool-call arguments
   and tool results too (JSON in a string); schemas (tool parameters, JSON output schemas) are
   kept as schemas;
3. deduplication by request fingerprint per route (the earliest case is kept);
4. stratified caps: at most `per_segment` cases per route and segment, a uniform sample chosen by
   a hash of the request id (the same input gives the same file).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from collectors.golden.dataset import Case, Feedback, fingerprint
from collectors.golden.redaction import redact
from service.config import Config
from service.proxy.recorder import compiled_redactions
from service.proxy.routing import unit_hash
from service.records import OutcomeEvent, Record, TrafficEvent


@dataclass
class Selection:
    cases: list[Case]
    read: int = 0                   # traffic events read
    out_of_range: int = 0
    unknown_route: int = 0          # routes not in the config (no redaction rules known): left out
    duplicates: int = 0
    over_cap: dict[str, int] = field(default_factory=dict)   # "route/segment" -> cases left out
    with_feedback: int = 0

    def summary(self) -> str:
        capped = sum(self.over_cap.values())
        return (f"{len(self.cases)} cases from {self.read} sampled requests: {self.out_of_range} outside the time "
                f"range, {self.unknown_route} of routes not in the config, {self.duplicates} duplicates, {capped} "
                f"over the per-segment cap; {self.with_feedback} with feedback")


def feedback_by_request(records: Iterable[OutcomeEvent]) -> dict[str, Feedback]:
    """Feedback per request id: given by request id, or by session (then about the session's latest
    request before it, as the judge counts it); the latest feedback on a request wins."""
    latest_of_session: dict[str, list[tuple[float, str]]] = {}
    feedback: list[OutcomeEvent] = []
    for ev in records:
        if ev.kind == "feedback":
            if ev.success is not None:
                feedback.append(ev)
        elif ev.session_id_hash:
            latest_of_session.setdefault(ev.session_id_hash, []).append((ev.ts, ev.request_id))
    out: dict[str, tuple[float, Feedback]] = {}
    for fb in feedback:
        target = fb.request_id
        sid = fb.session_id_hash
        if sid and (target == sid or target.endswith(":" + sid)):  # feedback by session
            before = [r for r in latest_of_session.get(sid, ()) if r[0] <= fb.ts]
            if not before:
                continue
            target = max(before)[1]
        if target not in out or out[target][0] <= fb.ts:
            out[target] = (fb.ts, Feedback(success=bool(fb.success), reason=fb.reason))
    return {rid: f for rid, (_, f) in out.items()}


def select(records: Iterable[Record], config: Config, per_segment: int | None = None,
           since: float | None = None, until: float | None = None) -> Selection:
    traffic: list[TrafficEvent] = []
    outcomes: list[OutcomeEvent] = []
    for r in records:
        if isinstance(r, TrafficEvent):
            traffic.append(r)
        elif isinstance(r, OutcomeEvent):
            outcomes.append(r)
    sel = Selection(cases=[], read=len(traffic))
    feedback = feedback_by_request(outcomes)
    patterns = {route: compiled_redactions(rc.shadow.redact) for route, rc in config.routes.items()}
    seen: set[tuple[str, str]] = set()
    kept: dict[tuple[str, str], list[Case]] = {}
    for ev in sorted(traffic, key=lambda e: e.ts):
        if (since is not None and ev.ts < since) or (until is not None and ev.ts >= until):
            sel.out_of_range += 1
            continue
        if ev.route not in config.routes:
            sel.unknown_route += 1
            continue
        case = _case(ev, patterns[ev.route], feedback.get(ev.request_id))
        key = (case.route, case.fingerprint or "")
        if key in seen:
            sel.duplicates += 1
            continue
        seen.add(key)
        kept.setdefault((case.route, case.segment), []).append(case)
    for (route, segment), cases in kept.items():
        if per_segment is not None and len(cases) > per_segment:
            sel.over_cap[f"{route}/{segment}"] = len(cases) - per_segment
            cases = sorted(cases, key=lambda c: unit_hash("capture", c.request_id))[:per_segment]
        sel.cases.extend(cases)
    sel.cases.sort(key=lambda c: (c.ts, c.request_id))
    sel.with_feedback = sum(1 for c in sel.cases if c.feedback is not None)
    return sel


def _case(ev: TrafficEvent, patterns: list[re.Pattern], feedback: Feedback | None) -> Case:
    def clean(obj: dict) -> dict:
        return redact(obj, patterns)  # type: ignore[return-value]  # a dict redacted is a dict

    request = clean(ev.request)
    primary = ev.primary
    live = primary.model_copy(update={"body": clean(primary.body) if primary.body is not None else None})
    if feedback is not None and feedback.reason:  # the client's own words: as open as its request
        feedback = Feedback(success=feedback.success, reason=str(redact(feedback.reason, patterns)))
    return Case(request_id=ev.request_id, ts=ev.ts, route=ev.route, segment=ev.segment,
                fingerprint=fingerprint(ev.route, request), config_version=ev.config_version, request=request,
                headers=ev.headers, live=live, feedback=feedback)
