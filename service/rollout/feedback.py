"""Resolving feedback (Kafka mode): any proxy replica accepts `POST /v1/feedback`; one that did not
serve the request publishes it unresolved, naming the request by id or by session, with the routes
its client key may give feedback on. The controller matches it here against the outcomes it consumes
anyway: by request id, or by session hash (the session's latest request). The client key's routes
are checked on the matched request's route.

Topics are not ordered against each other, so feedback may arrive before its request's outcome: it
is held up to `hold_s` and matched when the outcome comes. Feedback that never matches is counted
(`modelcanary_feedback_unmatched_total` and the report's `feedback` section), never dropped silently.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable

from service import metrics
from service.feedback import SESSION, Served, ServedMemory, unmatched_route
from service.recent import Recent
from service.records import OutcomeEvent

log = logging.getLogger("modelcanary.controller")

REQUESTS_REMEMBERED = 500_000  # ~24 MB, allocated at start: ~16 min of requests at 500 req/s
MAX_HELD = 100_000             # feedback waiting for its outcome; beyond this it counts unmatched at once
SEEN_MEMORY = 100_000          # feedback ids remembered against a second delivery


class FeedbackResolver:
    def __init__(self, hold_s: float, capacity: int = REQUESTS_REMEMBERED,
                 clock: Callable[[], float] = time.monotonic):
        self.hold_s = hold_s
        self.clock = clock
        self._served = ServedMemory(capacity)
        self._seen = Recent(SEEN_MEMORY)
        self._by_id: dict[str, list[OutcomeEvent]] = {}
        self._by_session: dict[str, list[OutcomeEvent]] = {}
        self._expiry: deque[tuple[float, OutcomeEvent]] = deque()
        self.held = 0
        self.matched: Counter[str] = Counter()    # by route
        self.refused: Counter[str] = Counter()    # by route: the client key may not use it
        self.unmatched: Counter[str] = Counter()  # by route label (see unmatched_route)

    def outcome(self, ev: OutcomeEvent) -> list[OutcomeEvent]:
        """Remember a request's outcome; the held feedback it resolves, resolved."""
        if ev.kind != "request" or ev.route is None or ev.model is None or ev.role is None:
            return []
        self._served.remember(ev.request_id, (ev.route, ev.model, ev.role, ev.segment or "chat"), ev.session_id_hash)
        waiting = self._by_id.pop(ev.request_id, [])
        if ev.session_id_hash:
            waiting += self._by_session.pop(ev.session_id_hash, [])
        out = []
        for fb in waiting:
            self.held -= 1
            found = self._lookup(fb)
            resolved = self._resolve(fb, found) if found is not None else None
            if resolved is not None:
                out.append(resolved)
        return out

    def feedback(self, ev: OutcomeEvent) -> OutcomeEvent | None:
        """A feedback event, resolved (to count now), or None: held for its outcome, refused, or seen."""
        if ev.route is not None:
            return ev  # the replica that served the request resolved it
        if not self._seen.add(("feedback", ev.request_id, ev.ts)):
            return None  # delivered twice
        found = self._lookup(ev)
        if found is not None:
            return self._resolve(ev, found)
        if self.held >= MAX_HELD:
            self._unmatched(ev, "too much feedback waiting")
            return None
        key = ev.request_id
        if key.startswith(SESSION):
            self._by_session.setdefault(key[len(SESSION):], []).append(ev)
        else:
            self._by_id.setdefault(key, []).append(ev)
        self._expiry.append((self.clock() + self.hold_s, ev))
        self.held += 1
        return None

    def expire(self) -> int:
        """Count the feedback held past `hold_s` as unmatched; returns how many."""
        now, n = self.clock(), 0
        while self._expiry and self._expiry[0][0] <= now:
            _, ev = self._expiry.popleft()
            key = ev.request_id
            table, k = (self._by_session, key[len(SESSION):]) if key.startswith(SESSION) else (self._by_id, key)
            waiting = table.get(k)
            if waiting is None or not any(w is ev for w in waiting):
                continue  # matched meanwhile
            waiting[:] = [w for w in waiting if w is not ev]
            if not waiting:
                del table[k]
            self.held -= 1
            self._unmatched(ev, f"no request with that id within {self.hold_s:g} s")
            n += 1
        return n

    def summary(self, route: str) -> dict:
        """The report's `feedback` section for one route."""
        return {"matched": self.matched[route], "refused": self.refused[route],
                "unmatched": self.unmatched[route], "unmatched_unknown_route": self.unmatched["unknown"],
                "waiting": self.held, "hold_s": self.hold_s}

    def _lookup(self, ev: OutcomeEvent) -> tuple[str, Served] | None:
        key = ev.request_id
        if key.startswith(SESSION):
            return self._served.served(None, ev.session_id_hash or key[len(SESSION):])
        return self._served.served(key, None)

    def _resolve(self, ev: OutcomeEvent, found: tuple[str, Served]) -> OutcomeEvent | None:
        key, served = found
        if ev.allowed_routes is not None and served.route not in ev.allowed_routes:
            self.refused[served.route] += 1
            log.warning("feedback on a request of route %s refused: its client key may not use that route",
                        served.route)
            return None
        self.matched[served.route] += 1
        metrics.feedback_total.labels(served.route, served.model, served.role,
                                      "success" if ev.success else "failure").inc()
        return ev.model_copy(update={
            "request_id": key.removeprefix(SESSION), "route": served.route, "model": served.model,
            "role": served.role, "segment": served.segment, "session_id_hash": served.session_id_hash,
            "allowed_routes": None})

    def _unmatched(self, ev: OutcomeEvent, why: str) -> None:
        label = unmatched_route(ev.allowed_routes)
        self.unmatched[label] += 1
        metrics.feedback_unmatched_total.labels(label).inc()
        log.info("feedback unmatched (route %s): %s", label, why)
