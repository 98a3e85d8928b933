"""Verdicts per segment, offline and live, and where they disagree.

A segment is `worse` when any comparison in it is confidently worse than its margin, `within`
when every comparison in it is confidently within its margin, else `inconclusive` (too little
data, or intervals that straddle a margin); on a replayed route where the candidate or the stable
model answered no case, every segment is `not_compared`. The same rule reads a live rollout's report
(`GET /admin/rollouts/{route}/report`, its judge's comparisons), so the two can be set side by
side: a segment whose offline and live verdicts differ is one the dataset no longer represents.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

WORSE, WITHIN, INCONCLUSIVE = "worse", "within", "inconclusive"
NOT_COMPARED = "not_compared"   # replay: the candidate or the stable model answered none of the route's cases


def per_segment(comparisons: Iterable[dict]) -> dict[str, str]:
    """{segment: verdict} from comparisons as dicts with "segment" and "verdict"; `overall` first."""
    seen: dict[str, list[str]] = {}
    for c in comparisons:
        seen.setdefault(c["segment"], []).append(c["verdict"])
    out = {}
    for seg in sorted(seen, key=lambda s: (s != "overall", s)):
        verdicts = seen[seg]
        out[seg] = WORSE if WORSE in verdicts else WITHIN if all(v == WITHIN for v in verdicts) else INCONCLUSIVE
    return out


@dataclass(frozen=True)
class Agreement:
    segment: str
    offline: str | None     # None: no case of this segment in the dataset
    live: str | None        # None: the live rollout has no comparison in this segment

    @property
    def differs(self) -> bool:
        return self.offline != self.live

    def as_dict(self) -> dict:
        return {"segment": self.segment, "offline": self.offline, "live": self.live, "differs": self.differs}


def live_comparisons(report: dict, candidate: str) -> list[dict]:
    """The live judge's comparisons of `candidate` (several candidates: its own part of the report)."""
    rep = report.get("report") or {}
    judge = ((rep.get("candidates") or {}).get(candidate) or {}).get("judge") or rep.get("judge") or {}
    return judge.get("comparisons") or []


def against_live(offline: dict[str, str], report: dict, candidate: str) -> list[Agreement]:
    """Offline verdicts per segment beside the live report's; every segment either side judged."""
    live = per_segment(live_comparisons(report, candidate))
    segments = sorted(set(offline) | set(live), key=lambda s: (s != "overall", s))
    return [Agreement(s, offline.get(s), live.get(s)) for s in segments]


def live_candidates(report: dict) -> list[str]:
    """The candidates a live report is about."""
    rep = report.get("report") or {}
    return list(rep.get("candidates") or ()) or [c for c in (rep.get("candidate"),) if c]
