"""Which recent request a piece of feedback is about: a bounded memory of served requests, by request
id and by session, that the proxy (the requests it served) and the controller (every outcome on the
bus) both keep to resolve `POST /v1/feedback`."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from service.recent import Recent


@dataclass(slots=True, frozen=True)
class Served:
    route: str
    model: str
    role: str
    segment: str
    session_id_hash: str | None


SESSION = "session:"  # feedback by session: its key is "session:" + the session hash


class ServedMemory:
    """The last `capacity` request ids and sessions, each with its request's labels (fixed memory)."""

    def __init__(self, capacity: int):
        # request id, and ("session", hash), -> (index in _labels, has a session hash, session hash - 2**63)
        self._served = Recent(capacity, width=3)
        self._labels: list[tuple[str, str, str, str]] = []  # (route, model, role, segment): few
        self._label_index: dict[tuple[str, str, str, str], int] = {}

    def remember(self, request_id: str, labels: tuple[str, str, str, str], sid: str | None) -> None:
        index = self._label_index.get(labels)
        if index is None:
            index = self._label_index[labels] = len(self._labels)
            self._labels.append(labels)
        if sid:
            signed = int(sid, 16) - 2**63
            self._served.put(request_id, index, 1, signed)
            self._served.put(("session", sid), index, 1, signed)
        else:
            self._served.put(request_id, index, 0, 0)

    def served(self, request_id: str | None, sid: str | None) -> tuple[str, Served] | None:
        """(the feedback's key, the request) by request id, else by session hash: its latest request."""
        if request_id and (found := self._served.get(request_id)) is not None:
            return request_id, self._served_as(found)
        if sid and (found := self._served.get(("session", sid))) is not None:
            return SESSION + sid, self._served_as(found)
        return None

    def _served_as(self, found: tuple[int, ...]) -> Served:
        index, has_sid, signed = found
        return Served(*self._labels[index], format(signed + 2**63, "016x") if has_sid else None)


def unmatched_route(allowed: Collection[str] | None) -> str:
    """The route label of feedback that matched no request: its client key's route when the key has
    exactly one (the request must have been on it), else "unknown" (the label stays bounded)."""
    if allowed is not None and len(allowed) == 1 and "*" not in allowed:
        return next(iter(allowed))
    return "unknown"
