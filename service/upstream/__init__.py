"""Upstream providers behind one Protocol, and the retry rules they share."""

from __future__ import annotations

from service.config import Config, ProviderConfig
from service.upstream.anthropic import AnthropicProvider
from service.upstream.base import Provider, TransportFailure, UpstreamReply
from service.upstream.openai_compatible import OpenAICompatibleProvider

__all__ = ["Provider", "TransportFailure", "UpstreamReply", "make_provider", "make_providers"]

KINDS: dict[str, type[OpenAICompatibleProvider]] = {"openai": OpenAICompatibleProvider, "anthropic": AnthropicProvider}


def make_provider(name: str, cfg: ProviderConfig) -> Provider:
    """The provider of one `providers:` entry, by its `api`."""
    return KINDS[cfg.api](name, cfg)


def make_providers(config: Config) -> dict[str, Provider]:
    """One provider per `providers:` entry."""
    return {name: make_provider(name, cfg) for name, cfg in config.providers.items()}
