"""An egress proxy from the environment, as curl, requests and the openai SDK read it. Production
networks often reach model APIs only through one. `HTTPS_PROXY` carries https:// providers, over a
CONNECT tunnel with TLS end to end. `HTTP_PROXY` carries http:// ones, in absolute form. `NO_PROXY`
hosts go direct. The proxy's credentials (`http://user:password@host:port`) go into
Proxy-Authorization and nowhere else. The embeddings backend and the webhook (aiohttp) use the same
variables.

The egress proxy is tinyproxy (Debian), a real forward proxy; its log lists the requests it got.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import trustme

from collectors.similarity.remote import EndpointEmbedder
from tests.fixtures.servers import free_port, metric_value, scrape, sim_config, start_proxy, start_simulator
from tests.fixtures.tinyproxy import Tinyproxy
from tests.fixtures.tls import ca_file, tls_front
from tests.test_controller import webhook_after_rollback, webhook_receiver

pytestmark = [pytest.mark.requires("tinyproxy"), pytest.mark.timeout(180)]

ROUTE = "support-bot"
PASSWORD = "pw-egress-7f3a9c"  # must show up nowhere but in Proxy-Authorization


def _env(https_proxy: str = "", http_proxy: str = "", no_proxy: str = "", **extra: str) -> dict[str, str]:
    """Both spellings of each variable: the lower-case one wins, so the runner's own can't leak in."""
    env = dict(extra)
    for name, value in (("https_proxy", https_proxy), ("http_proxy", http_proxy), ("no_proxy", no_proxy)):
        env[name] = env[name.upper()] = value
    return env


def _config(base_url: str, max_retries: int = 2) -> dict:
    return {
        "providers": {"up": {"base_url": base_url + "/v1", "timeout_s": 10, "connect_timeout_s": 5,
                             "max_retries": max_retries}},
        "models": {"stable-m": {"provider": "up", "name": "good-model"}},
        "routes": {ROUTE: {"stable": "stable-m"}},
    }


def _ask(proxy, n: int = 2) -> None:
    """n plain answers and one stream with usage, through the openai SDK."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=30)
    for i in range(n):
        assert client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": f"q{i}"}]) \
            .choices[0].message.content
    chunks = list(client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and any(c.choices and c.choices[0].delta.content for c in chunks)


@pytest.fixture
def sim(tmp_path):
    s = start_simulator(tmp_path, sim_config())
    yield s
    s.stop()


@pytest.fixture
def https_sim(sim, tmp_path):
    """The simulator behind TLS, certified by a CA of the test's own: (front, path of the CA's PEM)."""
    ca = trustme.CA()
    front = tls_front(ca, sim.port, "127.0.0.1")
    yield front, ca_file(ca, tmp_path)
    front.stop()


def test_an_https_provider_goes_through_one_connect_tunnel_with_the_proxys_credentials(https_sim, tmp_path):
    front, cert_file = https_sim
    egress = Tinyproxy(tmp_path, auth=("alice", PASSWORD))
    proxy = start_proxy(tmp_path, _config(front.url),
                        env=_env(https_proxy=egress.url(f"alice:{PASSWORD}"), SSL_CERT_FILE=cert_file))
    try:
        _ask(proxy, n=3)
        # one tunnel, one TLS connection inside it, kept alive for all four requests
        assert egress.requests() == [f"CONNECT 127.0.0.1:{front.port} HTTP/1.1"]
        assert (front.connections, front.requests) == (1, 4)
        metrics = scrape(proxy.url)
        assert metric_value(metrics, "modelcanary_requests_total", route=ROUTE, outcome="completed") == 4
        assert PASSWORD not in proxy.output() and PASSWORD not in metrics
    finally:
        proxy.stop()
        egress.stop()


def test_an_http_provider_goes_through_the_proxy_in_absolute_form(sim, tmp_path):
    egress = Tinyproxy(tmp_path)
    proxy = start_proxy(tmp_path, _config(sim.url), env=_env(http_proxy=egress.url()))
    try:
        _ask(proxy)
        assert egress.requests() == [f"POST http://127.0.0.1:{sim.port}/v1/chat/completions HTTP/1.1"] * 3
    finally:
        proxy.stop()
        egress.stop()


@pytest.mark.parametrize("no_proxy", ["localhost,127.0.0.1", "10.0.0.0/8, 127.0.0.0/8"], ids=["names", "ranges"])
def test_no_proxy_hosts_go_direct(sim, tmp_path, no_proxy):
    """Names as urllib reads them, and IP ranges (CIDR) as curl does: Kubernetes' usual NO_PROXY."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = start_proxy(tmp_path, _config(sim.url), env=_env(https_proxy=nowhere, http_proxy=nowhere,
                                                             no_proxy=no_proxy))
    try:
        _ask(proxy)
    finally:
        proxy.stop()


@pytest.mark.parametrize("case", ["wrong password", "proxy down", "https:// proxy URL"])
def test_an_egress_failure_is_a_provider_connection_error_naming_the_proxy(https_sim, tmp_path, case):
    front, cert_file = https_sim
    egress = Tinyproxy(tmp_path, auth=("alice", PASSWORD + "-right")) if case == "wrong password" else None
    if egress is not None:
        url = egress.url(f"alice:{PASSWORD}")
        # tinyproxy answers a wrong password with "HTTP/1.0 401 Unauthorized" (others send a 407)
        expected = (f"could not connect: the egress proxy 127.0.0.1:{egress.port} refused CONNECT "
                    f"127.0.0.1:{front.port}: HTTP/1.0 401 Unauthorized")
    elif case == "proxy down":
        port = free_port()
        url = f"http://alice:{PASSWORD}@127.0.0.1:{port}"
        expected = f"could not connect through the egress proxy 127.0.0.1:{port}: ConnectionRefusedError"
    else:
        url = f"https://alice:{PASSWORD}@127.0.0.1:{free_port()}"
        expected = "could not connect: HTTPS_PROXY must be an http:// proxy URL (got a https:// one)"
    proxy = start_proxy(tmp_path, _config(front.url, max_retries=0), env=_env(https_proxy=url, SSL_CERT_FILE=cert_file))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 502
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "connection_error"
        assert error["message"] == f"upstream up: {expected}"
        metrics = scrape(proxy.url)
        assert metric_value(metrics, "modelcanary_failures_total", route=ROUTE, cause="connection_error",
                            blame="provider") == 1
        assert front.connections == 0  # nothing went around the proxy
        assert PASSWORD not in proxy.output() and PASSWORD not in metrics and "Traceback" not in proxy.output()
    finally:
        proxy.stop()
        if egress is not None:
            egress.stop()


def test_the_embeddings_backend_and_the_webhook_use_the_egress_proxy(sim, tmp_path, monkeypatch):
    egress = Tinyproxy(tmp_path)
    for name, value in _env(http_proxy=egress.url()).items():
        monkeypatch.setenv(name, value)

    async def main() -> tuple[list[dict], str]:
        async with EndpointEmbedder(sim.url + "/v1", "good-model") as embedder:
            assert len(await embedder.embed(["hello there"])) == 1
        async with webhook_receiver() as (url, received, got):
            await webhook_after_rollback(url, got)
        return received, url

    try:
        received, url = asyncio.run(main())
        assert received[0]["to"] == "rolled_back"
        assert egress.requests() == [f"POST http://127.0.0.1:{sim.port}/v1/embeddings HTTP/1.1", f"POST {url} HTTP/1.1"]
    finally:
        egress.stop()
