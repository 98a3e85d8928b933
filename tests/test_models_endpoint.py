"""`GET /v1/models/{id}`, the SDKs' `models.retrieve`: answered by the proxy for a route or model key
the client may use, in the shape of the client that asks (Anthropic's when the request carries
`anthropic-version`, as `GET /v1/models` answers), else a 404 `model_not_found` in that shape."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.fixtures.servers import start_proxy

KEYS = {"MC_CLIENT_KEYS": "sk-all=*;sk-support=support-bot,stable-m"}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    nowhere = "http://127.0.0.1:9/v1"  # never called: the proxy answers these itself
    server = start_proxy(tmp_path_factory.mktemp("models"), {
        "server": {"client_keys_env": "MC_CLIENT_KEYS"},
        "providers": {"oai": {"base_url": nowhere}, "claude": {"base_url": nowhere, "api": "anthropic"}},
        "models": {"stable-m": {"provider": "oai", "name": "good-model"},
                   "stable-a": {"provider": "claude", "name": "claude-good"}},
        "routes": {"support-bot": {"stable": "stable-m"}, "claude-bot": {"stable": "stable-a"}},
    }, env=KEYS)
    yield server
    server.stop()


def _openai(proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=10)


def _anthropic(proxy, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0, timeout=10)


def test_openai_sdk_retrieves_a_route_or_model_key_it_may_use(proxy):
    client = _openai(proxy, "sk-support")
    for name in ("support-bot", "stable-m"):
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == (name, "model", "modelcanary")
    assert [m.id for m in client.models.list()] == ["support-bot"]
    for name in ("claude-bot", "no-such-model"):  # another key's route, and no route at all: alike
        with pytest.raises(openai.NotFoundError) as missing:
            client.models.retrieve(name)
        assert missing.value.code == "model_not_found" and name in missing.value.message
    assert _openai(proxy, "sk-all").models.retrieve("claude-bot").id == "claude-bot"
    with pytest.raises(openai.AuthenticationError):
        _openai(proxy, "sk-unknown").models.retrieve("support-bot")


def test_anthropic_sdk_retrieves_a_route_in_its_own_shape(proxy):
    client = _anthropic(proxy, "sk-all")
    model = client.models.retrieve("claude-bot")
    assert (model.id, model.type, model.display_name) == ("claude-bot", "model", "claude-bot")
    assert model.created_at.year == 1970
    with pytest.raises(anthropic.NotFoundError) as missing:
        _anthropic(proxy, "sk-support").models.retrieve("claude-bot")
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.AuthenticationError) as unknown:
        _anthropic(proxy, "sk-unknown").models.retrieve("claude-bot")
    assert unknown.value.body["error"]["type"] == "authentication_error"
