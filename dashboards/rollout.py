"""Rollout dashboard: one route, stable vs candidate side by side."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import AnnotationQuery, Dashboard

from dashboards.panels import (
    DATASOURCE,
    ROUTE,
    dashboard,
    or_zero,
    quantile,
    rate_sum,
    ratio,
    row,
    sel,
    state_timeline,
    table,
    timeseries,
)

UID = "modelcanary-rollout"

REQ = "modelcanary_requests_total"
COMPLETED = 'outcome="completed"'
LIVE = 'segment!="other"'  # the route's chat-format calls: not its pass-through ones (embeddings, files), all stable's
BY_ROLE = "{{role}}"
PASSED_THROUGH = (" Stable's includes the route's pass-through calls (embeddings, files), which always go to "
                  "the stable model.")


def _annotations(d: Dashboard) -> Dashboard:
    """One annotation per judge decision kind (hold, the judge's standing verdict, is left out)."""
    colors = {"step": "blue", "promote": "green", "rollback": "red"}
    for decision, color in colors.items():
        d = d.annotation(
            AnnotationQuery()
            .name(f"decision: {decision}")
            .datasource(DATASOURCE)
            .enable(True)
            .icon_color(color)
            .expr(rate_sum("decision", "modelcanary_rollout_decisions_total", ROUTE, f'decision="{decision}"',
                           window="$__interval", fn="increase") + " > 0")
        )
    return d


def build() -> Dashboard:
    d = dashboard(
        UID,
        "modelcanary / Rollout",
        "One route's rollout: stable vs candidate (canary) on the live traffic, failures by cause and blame, "
        "cost, the canary weight and phase with the judge's decisions, and the per-segment capability matrix.",
    )
    d = _annotations(d)

    d = d.with_row(row("Outcomes"))
    d = d.with_panel(timeseries(
        "Completion rate by role",
        [(ratio("role", REQ, [ROUTE, LIVE, COMPLETED], [ROUTE, LIVE]), BY_ROLE)],
        unit="percentunit", max_val=1,
        description="Share of live requests that completed (not failed), per role; pass-through calls "
                    "(embeddings, files: segment other) left out.",
    ))
    d = d.with_panel(timeseries(
        "Client retry rate by role",
        [(f"({rate_sum('role', 'modelcanary_client_retries_total', ROUTE)} or {rate_sum('role', REQ, ROUTE, LIVE)} * 0)"
          f" / {rate_sum('role', REQ, ROUTE, LIVE)}", BY_ROLE)],
        unit="percentunit",
        description="Share of live requests recognised as a client's retry (x-stainless-retry-count > 0 or a repeated "
                    "request fingerprint), per role.",
    ))

    d = d.with_row(row("Latency"))
    d = d.with_panel(timeseries(
        "Request latency p50 / p95 / p99 by role",
        [(quantile(q, "modelcanary_request_duration_seconds", "role", ROUTE), f"{{{{role}}}} p{int(q * 100)}")
         for q in (0.5, 0.95, 0.99)],
        unit="s", description="End-to-end, as the client saw it." + PASSED_THROUGH,
    ))
    d = d.with_panel(timeseries(
        "Time to first token p50 / p95 by role",
        [(quantile(q, "modelcanary_time_to_first_token_seconds", "role", ROUTE), f"{{{{role}}}} p{int(q * 100)}")
         for q in (0.5, 0.95)],
        unit="s", description="Streaming requests only." + PASSED_THROUGH,
    ))

    d = d.with_row(row("Failures"))
    d = d.with_panel(timeseries(
        "Failures by cause",
        [(rate_sum("role, cause", "modelcanary_failures_total", ROUTE), "{{role}} · {{cause}}")],
        unit="reqps", stacked=True,
    ))
    d = d.with_panel(timeseries(
        "Failures by blame",
        [(rate_sum("role, blame", "modelcanary_failures_total", ROUTE), "{{role}} · {{blame}}")],
        unit="reqps", stacked=True,
        description="model = the model's answer failed a check; provider = transport or upstream status; "
                    "client = the request itself; proxy = modelcanary's own error.",
    ))

    d = d.with_row(row("Tokens and cost"))
    d = d.with_panel(timeseries(
        "Tokens by role and type",
        [(rate_sum("role, type", "modelcanary_tokens_total", ROUTE), "{{role}} · {{type}}")],
        unit="short", description="Tokens per second.",
    ))
    d = d.with_panel(timeseries(
        "Cost per completed request by role",
        [(f"{rate_sum('role', 'modelcanary_cost_usd_total', ROUTE)} / {rate_sum('role', REQ, ROUTE, LIVE, COMPLETED)}",
          BY_ROLE)],
        unit="currencyUSD",
    ))

    d = d.with_row(row("Rollout"))
    d = d.with_panel(timeseries(
        "Canary weight",
        [(f"max by (route) ({sel('modelcanary_rollout_canary_weight_ratio', ROUTE)})", "{{route}}")],
        unit="percentunit", max_val=1, width=8,
        description="Share of live traffic routed to the candidate (with rollout.scope segment, the largest "
                    "segment's weight: see the routing table's segment canary weight). Annotations mark the judge's step, promote and "
                    "rollback decisions.",
    ))
    d = d.with_panel(state_timeline(
        "Phase",
        [(f"max by (phase) ({sel('modelcanary_rollout_phase', ROUTE)})", "{{phase}}")],
        width=8,
    ))
    d = d.with_panel(timeseries(
        "Judge decisions",
        [(rate_sum("decision", "modelcanary_rollout_decisions_total", ROUTE, fn="increase"), "{{decision}}")],
        unit="short", bars=True, stacked=True, width=8,
        description="Decisions per interval: each step, promote and rollback; hold once each time the judge's "
                    "verdict turns to hold (it is not counted again while it stays so).",
    ))
    d = d.with_panel(table(
        "Routing table: segment × model serving now",
        [
            (rate_sum("segment, model, role", REQ, ROUTE, 'role=~"stable|canary"'), ""),
            (or_zero(f"max by (segment) ({sel('modelcanary_rollout_segment_weight_ratio', ROUTE)})", "segment"), ""),
            (or_zero(f"max by (segment, phase) ({sel('modelcanary_rollout_segment_phase', ROUTE)} == 1)", "segment"),
             ""),
        ],
        rename={"A": "requests/s", "B": "segment canary weight", "C": "segment phase"},
        units={"requests/s": "reqps", "segment canary weight": "percentunit", "segment phase": "none"},
        description="Which model answers each segment's live traffic now, and at what rate. With rollout.scope "
                    "segment each segment has its own canary weight and phase (a promoted segment is served by "
                    "its candidate as role stable); with scope route those columns read segment \"none\".",
    ))

    d = d.with_row(row("Capability matrix"))
    by = "segment, role"
    d = d.with_panel(table(
        "Capability matrix: segment × role over the time range",
        [
            (rate_sum(by, REQ, ROUTE, window="$__range", fn="increase"), ""),
            (ratio(by, REQ, [ROUTE, COMPLETED], [ROUTE], window="$__range", fn="increase"), ""),
            (f"{rate_sum(by, REQ, ROUTE, window='$__range', fn='increase')}"
             f" / on (segment) group_left () {rate_sum('segment', REQ, ROUTE, window='$__range', fn='increase')}", ""),
        ],
        rename={"A": "requests", "B": "completion rate", "C": "share of segment traffic"},
        units={"requests": "short", "completion rate": "percentunit", "share of segment traffic": "percentunit"},
        description="Per segment (capability dimension), each role's request count and completion rate over the "
                    "dashboard's time range. `modelcanary report ROUTE` gives the judge's intervals.",
    ))
    return d
