"""Rollout change notifications: the webhook payload, and URLs fit for logs."""

from __future__ import annotations

import urllib.parse

from service.records import RolloutState, dump


def safe_url(url: str) -> str:
    """A webhook URL fit for a log line: its path and query often hold the secret (Slack, Teams)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}{f':{parts.port}' if parts.port else ''}/…"


def webhook_payload(new: RolloutState, old: RolloutState) -> dict:
    d = new.last_decision
    reasons = list(d.reasons) if d else []
    step = f" step {new.step_index + 1} ({new.canary_weight * 100:g}%)" if new.phase == "canary" else ""
    text = f"modelcanary: route {new.route} {old.phase} → {new.phase}{step}"
    if reasons:
        text += ": " + reasons[0]
    state = dump(new)
    state.pop("report", None)
    return {
        "event": "rollout_changed",
        "route": new.route,
        "from": old.phase,
        "to": new.phase,
        "step_index": new.step_index,
        "canary_weight": new.canary_weight,
        "decision": d.decision if d else None,
        "by": d.by if d else None,
        "reasons": reasons,
        "text": text,
        "state": state,
    }
