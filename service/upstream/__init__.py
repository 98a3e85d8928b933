"""Upstream providers behind one Protocol, and the retry rules they share."""

from __future__ import annotations

from service.config import Config
from service.upstream.base import Provider, TransportFailure, UpstreamReply
from service.upstream.openai_compatible import OpenAICompatibleProvider

__all__ = ["Provider", "TransportFailure", "UpstreamReply", "make_providers"]


def make_providers(config: Config) -> dict[str, Provider]:
    return {name: OpenAICompatibleProvider(name, cfg) for name, cfg in config.providers.items()}
