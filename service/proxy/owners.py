"""Which model stored a Responses-API answer, so that a follow-up naming it (`previous_response_id`)
goes to that model whatever the split says. Bounded: the oldest ids are forgotten first. In Kafka
mode every replica learns the ids the others served from the `response_id` of their outcomes."""

from __future__ import annotations

import asyncio

from service.bus.base import Subscription
from service.recent import Recent
from service.records import OutcomeEvent

MEMORY = 100_000
KAFKA_WAIT_S = 2.0  # how long a follow-up waits for another replica's outcome to name the model


class ResponseOwners:
    def __init__(self, capacity: int = MEMORY):
        self._owners = Recent(capacity, width=1)  # response id -> index in _models
        self._models: list[str] = []
        self._index: dict[str, int] = {}
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self.learning = False  # also from the other replicas' outcomes (Kafka mode, follow_outcomes)

    def remember(self, response_id: str, model_key: str) -> None:
        index = self._index.get(model_key)
        if index is None:
            index = self._index[model_key] = len(self._models)
            self._models.append(model_key)
        self._owners.put(response_id, index)
        for waiter in self._waiting.pop(response_id, ()):
            if not waiter.done():
                waiter.set_result(model_key)

    def owner(self, response_id: str) -> str | None:
        found = self._owners.get(response_id)
        return None if found is None else self._models[found[0]]

    async def wait(self, response_id: str, timeout_s: float) -> str | None:
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
    owners.learning = True
    try:
        while not stop.is_set():
            for record in await sub.get_batch(1000, 0.5):
                # an outcome with a response_id is a request's, which names its model
                if isinstance(record, OutcomeEvent) and record.response_id and record.model is not None:
                    owners.remember(record.response_id, record.model)
    finally:
        await sub.close()
