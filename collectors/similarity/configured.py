"""The embedder behind each route's `shadow.similarity`: the process's one local model
(`backend: local`), or one EndpointEmbedder per embeddings model (`backend: model`), called at its
provider's `base_url` with the provider's own key, as every shadow call is (never a client's). An
embeddings call is a shadow call: it counts against the route's `shadow.max_usd_per_hour`."""

from __future__ import annotations

import numpy as np

from collectors.similarity.base import Embedder, EmbeddingError
from collectors.similarity.local import LocalEmbedder
from collectors.similarity.remote import EndpointEmbedder
from collectors.spend import OverBudget, SpendCap
from service.config import Config, Price, RouteConfig
from service.upstream.base import Provider


class RouteEmbedders:
    def __init__(self, config: Config, providers: dict[str, Provider], spend: SpendCap):
        self.config = config
        self.providers = providers
        self.spend = spend
        self._endpoints: dict[str, EndpointEmbedder] = {}
        self._metered: dict[tuple[str, str], MeteredEmbedder] = {}
        self._local = LocalEmbedder()  # small batches inline: the workers run outside the proxy (child or collect)

    def for_route(self, route: str, rc: RouteConfig) -> Embedder:
        key = rc.shadow.similarity.model
        if rc.shadow.similarity.backend == "local" or key is None:
            return self._local
        metered = self._metered.get((route, key))
        if metered is None:
            embedder = self._endpoints.get(key)
            model = self.config.models[key]
            if embedder is None:
                provider = self.config.providers[model.provider]
                auth = self.providers[model.provider].auth_header(None)
                embedder = self._endpoints[key] = EndpointEmbedder(
                    provider.base_url, model.name, timeout_s=provider.timeout_s,
                    headers={"Authorization": auth} if auth else None)
            metered = self._metered[(route, key)] = MeteredEmbedder(embedder, route, model.price, self.spend)
        return metered

    def load(self) -> None:
        """Load the local model now if a route uses it, so the first evaluation does not wait for it."""
        if any(rc.candidates and rc.shadow.similarity.backend == "local" for rc in self.config.routes.values()):
            self._local.load()

    async def aclose(self) -> None:
        for embedder in self._endpoints.values():
            await embedder.aclose()
        self._endpoints.clear()
        self._metered.clear()


class MeteredEmbedder:
    """An embeddings model as one route uses it: each call asks the route's spend cap first (over it,
    the similarity is not computed: EmbeddingError) and adds its cost after."""

    backend = "model"

    def __init__(self, embedder: EndpointEmbedder, route: str, price: Price, spend: SpendCap):
        self.embedder = embedder
        self.route = route
        self.price = price
        self.spend = spend

    @property
    def name(self) -> str:
        return self.embedder.name

    @property
    def version(self) -> str:
        return self.embedder.version

    async def embed(self, texts: list[str]) -> np.ndarray:
        try:
            self.spend.check(self.route)
        except OverBudget as e:
            raise EmbeddingError(str(e)) from e
        vectors, tokens = await self.embedder.embed_counted(texts)
        self.spend.add(self.route, self.price.cost(tokens, 0))
        return vectors
