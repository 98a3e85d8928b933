"""Following the rollouts topic: every replica adopts the latest state per route."""

from __future__ import annotations

import asyncio
import time

from service.judge.evidence import window_key
from service.records import RolloutState
from service.rollout.book import RolloutBook, precedence

CATCH_UP_FIRST_WAIT_S = 5.0    # how long an empty rollouts topic is waited for
CATCH_UP_MAX_S = 60.0


class RolloutHistory:
    """Per route, the states that opened evidence windows in its latest rollout (latest stable/candidate
    pair), in the order a follower adopting the rollouts topic from the start took them up. Reports are
    not kept (one state per window, so this stays small however long the topic is)."""

    def __init__(self) -> None:
        self._latest: dict[str, RolloutState] = {}
        self._windows: dict[str, list[RolloutState]] = {}

    def add(self, state: RolloutState) -> None:
        current = self._latest.get(state.route)
        if current is not None and precedence(state) <= precedence(current):
            return  # a stale state from another replica: nobody adopted it
        self._latest[state.route] = state
        opened = self._windows.setdefault(state.route, [])
        if opened and (opened[-1].stable, opened[-1].candidate) != (state.stable, state.candidate):
            opened.clear()  # a new rollout
        if not opened or window_key(opened[-1]) != window_key(state):
            opened.append(state.model_copy(update={"report": None}))

    def windows(self, route: str) -> list[RolloutState]:
        return list(self._windows.get(route, ()))


async def follow_rollouts(sub, book: RolloutBook, stop: asyncio.Event | None = None, *,
                          catch_up: bool = False, history: RolloutHistory | None = None) -> int:
    """Adopt rollout states from the topic. With catch_up=True return once caught up (an empty poll
    after data, or nothing within CATCH_UP_FIRST_WAIT_S); otherwise follow until `stop`. `history`,
    when given, sees every state read."""
    adopted = 0
    seen = False
    started = time.monotonic()
    while stop is None or not stop.is_set():
        batch = await sub.get_batch(500, 1.0 if catch_up else 0.5)
        for rec in batch:
            if not isinstance(rec, RolloutState):
                continue
            if history is not None:
                history.add(rec)
            if book.adopt(rec):
                adopted += 1
        if catch_up:
            seen = seen or bool(batch)
            waited = time.monotonic() - started
            if (seen and not batch) or (not seen and waited >= CATCH_UP_FIRST_WAIT_S) or waited >= CATCH_UP_MAX_S:
                return adopted
    return adopted
