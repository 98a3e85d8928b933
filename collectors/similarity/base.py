"""The embedding extension point: one small Protocol, one file per implementation beside it.

- `local.py`: `LocalEmbedder`, the default (`shadow.similarity.backend: local`), static word
  embeddings whose weights ship inside a PyPI wheel, on CPU, nothing downloaded at run time;
- `remote.py`: `EndpointEmbedder` (`backend: model`), an OpenAI-compatible `/v1/embeddings` call.

An embedder turns texts into L2-normalised rows (a float32 array of shape (len(texts), dim)),
so a dot product of two rows is their cosine. An empty text (nothing to embed) is a zero row.
`name` and `version` say which model made the vectors; they go into a record's `repro`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


class EmbeddingError(RuntimeError):
    """The embeddings could not be computed (missing model files, an endpoint error or a bad answer)."""


@runtime_checkable
class Embedder(Protocol):
    backend: str                    # "local" | "model", as in `shadow.similarity.backend`

    @property
    def name(self) -> str:
        """The embedding model, e.g. `wordllama/l2_supercat_256` or the endpoint's model name."""

    @property
    def version(self) -> str:
        """The model's version (the package version for `local`, the served model for `model`)."""

    async def embed(self, texts: list[str]) -> np.ndarray:
        """One L2-normalised float32 row per text, in order; a zero row for an empty text."""


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """A float32 copy with rows scaled to unit length (zero rows stay zero)."""
    out = np.array(vectors, dtype=np.float32)
    if out.ndim != 2:
        raise EmbeddingError(f"embeddings must be a 2-D array, got shape {out.shape}")
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    norms[norms == 0.0] = 1.0
    out /= norms
    return out


def repro(embedder: Embedder) -> dict[str, str]:
    """What a record's `repro` says about the embeddings behind its similarity scores."""
    return {"backend": embedder.backend, "model": embedder.name, "version": embedder.version}
