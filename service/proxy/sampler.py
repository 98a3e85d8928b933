"""Which live requests become shadow evaluations: rate and per-minute cap. The spend cap
(`max_usd_per_hour`) is the shadow workers' (collectors/spend.py): they make the calls."""

from __future__ import annotations

import time

from service import metrics
from service.config import Config
from service.proxy.routing import unit_hash

BURST_S = 1.0  # the cap admits at most this many seconds' worth of evaluations at once
SHADOW_ALLOWED = frozenset({"0", "false", "no", "off"})


def opted_out(value: str | None) -> bool:
    """Whether `x-modelcanary-no-shadow` keeps a request from being replayed: any value but an explicit
    no (0, false, no, off), since a privacy control fails closed."""
    return value is not None and value.strip().lower() not in SHADOW_ALLOWED


class _Bucket:
    """A token bucket: `rate` per second, holding at most `capacity` (at least one)."""

    __slots__ = ("rate", "capacity", "tokens", "at")

    def __init__(self, per_minute: float):
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate * BURST_S)
        self.tokens = self.capacity if per_minute > 0 else 0.0
        self.at: float | None = None

    def take(self, now: float) -> bool:
        if self.at is not None:
            self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class ShadowSampler:
    def __init__(self, config: Config):
        self.reload(config)

    def reload(self, config: Config) -> None:
        self._config = config
        self._buckets = {route: _Bucket(rc.shadow.max_per_minute / max(len(rc.candidates), 1))
                         for route, rc in config.routes.items()}

    def wanted(self, route: str, request_id: str) -> bool:
        """Deterministic by request id, so every replica samples the same requests."""
        rc = self._config.routes[route]
        return rc.candidate is not None and rc.shadow.sample_rate > 0 and \
            unit_hash("shadow", request_id) < rc.shadow.sample_rate

    def admit(self, route: str, now: float | None = None) -> bool:
        """Apply `max_per_minute` to a sampled request, spread over the minute (a token bucket with one
        second's worth of burst), so shadow calls never come in a burst of a whole minute's budget.
        A refusal is counted as a drop (reason=budget). Every candidate is shadowed on each sampled
        request: with several, each has an equal share."""
        if not self._buckets[route].take(time.monotonic() if now is None else now):
            metrics.shadow_dropped_total.labels(route, "budget").inc()
            return False
        return True
