"""The shadow workers' metrics across the process boundary: the child takes a snapshot of its
samples (`snapshot`), the parent exposes them summed with its own (`ChildMetrics`).

Only the metrics the shadow workers write are relayed (`WORKER_METRICS`); the parent writes one of
them too (`shadow_dropped_total`, for queue_full and stopped). A snapshot holds cumulative values, so
a lost one costs nothing; it travels in the frame with the records it counts (collectors.embedded.child),
so a child killed at any moment leaves /metrics counting exactly the records the judge got. When a
child ends its last snapshot is kept, and the next child's values are added to it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric

from service import metrics

WORKER_METRICS = (metrics.shadow_requests_total, metrics.shadow_agreement_total, metrics.shadow_evaluations_total,
                  metrics.shadow_similarity, metrics.shadow_judge_total, metrics.shadow_dropped_total)

# family name -> {(sample name, sorted label pairs): value}
Snapshot = dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]


def _samples(metric) -> Iterator[tuple[Metric, dict]]:
    for family in metric.collect():
        values = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        yield family, values


def snapshot() -> Snapshot:
    """This process's worker metrics, without `_created` samples (the parent keeps its own)."""
    return {family.name: {k: v for k, v in values.items() if not k[0].endswith("_created")}
            for metric in WORKER_METRICS for family, values in _samples(metric)}


def _add(into: Snapshot, other: Snapshot) -> None:
    for name, values in other.items():
        target = into.setdefault(name, {})
        for key, value in values.items():
            target[key] = target.get(key, 0.0) + value


class ChildMetrics:
    """A prometheus Collector: the worker metrics of this process plus those of its shadow children."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended: Snapshot = {}   # children that are gone
        self._live: dict[int, Snapshot] = {}  # each running child's latest snapshot (a reload overlaps two)

    def update(self, child: int, snap: Snapshot) -> None:
        with self._lock:
            self._live[child] = snap

    def child_ended(self, child: int) -> None:
        with self._lock:
            _add(self._ended, self._live.pop(child, {}))

    def describe(self):
        for metric in WORKER_METRICS:
            yield from metric.describe()

    def collect(self):
        with self._lock:
            children: Snapshot = {}
            _add(children, self._ended)
            for snap in self._live.values():
                _add(children, snap)
        for metric in WORKER_METRICS:
            for family, values in _samples(metric):
                for key, value in children.get(family.name, {}).items():
                    values[key] = values.get(key, 0.0) + value
                out = Metric(family.name, family.documentation, family.type, family.unit)
                for (name, labels), value in values.items():
                    out.add_sample(name, dict(labels), value)
                yield out


_installed: ChildMetrics | None = None


def install() -> ChildMetrics:
    """Expose the worker metrics through ChildMetrics (once per process)."""
    global _installed
    if _installed is None:
        for metric in WORKER_METRICS:
            REGISTRY.unregister(metric)
        _installed = ChildMetrics()
        REGISTRY.register(_installed)
    return _installed
