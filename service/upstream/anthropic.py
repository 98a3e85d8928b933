"""Anthropic's Messages API (`api: anthropic`): the same pooled client as the OpenAI-compatible
provider, with Anthropic's credentials. The Provider Protocol's credential reaches `send` as the
`Authorization` header (as for every provider); this one sends it as `x-api-key`, with an
`anthropic-version` unless the client named its own."""

from __future__ import annotations

from service.upstream.base import UpstreamReply
from service.upstream.openai_compatible import OpenAICompatibleProvider

ANTHROPIC_VERSION = "2023-06-01"


class AnthropicProvider(OpenAICompatibleProvider):
    def auth_header(self, client_auth: str | None) -> str | None:
        """The provider's own key when configured, else the client's credential passes through."""
        return self._api_key or client_auth

    async def send(self, path: str, body: bytes, headers: dict[str, str], stream: bool,
                   method: str = "POST", timeout_s: float | None = None) -> UpstreamReply:
        headers = dict(headers)
        credential = headers.pop("Authorization", None)
        if credential:
            headers["x-api-key"] = credential[7:].strip() if credential[:7].lower() == "bearer " else credential
        headers.setdefault("anthropic-version", ANTHROPIC_VERSION)
        return await super().send(path, body, headers, stream, method, timeout_s)
