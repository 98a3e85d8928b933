"""HTTPS providers: every hosted model sits behind TLS. The proxy's HTTP/1.1 client
(service/upstream/http1.py) checks the certificate against the system's CAs, or against the file
named by OpenSSL's `SSL_CERT_FILE`. It keeps one TLS connection alive across requests and streams
over it. When it can't verify a certificate, or the handshake fails, the call fails as
`connection_error` (blame provider), and the message says why.

The TLS end is real OpenSSL: FaultProxy with `tls`, which terminates TLS the way a provider's
load balancer does. It sits in front of the simulator and in front of llama.cpp's server.
"""

from __future__ import annotations

import openai
import pytest
import trustme

from tests.fixtures.servers import metric_value, scrape, sim_config, start_proxy, start_simulator
from tests.fixtures.tls import ca_file, tls_front

pytestmark = pytest.mark.timeout(300)

ROUTE = "support-bot"


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA(organization_name="modelcanary test CA")


def _config(base_url: str, upstream_model: str, timeout_s: float = 10, max_retries: int = 2) -> dict:
    return {
        "providers": {"tls": {"base_url": base_url + "/v1", "timeout_s": timeout_s, "connect_timeout_s": 5,
                              "max_retries": max_retries}},
        "models": {"stable-m": {"provider": "tls", "name": upstream_model}},
        "routes": {ROUTE: {"stable": "stable-m"}},
    }


def _client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=300)


def _streamed(client: openai.OpenAI, model: str, **extra) -> tuple[str, object]:
    text, usage = "", None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], stream=True,
            stream_options={"include_usage": True}, **extra):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return text, usage


def test_an_https_provider_is_verified_kept_alive_and_streamed(ca, tmp_path):
    sim = start_simulator(tmp_path, sim_config())
    front = tls_front(ca, sim.port, "127.0.0.1", "localhost")
    proxy = start_proxy(tmp_path, _config(front.url, "good-model"), env={"SSL_CERT_FILE": ca_file(ca, tmp_path)})
    try:
        client = _client(proxy)
        for i in range(5):
            reply = client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": f"question {i}"}])
            assert reply.choices[0].message.content
        text, usage = _streamed(client, ROUTE)
        assert text and usage is not None and usage.completion_tokens > 0
        metrics = scrape(proxy.url)
        assert metric_value(metrics, "modelcanary_requests_total", route=ROUTE, outcome="completed") == 6
        assert metric_value(metrics, "modelcanary_failures_total", route=ROUTE) == 0
        # six requests, one TLS handshake: the connection is reused, also after a stream read to its end
        assert (front.connections, front.requests) == (1, 6)
    finally:
        proxy.stop()
        front.stop()
        sim.stop()


@pytest.mark.parametrize("case", ["untrusted CA", "certificate for another host", "plain HTTP behind https://"])
def test_a_tls_failure_is_a_provider_connection_error_that_says_why(ca, tmp_path, case):
    sim = start_simulator(tmp_path, sim_config())
    env: dict[str, str] = {}
    front = None
    if case == "plain HTTP behind https://":
        base_url = sim.url.replace("http://", "https://")
        expected = "TLS handshake failed (WRONG_VERSION_NUMBER)"
    else:
        front = tls_front(ca, sim.port, "localhost" if case == "certificate for another host" else "127.0.0.1")
        base_url = front.url
        if case == "untrusted CA":
            expected = "TLS certificate not accepted (unable to get local issuer certificate)"
        else:
            env["SSL_CERT_FILE"] = ca_file(ca, tmp_path)
            expected = "TLS certificate not accepted (IP address mismatch, certificate is not valid for '127.0.0.1'"
    proxy = start_proxy(tmp_path, _config(base_url, "good-model", max_retries=0), env=env)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            _client(proxy).chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 502
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "connection_error", error
        assert error["message"].startswith("upstream tls: could not connect: " + expected), error["message"]
        metrics = scrape(proxy.url)
        assert metric_value(metrics, "modelcanary_failures_total", route=ROUTE, cause="connection_error",
                            blame="provider") == 1
        assert "Traceback" not in proxy.output()
    finally:
        proxy.stop()
        if front is not None:
            front.stop()
        sim.stop()


def test_llama_server_behind_tls_answers_and_streams_through_the_proxy(llama_server, ca, tmp_path):
    front = tls_front(ca, llama_server.port, "127.0.0.1")
    proxy = start_proxy(tmp_path, _config(front.url, llama_server.chat_model, timeout_s=300),
                        env={"SSL_CERT_FILE": ca_file(ca, tmp_path)})
    try:
        client = _client(proxy)
        reply = client.chat.completions.create(model=ROUTE, messages=[{"role": "user", "content": "Name a colour."}],
                                               max_tokens=12)
        assert reply.usage is not None and reply.usage.completion_tokens > 0
        text, usage = _streamed(client, ROUTE, max_tokens=12)
        assert text and usage is None  # llama-cpp-python 0.3 sends no usage chunk (test_real_llm_smoke.py)
        metrics = scrape(proxy.url)
        assert metric_value(metrics, "modelcanary_requests_total", route=ROUTE, outcome="completed") == 2
        # the plain answer's reported tokens, and the stream's estimated from its text
        assert metric_value(metrics, "modelcanary_tokens_total", route=ROUTE, type="output") > \
            reply.usage.completion_tokens
        assert (front.connections, front.requests) == (1, 2)
    finally:
        proxy.stop()
        front.stop()
