"""Rollout change notifications: the webhook's POSTs, its payload, and URLs fit for logs."""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse

import aiohttp

from service.config import NotifyConfig
from service.records import Phase, RolloutState, SegmentState, dump

log = logging.getLogger("modelcanary.rollout")

WEBHOOK_TIMEOUT_S = 5.0

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


def configured_url(notify: NotifyConfig) -> str | None:
    """The URL the webhook POSTs to. A `webhook_url_env` whose variable is unset or holds no usable URL
    turns notifications off with a warning naming the variable (never its value), as an unset
    `api_key_env` or admin token variable leaves the process running."""
    try:
        return notify.resolved_url()
    except ValueError as e:
        log.warning("webhook notifications are off: %s", e)
        return None


def webhook_payload(new: RolloutState, old: RolloutState, segment: str | None = None) -> dict:
    """The POST for a change of the route's phase or step, or of one segment's (rollout.scope: segment,
    where each segment steps on its own and the route's phase sums them up)."""
    cur: RolloutState | SegmentState
    if segment is None:
        cur, was, where, show_step = new, old.phase, "", new.scope != "segment"
    else:
        cur, was, where, show_step = new.segments[segment], _phase_step(old.segments.get(segment))[0], \
            f" segment {segment}", True
    d = cur.last_decision
    reasons = list(d.reasons) if d else []
    step = f" step {cur.step_index + 1} ({cur.canary_weight * 100:g}%)" if cur.phase == "canary" and show_step else ""
    text = f"modelcanary: route {new.route}{where} {was} → {cur.phase}{step}"
    if reasons:
        text += ": " + reasons[0]
    state = dump(new)
    state.pop("report", None)
    return {
        "event": "rollout_changed",
        "route": new.route,
        "segment": segment,
        "from": was,
        "to": cur.phase,
        "step_index": cur.step_index,
        "canary_weight": cur.canary_weight,
        "decision": d.decision if d else None,
        "by": d.by if d else None,
        "reasons": reasons,
        "text": text,
        "state": state,
    }


def _phase_step(seg: SegmentState | None) -> tuple[Phase, int]:
    """A segment's phase and step; one without a state yet is in shadow."""
    return (seg.phase, seg.step_index) if seg is not None else ("shadow", -1)


class Notifier:
    """POSTs the webhook's URL (`configured_url`) a payload for each phase or step change it is told of;
    never raises (a notification must not affect a decision)."""

    def __init__(self, url: str | None):
        self.url = url
        self._tasks: set[asyncio.Task] = set()

    def changed(self, new: RolloutState, old: RolloutState | None) -> None:
        """A POST for the route's phase or step change, and one for each segment's."""
        if not self.url or old is None:
            return
        changes: list[str | None] = [None] if (new.phase, new.step_index) != (old.phase, old.step_index) else []
        changes += [name for name, seg in new.segments.items()
                    if _phase_step(seg) != _phase_step(old.segments.get(name))]
        if not changes:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("webhook for %s skipped: no event loop", new.route)
            return
        for segment in changes:
            task = loop.create_task(self._post(webhook_payload(new, old, segment)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, payload: dict) -> None:
        url = self.url
        if not url:
            return
        try:
            # a session per POST (phase changes are rare): closed however the POST ends, also when
            # nothing drains the webhooks (the controller never ran, or was cancelled)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S),
                                             trust_env=True) as session:  # HTTPS_PROXY, as providers
                async with session.post(url, json=payload) as resp:
                    if resp.status >= 300:
                        log.warning("webhook %s answered %s", safe_url(url), resp.status)
        except Exception as e:  # never raised: a notification must not affect a decision
            # the exception's text is not logged: aiohttp's name the whole URL, secret path included
            log.warning("webhook %s failed: %s", safe_url(url), type(e).__name__)

    async def drain(self, timeout_s: float = 2.0) -> None:
        """Wait for the POSTs under way (up to `timeout_s`)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
