"""Rollout change notifications: the webhook payload, and URLs fit for logs."""

from __future__ import annotations

import re
import urllib.parse

from service.records import RolloutState, dump

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9.+-]{0,31}")
_BAD_PORT = re.compile(r"[A-Za-z0-9]{1,8}")  # a typo such as 44x, shown as written; anything longer is not
_HOST = re.compile(r"[\w.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


def safe_url(url: object) -> str:
    """A webhook URL fit for a log line: its path and query often hold the secret (Slack, Teams), and
    so may its user:password@; only the scheme, host and port are shown. Never raises: it runs in
    error handlers, on URLs that may not parse (a port that is not a number, a bad IPv6 host)."""
    try:
        parts = urllib.parse.urlsplit(str(url))
        scheme, host = parts.scheme, parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        try:
            port = f":{parts.port}" if parts.port is not None else ""
        except ValueError:  # out of range or not a number: shown as written when harmless
            hostport = parts.netloc.rpartition("@")[2]
            raw = hostport[hostport.rfind("]") + 1:].partition(":")[2]
            port = f":{raw}" if _BAD_PORT.fullmatch(raw) else ":?"
    except Exception:  # urlsplit itself refuses some (e.g. an unclosed '[')
        return "?://?/…"
    return f"{scheme if _SCHEME.fullmatch(scheme) else '?'}://{host if _HOST.fullmatch(host) else '?'}{port}/…"


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
