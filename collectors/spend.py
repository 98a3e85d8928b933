"""`shadow.max_usd_per_hour`: what one shadow worker may spend per route and hour.

Every call a shadow evaluation makes (candidate, noise floor, LLM judge, stability) goes through
the worker's ShadowClient, which asks `check` before the call and `add`s its cost after; an
embeddings model's calls (similarity.configured.MeteredEmbedder) do the same. The hour
slides by the minute: the spend is that of the last 60 one-minute buckets. Calls already in flight
when the cap is reached still finish, so a worker can go over it by at most `collect.concurrency`
evaluations' calls. Each worker process enforces the cap on its own calls (see README, Config).
"""

from __future__ import annotations

import time
from collections import deque

from service.config import Config

BUCKET_S = 60.0
WINDOW_S = 3600.0


Key = str | tuple[str, str]   # a route, or (route, candidate): a candidate's own share of the route's cap


class OverBudget(Exception):
    """A shadow call not made: the route's `shadow.max_usd_per_hour` (or a candidate's share) is spent."""

    def __init__(self, key: Key, cap_usd: float):
        if isinstance(key, tuple):
            super().__init__(f"route {key[0]}: candidate {key[1]}'s share ({cap_usd:g} USD) of "
                             "shadow.max_usd_per_hour reached")
            key = key[0]
        else:
            super().__init__(f"route {key}: shadow.max_usd_per_hour ({cap_usd:g} USD) reached")
        self.route = key


class SpendCap:
    def __init__(self, config: Config):
        self._caps: dict[Key, float | None] = {route: rc.shadow.max_usd_per_hour for route, rc in config.routes.items()}
        # several candidates: each has an equal share of its route's cap, spent on its own calls
        for route, rc in config.routes.items():
            cap = rc.shadow.max_usd_per_hour
            if cap is not None and len(rc.candidates) > 1:
                self._caps.update({(route, c): cap / len(rc.candidates) for c in rc.candidates})
        self._buckets: dict[Key, deque[list[float]]] = {}  # key -> [bucket start, usd] oldest first

    def check(self, route: str, now: float | None = None, share: str | None = None) -> None:
        """Raise OverBudget when the route's spend in the last hour has reached its cap, or the spend
        of candidate `share` its share of it."""
        for key in (route,) if share is None else (route, (route, share)):
            cap = self._caps.get(key)
            if cap is not None and self.spent(key, now) >= cap:
                raise OverBudget(key, cap)

    def add(self, route: str, usd: float, now: float | None = None, share: str | None = None) -> None:
        """Count a call's cost against the route (and against candidate `share`'s share)."""
        if share is not None:
            self._add((route, share), usd, now)
        self._add(route, usd, now)

    def _add(self, route: Key, usd: float, now: float | None) -> None:
        if not usd or self._caps.get(route) is None:
            return
        now = time.monotonic() if now is None else now
        buckets = self._buckets.setdefault(route, deque())
        start = now - now % BUCKET_S
        if buckets and buckets[-1][0] == start:
            buckets[-1][1] += usd
        else:
            buckets.append([start, usd])

    def spent(self, route: Key, now: float | None = None) -> float:
        """USD spent on the route's shadow calls in the last hour (to the minute)."""
        buckets = self._buckets.get(route)
        if not buckets:
            return 0.0
        now = time.monotonic() if now is None else now
        while buckets and buckets[0][0] <= now - WINDOW_S:
            buckets.popleft()
        return sum(usd for _, usd in buckets)
