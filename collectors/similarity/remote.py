"""`shadow.similarity.backend: model`: embeddings from an OpenAI-compatible `/v1/embeddings`.

For a team that runs its own embedding model: any embeddings model in `models:`, called at its
provider's `base_url` (which, as everywhere in the config, ends in `/v1`). One HTTP request per
`embed` call (split in chunks of `max_batch` inputs), asking for `encoding_format: float`; a
base64 answer is decoded too. Rows come back in `index` order and are L2-normalised here,
whatever the server does. Empty texts are not sent (the API rejects them): they get zero rows.

Any failure (connection, timeout, non-2xx, an answer without one vector per input) raises
EmbeddingError naming the model and URL, never the API key.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

import aiohttp
import numpy as np

from collectors.similarity.base import EmbeddingError, normalize_rows


class EndpointEmbedder:
    backend = "model"

    def __init__(self, base_url: str, model: str, api_key: str | None = None, *, timeout_s: float = 30.0,
                 max_batch: int = 256, headers: Mapping[str, str] | None = None,
                 session: aiohttp.ClientSession | None = None):
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.url = base_url.rstrip("/") + "/embeddings"
        self.model = model
        self.max_batch = max_batch
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = {"Content-Type": "application/json", **(headers or {})}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._session = session
        self._own_session = session is None
        self._served: str | None = None     # the `model` the server says it used

    @property
    def name(self) -> str:
        return self.model

    @property
    def version(self) -> str:
        """The model name the endpoint reports in its answers (the configured name until one arrives)."""
        return self._served or self.model

    async def __aenter__(self) -> EndpointEmbedder:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout, trust_env=True)  # HTTPS_PROXY, as providers
            self._own_session = True
        return self._session

    async def embed(self, texts: list[str]) -> np.ndarray:
        return (await self.embed_counted(texts))[0]

    async def embed_counted(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """`embed`, and the input tokens the calls cost: as the server's `usage` says, else estimated
        at 4 characters a token."""
        todo = [i for i, t in enumerate(texts) if t]
        rows: list[np.ndarray] = []
        tokens = 0
        for start in range(0, len(todo), self.max_batch):
            chunk = [texts[i] for i in todo[start:start + self.max_batch]]
            matrix, told = await self._request(chunk)
            rows.append(matrix)
            tokens += told if told is not None else -(-sum(len(t) for t in chunk) // 4)
        if not todo:
            return np.zeros((len(texts), 0), dtype=np.float32), 0
        vectors = normalize_rows(np.concatenate(rows))
        if len(todo) == len(texts):
            return vectors, tokens
        out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
        out[todo] = vectors
        return out, tokens

    async def _request(self, inputs: list[str]) -> tuple[np.ndarray, int | None]:
        where = f"embeddings model {self.model!r} at {self.url}"
        body = {"model": self.model, "input": inputs, "encoding_format": "float"}
        try:
            async with self._client().post(self.url, json=body, headers=self._headers, timeout=self.timeout) as r:
                raw = await r.read()
                if r.status // 100 != 2:
                    text = raw[:300].decode("utf-8", "replace")
                    raise EmbeddingError(f"{where} answered HTTP {r.status}: {text}")
                try:
                    answer = await r.json(content_type=None)
                except ValueError as e:
                    raise EmbeddingError(f"{where} answered with invalid JSON: {e}") from e
        except (TimeoutError, aiohttp.ClientError) as e:
            raise EmbeddingError(f"{where} could not be reached: {type(e).__name__}: {e}") from e
        usage = answer.get("usage") if isinstance(answer, dict) else None
        told = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return self._parse(answer, len(inputs), where), told if isinstance(told, int) and told >= 0 else None

    def _parse(self, answer: object, n: int, where: str) -> np.ndarray:
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or len(data) != n:
            got = len(data) if isinstance(data, list) else "no"
            raise EmbeddingError(f"{where} answered {got} embeddings for {n} inputs")
        if isinstance(answer.get("model"), str):  # type: ignore[union-attr]
            self._served = answer["model"]  # type: ignore[index]
        ordered: list[object] = [None] * n
        for pos, item in enumerate(data):
            idx = item.get("index", pos) if isinstance(item, dict) else None
            if not isinstance(idx, int) or not 0 <= idx < n or ordered[idx] is not None:
                raise EmbeddingError(f"{where} answered an embedding with a bad index: {idx!r}")
            ordered[idx] = item.get("embedding")
        try:
            vectors = [np.frombuffer(base64.b64decode(v), dtype="<f4") if isinstance(v, str)
                       else np.asarray(v, dtype=np.float32) for v in ordered]
            matrix = np.stack(vectors)
        except (ValueError, TypeError) as e:
            raise EmbeddingError(f"{where} answered embeddings that are not equal-length number arrays: {e}") from e
        if matrix.ndim != 2 or matrix.shape[1] == 0 or not np.isfinite(matrix).all():
            raise EmbeddingError(f"{where} answered embeddings of shape {matrix.shape} or with non-finite values")
        return matrix
