"""Which live requests become shadow evaluations: rate, per-minute cap, spend cap."""

from __future__ import annotations

import time

from service import metrics
from service.config import Config
from service.proxy.routing import unit_hash


class _Window:
    """Count and spend within the current fixed window."""

    __slots__ = ("length_s", "start", "count", "usd")

    def __init__(self, length_s: float):
        self.length_s = length_s
        self.start = 0.0
        self.count = 0
        self.usd = 0.0

    def roll(self, now: float) -> None:
        if now - self.start >= self.length_s:
            self.start, self.count, self.usd = now, 0, 0.0


class ShadowSampler:
    def __init__(self, config: Config):
        self.reload(config)

    def reload(self, config: Config) -> None:
        self._config = config
        self._minute = {route: _Window(60.0) for route in config.routes}
        self._hour = {route: _Window(3600.0) for route in config.routes}

    def wanted(self, route: str, request_id: str) -> bool:
        """Deterministic by request id, so every replica samples the same requests."""
        rc = self._config.routes[route]
        return rc.candidate is not None and rc.shadow.sample_rate > 0 and \
            unit_hash("shadow", request_id) < rc.shadow.sample_rate

    def admit(self, route: str, est_usd: float, now: float | None = None) -> bool:
        """Apply the caps to a sampled request; a refusal is counted as a drop (reason=budget)."""
        shadow = self._config.routes[route].shadow
        now = now or time.monotonic()
        minute, hour = self._minute[route], self._hour[route]
        minute.roll(now)
        hour.roll(now)
        if minute.count >= shadow.max_per_minute or (
            shadow.max_usd_per_hour is not None and hour.usd + est_usd > shadow.max_usd_per_hour
        ):
            metrics.shadow_dropped_total.labels(route, "budget").inc()
            return False
        minute.count += 1
        hour.usd += est_usd
        return True

    def estimated_cost(self, route: str, input_tokens: int, output_tokens: int) -> float:
        """What shadowing this request will cost: the candidate once, the stable again for the noise floor."""
        rc = self._config.routes[route]
        models = self._config.models
        cost = models[rc.candidate].price.cost(input_tokens, output_tokens) if rc.candidate else 0.0
        if rc.shadow.noise_floor:
            cost += models[rc.stable].price.cost(input_tokens, output_tokens)
        return cost
