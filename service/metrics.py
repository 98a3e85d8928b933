"""Prometheus metrics (DESIGN §7). Names, labels and buckets are the contract.

With several workers set PROMETHEUS_MULTIPROC_DIR before this module is imported
(`modelcanary serve --workers N` does); `/metrics` then aggregates every worker.
"""

from __future__ import annotations

import os
from typing import Generic, TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

# OpenTelemetry GenAI advice: 0.01 … 81.92 s, doubling.
DURATION_BUCKETS = tuple(round(0.01 * 2**i, 2) for i in range(14))
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
SIMILARITY_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)

requests_total = Counter(
    "modelcanary_requests_total", "Proxied requests by final outcome.",
    ["route", "model", "role", "segment", "outcome"],
)
failures_total = Counter(
    "modelcanary_failures_total", "Failed requests by cause and blame.",
    ["route", "model", "role", "cause", "blame"],
)
request_duration = Histogram(
    "modelcanary_request_duration_seconds", "End-to-end request duration as the client saw it (model "
    "requests: pass-through endpoints such as embeddings are not included).",
    ["route", "model", "role"], buckets=DURATION_BUCKETS,
)
time_to_first_token = Histogram(
    "modelcanary_time_to_first_token_seconds", "Time to the first streamed chunk (model requests only).",
    ["route", "model", "role"], buckets=TTFT_BUCKETS,
)
upstream_retries_total = Counter(
    "modelcanary_upstream_retries_total", "Retries the proxy made upstream.",
    ["route", "model", "cause"],
)
client_retries_total = Counter(
    "modelcanary_client_retries_total", "Requests recognised as a client's retry.",
    ["route", "model", "role"],
)
tokens_total = Counter(
    "modelcanary_tokens_total", "Tokens by type (input|output|cache_read|cache_write).",
    ["route", "model", "role", "type"],
)
cost_usd_total = Counter(
    "modelcanary_cost_usd_total", "Spend in US dollars from the models' prices.",
    ["route", "model", "role"],
)
feedback_total = Counter(
    "modelcanary_feedback_total", "Task outcomes reported through /v1/feedback.",
    ["route", "model", "role", "outcome"],
)
feedback_unmatched_total = Counter(
    "modelcanary_feedback_unmatched_total",
    "Feedback that matched no request (unknown or expired id; Kafka mode: none within the hold window). "
    "route is the client key's one route, else unknown.",
    ["route"],
)
in_flight_requests = Gauge(
    "modelcanary_in_flight_requests", "Requests being served now.", ["route"], multiprocess_mode="livesum",
)
shadow_requests_total = Counter(
    "modelcanary_shadow_requests_total", "Shadow calls by outcome.", ["route", "model", "outcome"],
)
shadow_dropped_total = Counter(
    "modelcanary_shadow_dropped_total", "Sampled requests not shadowed.", ["route", "reason"],
)
shadow_agreement_total = Counter(
    "modelcanary_shadow_agreement_total", "Answer agreement with the live stable answer.",
    ["route", "model", "comparison", "result"],
)
shadow_similarity = Histogram(
    "modelcanary_shadow_similarity", "Similarity (0..1) of a shadow answer to the live stable answer: the "
    "candidate's (comparison=candidate) and the stable model's asked again (noise_floor).",
    ["route", "model", "comparison"], buckets=SIMILARITY_BUCKETS,
)
shadow_judge_total = Counter(
    "modelcanary_shadow_judge_total", "Pairwise judge verdicts against the live stable answer, for the "
    "candidate (comparison=candidate) and the stable asked again (noise_floor).",
    ["route", "model", "comparison", "result"],
)
shadow_evaluations_total = Counter(
    "modelcanary_shadow_evaluations_total", "Evaluator results on shadow answers.",
    ["route", "model", "evaluator", "result"],
)
rollout_canary_weight = Gauge(
    "modelcanary_rollout_canary_weight_ratio",
    "Share of live traffic sent to the candidate (rollout.scope segment: the largest segment's weight; "
    "each segment's is modelcanary_rollout_segment_weight_ratio).",
    ["route"], multiprocess_mode="mostrecent",
)
rollout_phase = Gauge(
    "modelcanary_rollout_phase", "1 for the route's current phase.", ["route", "phase"],
    multiprocess_mode="mostrecent",
)
rollout_segment_weight = Gauge(
    "modelcanary_rollout_segment_weight_ratio", "Share of a segment's live traffic sent to its candidate "
    "(rollout.scope: segment).", ["route", "segment"], multiprocess_mode="mostrecent",
)
rollout_segment_phase = Gauge(
    "modelcanary_rollout_segment_phase", "1 for the segment's current phase (rollout.scope: segment).",
    ["route", "segment", "phase"], multiprocess_mode="mostrecent",
)
rollout_decisions_total = Counter(
    "modelcanary_rollout_decisions_total", "Judge decisions.", ["route", "decision"],
)
events_published_total = Counter(
    "modelcanary_events_published_total", "Events delivered to the bus.", ["topic"],
)
events_dropped_total = Counter(
    "modelcanary_events_dropped_total", "Events that could not be kept.", ["topic", "reason"],
)
events_spooled = Gauge(
    "modelcanary_events_spooled", "Events waiting in the local spool.", ["topic"], multiprocess_mode="livesum",
)
controller_leader = Gauge(
    "modelcanary_controller_leader", "1 on the active controller, 0 on a standby.", ["instance"],
    multiprocess_mode="mostrecent",
)
consumer_lag = Gauge(
    "modelcanary_consumer_lag", "Records behind the end of the topic, per consumer group.",
    ["topic", "group"], multiprocess_mode="livesum",
)

