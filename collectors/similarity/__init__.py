"""Similarity of a candidate's answer to the live stable answer, in [0, 1] (issue: answer quality).

`score.py` scores two answers by kind (text by embeddings, JSON and tool calls structurally);
the embedders are an extension point (`base.Embedder`): `local.LocalEmbedder`, the default, and
`remote.EndpointEmbedder`, an OpenAI-compatible `/v1/embeddings` model.
"""

from collectors.similarity.base import Embedder, EmbeddingError, normalize_rows, repro
from collectors.similarity.local import LocalEmbedder, local_embedder
from collectors.similarity.remote import EndpointEmbedder
from collectors.similarity.score import (
    Answer,
    RecordSimilarity,
    ToolCall,
    answer_of,
    answer_of_completion,
    json_similarity,
    mean_pairwise_similarity,
    score_record,
    score_records,
    similarities,
    similarities_with,
    similarity,
    texts_to_embed,
    tool_calls_similarity,
    wants_json,
)

__all__ = [
    "Answer", "Embedder", "EmbeddingError", "EndpointEmbedder", "LocalEmbedder", "RecordSimilarity", "ToolCall",
    "answer_of", "answer_of_completion", "json_similarity", "local_embedder", "mean_pairwise_similarity",
    "normalize_rows", "repro", "score_record", "score_records", "similarities", "similarities_with", "similarity",
    "texts_to_embed", "tool_calls_similarity", "wants_json",
]
