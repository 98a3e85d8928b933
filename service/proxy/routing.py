"""Pick stable or canary for one request: by rollout weight, sticky per session."""

from __future__ import annotations

import hashlib

from service.proxy.segments import content_text
from service.records import Role, RolloutState
from service.rollout.book import TERMINAL, Split

_SCALE = float(1 << 64)
START_CHARS = 4096  # of each message that places a conversation: enough to tell them apart, at a bounded cost


def unit_hash(*parts: str) -> float:
    """A uniform number in [0, 1) from the parts, the same on every replica."""
    joined = "\x1f".join(parts).encode("utf-8", "surrogatepass")  # JSON text may hold lone surrogates
    digest = hashlib.blake2b(joined, digest_size=8).digest()
    return int.from_bytes(digest, "big") / _SCALE


def conversation_unit(client: str, messages: object) -> float:
    """A request without a session's place in the split, in [0, 1): from its client and its
    conversation's start (the text of its messages up to the first user message, the first
    START_CHARS of each), the same on every turn of the conversation (an agent's run), for a retry,
    and on every replica."""
    parts = [client]
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            break
        parts.append(f"{m.get('role')}\x1e{content_text(m.get('content'))[:START_CHARS]}")
        if m.get("role") == "user":
            break
    return unit_hash(*parts)


def pick(route: str, split: Split, session_key: str | None, segment: str | None, client: str,
         messages: object) -> tuple[str, Role]:
    """(model key, role). A session never flips mid-way unless the weight changes; a request without
    one is placed by its `client` and its conversation's start (`conversation_unit`), only when the
    split has two arms. With rollout.scope segment the request's segment has its own split (none yet:
    the stable model)."""
    if split.segments is not None and segment is not None:
        split = split.segments.get(segment, split)
    if split.canary is None or split.weight <= 0.0:
        return split.stable, "stable"
    if split.weight >= 1.0:
        return split.canary, "canary"
    u = unit_hash(route, session_key) if session_key else conversation_unit(client, messages)
    return (split.canary, "canary") if u < split.weight else (split.stable, "stable")


def judging(state: RolloutState | None, segment: str) -> bool:
    """Whether a candidate is still being judged for this route (and segment, with rollout.scope
    segment): only then is a request worth shadowing. A paused rollout still gathers evidence."""
    if state is None or state.candidate is None or state.phase in TERMINAL:
        return False
    if state.scope == "segment":
        seg = state.segments.get(segment)
        return seg is None or seg.phase not in TERMINAL  # a segment not seen yet joins in shadow
    return True


def session_hash(session_key: str | None) -> str | None:
    if not session_key:
        return None
    return hashlib.blake2b(session_key.encode(), digest_size=8).hexdigest()
