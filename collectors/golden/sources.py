"""Where `capture` reads bus records from.

- Memory mode: the proxy process holds the bus, so `capture` asks the running proxy: its
  `GET /admin/traffic?since=&until=` (bearer token) streams, as JSON lines, the sampled
  TrafficEvents and the feedback it keeps in memory (service/admin/traffic.py: the most recent
  ones, bounded).
- Kafka mode: the `{prefix}.traffic` topic, and `{prefix}.outcomes` for feedback (and the
  request outcomes that tie a session's feedback to its request), read from the beginning.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

from service.bus.kafka import read_messages, topic_names
from service.config import Config
from service.records import Record, load

TIMEOUT_S = 30.0
KAFKA_READ_TIMEOUT_S = 120.0   # bounds reading each topic; a read returns as soon as it is caught up


class SourceError(Exception):
    """Records could not be read; phrased for the operator."""


def _decoded(values: list[dict]) -> tuple[list[Record], int]:
    out, bad = [], 0
    for value in values:
        try:
            out.append(load(value))
        except ValueError:
            bad += 1
    return out, bad


def from_proxy(url: str, token: str | None, since: float | None, until: float | None,
               token_hint: str) -> tuple[list[Record], int]:
    """(records, undecodable lines) from a running proxy in memory mode; `token_hint` says where a
    refused token came from."""
    query = urllib.parse.urlencode({k: v for k, v in (("since", since), ("until", until)) if v is not None})
    full = url.rstrip("/") + "/admin/traffic" + (f"?{query}" if query else "")
    values: list[dict] = []
    bad = 0
    try:
        with urllib.request.urlopen(_traffic_request(full, token), timeout=TIMEOUT_S) as resp:
            for line in resp:
                if not line.strip():
                    continue
                try:
                    values.append(json.loads(line))
                except ValueError:
                    bad += 1
    except urllib.error.HTTPError as e:
        hint = f" ({token_hint})" if e.code in (401, 403) else ""
        raise SourceError(f"GET {full}: HTTP {e.code} {e.reason}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SourceError(f"cannot reach the proxy at {full}: {reason} (is `modelcanary serve` running with "
                          f"this config? or pass --url)") from None
    except ValueError as e:  # no scheme, a broken IPv6 address, spaces or control characters
        raise SourceError(f"{full!r} is not a URL ({e}); pass --url http://HOST:PORT") from None
    records, undecodable = _decoded(values)
    return records, bad + undecodable


def _traffic_request(full: str, token: str | None) -> urllib.request.Request:
    req = urllib.request.Request(full, headers={"Accept": "application/x-ndjson"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    return req


def from_kafka(config: Config) -> tuple[list[Record], int]:
    """(records, undecodable messages) of the traffic and outcomes topics."""
    kafka = config.events.kafka
    names = topic_names(kafka.topic_prefix)
    values: list[dict] = []
    try:
        for topic in ("traffic", "outcomes"):
            values += [m.value for m in read_messages(kafka.bootstrap_servers, names[topic],
                                                      KAFKA_READ_TIMEOUT_S, kafka.security)]
    except Exception as e:  # kafka-python's errors: the broker is the operator's to fix
        raise SourceError(f"cannot read {names['traffic']} from {kafka.bootstrap_servers}: "
                          f"{type(e).__name__}: {e}") from None
    return _decoded(values)