PHASES = ("shadow", "canary", "promoted", "rolled_back", "paused", "partial")
SEGMENT_PHASES = PHASES[:-1]


M = TypeVar("M", Counter, Gauge, Histogram)


class LabelCache(Generic[M]):
    """A metric's labelled children, looked up once per label set.

    `metric.labels(...)` validates, converts and locks on every call; on the hot path a dict hit
    is several times cheaper. Children are created on first use, exactly as `labels()` would.
    Label values must be bounded (DESIGN §7); `max_size` guards against a bug that makes them not.
    """

    __slots__ = ("metric", "children", "max_size")

    def __init__(self, metric: M, max_size: int = 10_000):
        self.metric = metric
        self.children: dict[tuple[str, ...], M] = {}
        self.max_size = max_size

    def get(self, *labels: str) -> M:
        child = self.children.get(labels)
        if child is None:
            if len(self.children) >= self.max_size:
                self.children.clear()
            child = self.children[labels] = self.metric.labels(*labels)
        return child


def count_queue_full(topic: str, record: object, shadow: bool = True) -> None:
    """A record the bus had no room for; a sampled request lost this way to the shadow workers (`shadow`:
    the full queue was theirs, or the one every record goes through) is also a shadow drop."""
    events_dropped_total.labels(topic, "queue_full").inc()
    if topic == "traffic" and shadow:
        shadow_dropped_total.labels(getattr(record, "route", "unknown"), "queue_full").inc()


# Counters an alert watches with increase(): their series start at 0, so that the first one counts
# (a series born at 1 has no increase to show).
ALERTED_SHADOW_DROPS = ("queue_full", "error", "stopped")
EVENT_DROP_REASONS = ("queue_full", "spool_full", "spool_error", "bad_record", "too_large", "closed")


def shadow_drops_from_zero(route: str) -> None:
    """The alerted shadow-drop series of a route at 0, so that increase() sees the first drop."""
    for reason in ALERTED_SHADOW_DROPS:
        shadow_dropped_total.labels(route, reason)


def set_rollout(route: str, stable: str, candidates: list[str], phase: str, weight: float) -> None:
    for decision in ("step", "hold", "promote", "rollback"):
        rollout_decisions_total.labels(route, decision)  # start at 0, so increase() sees the first one
    shadow_drops_from_zero(route)
    failures_total.labels(route, stable, "stable", "proxy_error", "proxy")
    for candidate in candidates:
        failures_total.labels(route, candidate, "canary", "proxy_error", "proxy")
    rollout_canary_weight.labels(route).set(weight)
    for p in PHASES:
        rollout_phase.labels(route, p).set(1.0 if p == phase else 0.0)


def start_event_counters(topics: tuple[str, ...]) -> None:
    for topic in topics:
        for reason in EVENT_DROP_REASONS:
            events_dropped_total.labels(topic, reason)


def set_segment_rollout(route: str, segment: str, phase: str, weight: float) -> None:
    rollout_segment_weight.labels(route, segment).set(weight)
    for p in SEGMENT_PHASES:
        rollout_segment_phase.labels(route, segment, p).set(1.0 if p == phase else 0.0)


def worker_ended(pid: int) -> None:
    """Multiprocess mode: a worker process has ended. Its live gauges (in-flight requests, spooled events,
    consumer lag) leave the sums; its counters and histograms stay in them, so totals never go back."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)


def exposition() -> tuple[bytes, str]:
    """The /metrics body, aggregated over workers in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        # process_* (CPU, memory, fds) cannot be aggregated over workers: these are the answering
        # worker's own, so the health dashboard's process panels show whichever worker answered
        # each scrape (an approximation of one worker, not the sum of all).
        ProcessCollector(registry=registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
