"""The embedder behind each route's `shadow.similarity`: the process's one local model
(`backend: local`), or one EndpointEmbedder per embeddings model (`backend: model`), called at its
provider's `base_url` with the provider's own key, as every shadow call is (never a client's)."""

from __future__ import annotations

from collectors.similarity.base import Embedder
from collectors.similarity.local import LocalEmbedder
from collectors.similarity.remote import EndpointEmbedder
from service.config import Config, RouteConfig
from service.upstream.base import Provider


class RouteEmbedders:
    def __init__(self, config: Config, providers: dict[str, Provider]):
        self.config = config
        self.providers = providers
        self._endpoints: dict[str, EndpointEmbedder] = {}
        self._local = LocalEmbedder()  # small batches inline: the workers run outside the proxy (child or collect)

    def for_route(self, rc: RouteConfig) -> Embedder:
        key = rc.shadow.similarity.model
        if rc.shadow.similarity.backend == "local" or key is None:
            return self._local
        embedder = self._endpoints.get(key)
        if embedder is None:
            model = self.config.models[key]
            provider = self.config.providers[model.provider]
            auth = self.providers[model.provider].auth_header(None)
            embedder = self._endpoints[key] = EndpointEmbedder(
                provider.base_url, model.name, timeout_s=provider.timeout_s,
                headers={"Authorization": auth} if auth else None)
        return embedder

    def load(self) -> None:
        """Load the local model now if a route uses it, so the first evaluation does not wait for it."""
        if any(rc.candidates and rc.shadow.similarity.backend == "local" for rc in self.config.routes.values()):
            self._local.load()

    async def aclose(self) -> None:
        for embedder in self._endpoints.values():
            await embedder.aclose()
        self._endpoints.clear()
