"""Read the PromQL back out of built dashboards, with Grafana's template variables filled in.

Used by the end-to-end test (every panel must return data from a real Prometheus)
and by anything that renders a dashboard's data without Grafana.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str   # uid
    panel: str       # title
    ref_id: str
    expr: str
    instant: bool


def panel_queries(model: dict) -> Iterator[PanelQuery]:
    """Every target of every panel (rows' nested panels too), in order."""
    uid = model.get("uid", "")
    panels = list(model.get("panels", []))
    for panel in panels:
        if panel.get("type") == "row":
            panels.extend(panel.get("panels", []) or [])
            continue
        for target in panel.get("targets", []) or []:
            yield PanelQuery(uid, panel.get("title", ""), target.get("refId", ""), target.get("expr", ""),
                             bool(target.get("instant")))


def annotation_queries(model: dict) -> Iterator[tuple[str, str]]:
    """(name, expr) of every Prometheus annotation."""
    for ann in model.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            yield ann.get("name", ""), ann["expr"]


_VAR = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace `$name` and `${name}` (and `${name:format}`) as Grafana does; unknown names stay.

    Typical variables: route, datasource, __rate_interval (e.g. "1m"), __interval ("15s"),
    __range ("5m").
    """
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return variables.get(name, m.group(0))

    return _VAR.sub(repl, expr)


def default_variables(route: str, *, rate_interval: str = "1m", interval: str = "15s",
                      range_: str = "5m") -> dict[str, str]:
    return {
        "route": route,   # panels match with =~; route names are plain words
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
    }
