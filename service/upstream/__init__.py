"""Upstream providers behind one Protocol, and the retry rules they share."""

from __future__ import annotations

from service.config import Config
from service.upstream.anthropic import AnthropicProvider
from service.upstream.base import Provider, TransportFailure, UpstreamReply
from service.upstream.openai_compatible import OpenAICompatibleProvider

__all__ = ["Provider", "TransportFailure", "UpstreamReply", "make_providers"]


def make_providers(config: Config) -> dict[str, Provider]:
    """One provider per `providers:` entry, by its `api`."""
    kinds = {"openai": OpenAICompatibleProvider, "anthropic": AnthropicProvider}
    return {name: kinds[cfg.api](name, cfg) for name, cfg in config.providers.items()}
