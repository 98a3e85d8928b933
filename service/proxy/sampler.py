"""Which live requests become shadow evaluations: rate and per-minute cap. The spend cap
(`max_usd_per_hour`) is the shadow workers' (collectors/spend.py): they make the calls."""

from __future__ import annotations

import time

from service import metrics
from service.config import Config
from service.proxy.routing import unit_hash


class _Window:
    """Count within the current fixed window."""

    __slots__ = ("length_s", "start", "count")

    def __init__(self, length_s: float):
        self.length_s = length_s
        self.start = 0.0
        self.count = 0

    def roll(self, now: float) -> None:
        if now - self.start >= self.length_s:
            self.start, self.count = now, 0


class ShadowSampler:
    def __init__(self, config: Config):
        self.reload(config)

    def reload(self, config: Config) -> None:
        self._config = config
        self._minute = {route: _Window(60.0) for route in config.routes}

    def wanted(self, route: str, request_id: str) -> bool:
        """Deterministic by request id, so every replica samples the same requests."""
        rc = self._config.routes[route]
        return rc.candidate is not None and rc.shadow.sample_rate > 0 and \
            unit_hash("shadow", request_id) < rc.shadow.sample_rate

    def admit(self, route: str, now: float | None = None) -> bool:
        """Apply `max_per_minute` to a sampled request; a refusal is counted as a drop (reason=budget).
        Every candidate is shadowed on each sampled request: with several, each has an equal share."""
        minute = self._minute[route]
        minute.roll(now or time.monotonic())
        rc = self._config.routes[route]
        if minute.count >= rc.shadow.max_per_minute // max(len(rc.candidates), 1):
            metrics.shadow_dropped_total.labels(route, "budget").inc()
            return False
        minute.count += 1
        return True
