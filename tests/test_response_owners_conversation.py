"""A replica learns a Responses conversation's length from another replica's outcome (`conversation`),
and still reads an outcome of an older version, which has none."""

from __future__ import annotations

import asyncio
import json

from service.bus.memory import MemoryBus
from service.proxy.owners import ResponseOwners, follow_outcomes
from service.records import OutcomeEvent, dump, load

OLDER_OUTCOME = {"schema": "modelcanary.outcome/v1", "request_id": "r1", "ts": 1.0, "route": "support-bot",
                 "model": "stable-m", "role": "stable", "segment": "chat", "outcome": "completed",
                 "response_id": "resp_old"}


def test_follow_outcomes_learns_the_conversation_length_and_reads_older_outcomes():
    newer = dump(OutcomeEvent(request_id="r2", ts=2.0, route="support-bot", model="candidate-m", role="canary",
                              segment="multi_turn", outcome="completed", response_id="resp_new",
                              conversation={"tokens": 9100, "user_turns": 3}))
    assert newer["conversation"] == {"tokens": 9100, "user_turns": 3}

    async def learn() -> tuple[tuple[int, int], tuple[int, int], str | None]:
        bus, owners, stop = MemoryBus(), ResponseOwners(), asyncio.Event()
        following = asyncio.create_task(follow_outcomes(bus.subscribe(["outcomes"], None), owners, stop))
        for data in (OLDER_OUTCOME, newer):  # as the Kafka consumer decodes them
            bus.publish("outcomes", load(json.loads(json.dumps(data))))
        new_owner = await owners.wait("resp_new", 10)
        await owners.wait("resp_old", 10)
        stop.set()
        await following
        return owners.conversation("resp_new"), owners.conversation("resp_old"), new_owner and new_owner.model

    new, old, model = asyncio.run(learn())
    assert (new, model) == ((9100, 3), "candidate-m")
    assert old == (0, 0)  # an older replica's outcome names the model only
