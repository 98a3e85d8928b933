"""Which model stored a Responses-API answer, on which route, so that a follow-up naming it
(`previous_response_id`), and fetching, cancelling or deleting it by id, go to that model whatever
the split says; and how long the conversation was by then (its tokens and user turns), so that the
follow-up, which sends only its new turn, falls in the conversation's segment. Bounded: the oldest
ids are forgotten first. In Kafka mode every replica learns the ids the others served, and the
conversations' lengths, from the `response_id` and `conversation` of their outcomes."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from service.bus.base import Subscription
from service.config import RouteConfig
from service.recent import Recent
from service.records import OutcomeEvent

MEMORY = 100_000
KAFKA_WAIT_S = 2.0  # how long a follow-up waits for another replica's outcome to name the model and length


class Owner(NamedTuple):
    route: str
    model: str      # its key in `models:`

    def serves(self, route: str, rc: RouteConfig) -> bool:
        """Whether a request on `route` may reach this owner: the answer was made on that route, or
        by one of its models. Another route's answer never takes a request out of its route."""
        return self.route == route or self.model == rc.stable or self.model in rc.candidates


class ResponseOwners:
    def __init__(self, capacity: int = MEMORY):
        self._owners = Recent(capacity, width=3)  # response id -> index in _known, tokens, user turns
        self._known: list[Owner] = []
        self._index: dict[Owner, int] = {}
        self._waiting: dict[str, list[asyncio.Future]] = {}

    def remember(self, response_id: str, route: str, model_key: str, tokens: int = 0, turns: int = 0) -> None:
        owner = Owner(route, model_key)
        index = self._index.get(owner)
        if index is None:
            index = self._index[owner] = len(self._known)
            self._known.append(owner)
        self._owners.put(response_id, index, tokens, turns)
        for waiter in self._waiting.pop(response_id, ()):
            if not waiter.done():
                waiter.set_result(owner)

    def owner(self, response_id: str) -> Owner | None:
        found = self._owners.get(response_id)
        return None if found is None else self._known[found[0]]

    def conversation(self, response_id: object) -> tuple[int, int]:
        """(tokens, user turns) of the conversation up to a stored answer; (0, 0) when unknown."""
        found = self._owners.get(response_id) if isinstance(response_id, str) else None
        return (0, 0) if found is None else (found[1], found[2])

    async def wait(self, response_id: str, timeout_s: float) -> Owner | None:
        """The owner, waiting up to `timeout_s` for it to become known."""
        known = self.owner(response_id)
        if known is not None or timeout_s <= 0:
            return known
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(response_id, [])
        waiters.append(waiter)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            return None
        finally:
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters and self._waiting.get(response_id) is waiters:
                del self._waiting[response_id]


async def follow_outcomes(sub: Subscription, owners: ResponseOwners, stop: asyncio.Event) -> None:
    """Learn the response ids every replica served (Kafka mode), until `stop`."""
    try:
        while not stop.is_set():
            for record in await sub.get_batch(1000, 0.5):
                # an outcome with a response_id is a request's, which names its model
                if isinstance(record, OutcomeEvent) and record.response_id and record.model is not None \
                        and record.route is not None and owners.owner(record.response_id) is None:
                    length = record.conversation  # None in a record of an older version
                    tokens, turns = (length.tokens, length.user_turns) if length is not None else (0, 0)
                    owners.remember(record.response_id, record.route, record.model, tokens, turns)
    finally:
        await sub.close()
