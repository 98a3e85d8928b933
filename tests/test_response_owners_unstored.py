"""An answer sent with `store: false` is kept nowhere upstream, so no follow-up can name it: the proxy
does not remember its id (which would take the place of a stored answer's in the bounded memory)
nor publish it, and a follow-up naming it is told the id is unknown."""

from __future__ import annotations

from functools import partial

import pytest
from starlette.testclient import TestClient

from service.config import parse_config
from service.proxy import app as proxy_app
from service.proxy.owners import ResponseOwners
from tests.fixtures.servers import proxy_config, sim_config, start_simulator

pytestmark = pytest.mark.timeout(120)


def test_unstored_answers_do_not_take_the_place_of_stored_ones(tmp_path, monkeypatch):
    sim = start_simulator(tmp_path, sim_config())
    try:
        monkeypatch.setattr(proxy_app, "ResponseOwners", partial(ResponseOwners, 2))  # a memory of two ids
        cfg = proxy_config(sim.url)  # a candidate on the route: a follow-up needs the id's model
        cfg["state_dir"] = str(tmp_path / "state")
        with TestClient(proxy_app.create_app(parse_config(cfg))) as client:
            ask = partial(client.post, "/v1/responses")
            stored = ask(json={"model": "support-bot", "input": "where is my order?"}).json()["id"]
            unstored = [ask(json={"model": "support-bot", "input": f"question {i}", "store": False}).json()["id"]
                        for i in range(2)]
            follow_up = ask(json={"model": "support-bot", "previous_response_id": stored, "input": "and then?"})
            assert follow_up.status_code == 200, follow_up.text
            assert follow_up.json()["previous_response_id"] == stored
            refused = ask(json={"model": "support-bot", "previous_response_id": unstored[0], "input": "and then?"})
            assert refused.status_code == 409
            assert refused.json()["error"]["code"] == "previous_response_unknown"
            assert "store: false" in refused.json()["error"]["message"]
    finally:
        sim.stop()
