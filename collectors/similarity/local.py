"""The default embedder (`shadow.similarity.backend: local`): WordLlama static embeddings.

The model is `l2_supercat` at 256 dimensions: a 32,000-token embedding table (16 MB of
float16, held as float32: ~52 MiB of RSS) and its tokenizer, both inside the `wordllama` wheel
from PyPI. A text's vector is the mean of its tokens' rows, L2-normalised: no neural network
runs, so one shadow evaluation (three ~50-token answers) costs ~0.35 ms of CPU, most of it in the
tokenizer, far inside the ~3 ms that 300 evaluations/s per `collect` process allow. A
transformer (MiniLM-L6, int8, on onnxruntime) costs ~10 ms per text on this hardware; see
`benchmarks/similarity_backends.py`.

We read the two files ourselves, with `tokenizers` and `safetensors`, instead of calling
`wordllama.WordLlama.load()`:
- its loader looks for the tokenizer in `wordllama/tokenizer/` while the wheel ships it in
  `wordllama/tokenizers/`, so it downloads the tokenizer from the Hugging Face hub into
  `~/.cache/wordllama` at run time;
- importing `wordllama` calls `logging.basicConfig(level=INFO)` on the root logger.
The package is never imported: `importlib.util.find_spec` only locates its folder. Those file
paths are why the dependency carries an upper bound (`wordllama>=0.4,<0.5`).

The model is loaded once per process, on first use, under a lock; after that `embed_sync` only
reads shared state and may run on any thread (e.g. `await asyncio.to_thread(e.embed_sync, texts)`).
`embed` (the Protocol's async method) runs a batch above `offload_chars` characters on a worker
thread (`asyncio.to_thread`), so the shadow worker's event loop gets turns while a big batch is
embedded, and a smaller batch on the calling thread: the tokenizer holds the GIL, so a thread
buys no parallelism, and the hand-off costs ~0.2 ms of CPU, more than embedding one record
(~0.4 ms for three 250-character answers). 8,192 characters take ~2-3 ms.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from collectors.similarity.base import EmbeddingError

PACKAGE = "wordllama"
CONFIG = "l2_supercat"
DIM = 256
WEIGHTS = f"weights/{CONFIG}_{DIM}.safetensors"
TOKENIZER = f"tokenizers/{CONFIG}_tokenizer_config.json"
TENSOR = "embedding.weight"
MAX_CHARS = 20_000      # a longer answer is embedded by its first 20k characters: bounded CPU per text
OFFLOAD_CHARS = 8_192   # `embed` runs bigger batches on a thread


@dataclass(frozen=True, slots=True)
class _Model:
    tokenizer: object           # tokenizers.Tokenizer
    table: np.ndarray           # (vocab, DIM) float32
    version: str


_lock = threading.Lock()
_model: _Model | None = None


def package_dir() -> Path:
    """The installed `wordllama` folder, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingError("shadow.similarity.backend 'local' needs the `wordllama` package "
                             "(a modelcanary dependency): pip install 'wordllama>=0.4,<0.5'")
    return Path(next(iter(spec.submodule_search_locations)))


def _load() -> _Model:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    root = package_dir()
    weights, tokenizer_file = root / WEIGHTS, root / TOKENIZER
    for f in (weights, tokenizer_file):
        if not f.is_file():
            raise EmbeddingError(f"the local embedding model file {f} is missing: reinstall the `wordllama` wheel")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tensors = load_file(str(weights))
    except Exception as e:  # a corrupt file: say which one, not a stack trace from Rust
        raise EmbeddingError(f"could not read the local embedding model in {root}: {e}") from e
    if TENSOR not in tensors or tensors[TENSOR].ndim != 2:
        raise EmbeddingError(f"{weights} has no 2-D tensor {TENSOR!r}")
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > tensors[TENSOR].shape[0]:
        raise EmbeddingError(f"{tokenizer_file} has {vocab} tokens but {weights} only {tensors[TENSOR].shape[0]} rows")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    table = np.ascontiguousarray(tensors[TENSOR], dtype=np.float32)
    try:
        version = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        version = "unknown"
    return _Model(tokenizer=tokenizer, table=table, version=version)


def model() -> _Model:
    """The process's one copy of the model (loaded on first call)."""
    global _model
    m = _model
    if m is None:
        with _lock:
            if _model is None:
                _model = _load()
            m = _model
    return m


class LocalEmbedder:
    """Static WordLlama embeddings from the wheel's files; see the module docstring."""

    backend = "local"

    def __init__(self, max_chars: int = MAX_CHARS, offload_chars: int = OFFLOAD_CHARS):
        self.max_chars = max_chars
        self.offload_chars = offload_chars

    @property
    def name(self) -> str:
        return f"{PACKAGE}/{CONFIG}_{DIM}"

    @property
    def version(self) -> str:
        return model().version

    def load(self) -> LocalEmbedder:
        """Load the model now (otherwise the first `embed` does)."""
        model()
        return self

    def embed_sync(self, texts: list[str]) -> np.ndarray:
        """The embeddings, computed on the calling thread."""
        m = model()
        table, encode = m.table, m.tokenizer.encode  # type: ignore[attr-defined]
        out = np.zeros((len(texts), table.shape[1]), dtype=np.float32)
        for i, text in enumerate(texts):
            if text:
                text = text[: self.max_chars]
                try:
                    ids = encode(text, add_special_tokens=False).ids
                except TypeError:  # a lone surrogate (JSON's "\ud83d", an emoji cut in two) is not text to it
                    ids = encode(text.encode("utf-8", "replace").decode("utf-8"), add_special_tokens=False).ids
                if ids:
                    out[i] = table[ids].sum(axis=0)
        norms = np.sqrt(np.einsum("ij,ij->i", out, out))
        norms[norms == 0.0] = 1.0
        out /= norms[:, None]
        return out

    async def embed(self, texts: list[str]) -> np.ndarray:
        texts = list(texts)
        if sum(min(len(t), self.max_chars) for t in texts) <= self.offload_chars:
            return self.embed_sync(texts)
        return await asyncio.to_thread(self.embed_sync, texts)


_default: LocalEmbedder | None = None


def local_embedder() -> LocalEmbedder:
    """The process's shared LocalEmbedder (the model behind it is loaded once either way)."""
    global _default
    if _default is None:
        _default = LocalEmbedder()
    return _default
