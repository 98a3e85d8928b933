"""Service health dashboard: the proxy, the event bus, the shadow workers and the processes."""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard

from dashboards.panels import RATE, ROUTE, dashboard, or_zero, rate_sum, row, sel, timeseries

UID = "modelcanary-health"

# Process metrics of modelcanary's own processes only (proxy, shadow workers, controller):
# any scrape target that exposes a modelcanary_* series.
OURS = 'and on (job, instance) count by (job, instance) ({__name__=~"modelcanary_.+"})'


def build() -> Dashboard:
    d = dashboard(
        UID,
        "modelcanary / Service health",
        "Request rate, in-flight requests and upstream retries of the proxy; the event bus (published, spooled, "
        "dropped); the shadow workers' consumer lag; CPU and memory of every modelcanary process.",
        route_all=True,
    )

    d = d.with_row(row("Proxy"))
    d = d.with_panel(timeseries(
        "Request rate by route and role",
        [(rate_sum("route, role", "modelcanary_requests_total", ROUTE), "{{route}} · {{role}}")],
        unit="reqps", stacked=True, width=8,
    ))
    d = d.with_panel(timeseries(
        "In-flight requests",
        [(f"sum by (route) ({sel('modelcanary_in_flight_requests', ROUTE)})", "{{route}}")],
        unit="short", width=8,
    ))
    d = d.with_panel(timeseries(
        "Upstream retries by cause",
        [(or_zero(rate_sum("route, cause", "modelcanary_upstream_retries_total", ROUTE), "cause"),
          "{{route}} · {{cause}}")],
        unit="ops", stacked=True, width=8,
        description="Retries the proxy made to the provider (within the retry budget). Reads 0 (cause=none) until "
                    "the first retry.",
    ))

    d = d.with_row(row("Event bus"))
    d = d.with_panel(timeseries(
        "Events published by topic",
        [(rate_sum("topic", "modelcanary_events_published_total"), "{{topic}}")],
        unit="ops", stacked=True, width=8,
    ))
    d = d.with_panel(timeseries(
        "Events spooled by topic",
        [(or_zero("sum by (topic) (modelcanary_events_spooled)", "topic"), "{{topic}}")],
        unit="short", width=8,
        description="Records waiting in the local spool while the broker is unreachable (Kafka mode). "
                    "Reads 0 (topic=none) when nothing was ever spooled.",
    ))
    d = d.with_panel(timeseries(
        "Events dropped by topic and reason",
        [(or_zero(rate_sum("topic, reason", "modelcanary_events_dropped_total"), "topic"), "{{topic}} · {{reason}}")],
        unit="ops", stacked=True, width=8,
        description="Records that could not be kept (queue full, spool full, …). Reads 0 (topic=none) until the "
                    "first drop.",
    ))

    d = d.with_row(row("Shadow workers"))
    d = d.with_panel(timeseries(
        "Consumer lag by topic and group",
        [(or_zero("max by (topic, group) (modelcanary_consumer_lag)", "topic"), "{{topic}} · {{group}}")],
        unit="short", width=24,
        description="Records behind the end of the topic, per consumer group (the shadow workers in Kafka mode). "
                    "Reads 0 (topic=none) when no consumer reports lag.",
    ))

    d = d.with_row(row("Processes"))
    d = d.with_panel(timeseries(
        "CPU by process",
        [(f"rate(process_cpu_seconds_total[{RATE}]) {OURS}", "{{job}} {{instance}}")],
        unit="percentunit",
        description="CPU seconds per second (1 = one core), for every scrape target exposing modelcanary metrics.",
    ))
    d = d.with_panel(timeseries(
        "Resident memory by process",
        [(f"process_resident_memory_bytes {OURS}", "{{job}} {{instance}}")],
        unit="bytes",
    ))
    return d
