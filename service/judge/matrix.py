"""The capability × cost matrix of several candidates (rollout.scope segment): candidates × segments,
each cell one comparison against stable with its interval, verdict and forecast."""

from __future__ import annotations

from service.judge.decide import Comparison
from service.records import RolloutState, SegmentState

# what a row shows, in this order: capability, then speed and cost
MATRIX_METRICS = ("completion_rate", "model_failure_rate", "similarity_gap", "judge_preference",
                  "latency_p95_exceedance", "cost_per_completion")


def capability_matrix(state: RolloutState, comparisons: dict[str, list[Comparison]]) -> dict:
    """{"metrics": [...], "rows": [{candidate, segment, status, cells: {metric: comparison}}]}."""
    rows = []
    for candidate, found in comparisons.items():
        for name, seg in state.segments.items():
            cells = {c.spec.name: c.as_dict() for c in found if c.segment == name and c.spec.name in MATRIX_METRICS}
            rows.append({"candidate": candidate, "segment": name, "status": status(seg, candidate), "cells": cells})
    return {"metrics": list(MATRIX_METRICS), "rows": rows}


def status(seg: SegmentState, candidate: str) -> str:
    """Where the candidate stands in the segment: shadow, passed shadow, canary at a weight, promoted,
    ruled out (or the segment's phase when another candidate holds it)."""
    if candidate in seg.rejected:
        return "ruled out"
    if seg.candidate == candidate:
        if seg.phase == "canary":
            return f"canary {100 * seg.canary_weight:g}%"
        return seg.phase if seg.phase != "paused" else f"paused ({100 * seg.canary_weight:g}%)"
    if seg.phase in ("promoted", "rolled_back"):
        return "not picked"
    return "passed shadow" if candidate in seg.passed else "shadow"
