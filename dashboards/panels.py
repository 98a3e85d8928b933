"""Shared builders for the modelcanary dashboards (grafana-foundation-sdk).

Every panel queries the dashboard's `datasource` variable, and every expression
filters on the `route` variable where the metric has a route label. Helpers here
only assemble PromQL strings and SDK builders; the dashboards themselves live in
`rollout.py`, `shadow.py` and `health.py`.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as statetimeline_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import prometheus as prom_m

DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
ROUTE = 'route=~"$route"'
RATE = "$__rate_interval"
TAGS = ["modelcanary"]
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# --- PromQL helpers ---------------------------------------------------------------


def sel(metric: str, *matchers: str) -> str:
    """`metric{m1,m2}`; matchers are PromQL label matchers such as `outcome="completed"`."""
    return f"{metric}{{{','.join(matchers)}}}" if matchers else metric


def rate_sum(by: str, metric: str, *matchers: str, window: str = RATE, fn: str = "rate") -> str:
    """`sum by (by) (rate(metric{...}[window]))`."""
    return f"sum by ({by}) ({fn}({sel(metric, *matchers)}[{window}]))"


def ratio(by: str, metric: str, num: list[str], den: list[str], window: str = RATE, fn: str = "rate") -> str:
    """Share of `metric{num}` in `metric{den}` per `by` group.

    A group whose numerator has no series yet (no retries so far, say) reads 0
    instead of vanishing: `(num or den * 0) / den`.
    """
    d = rate_sum(by, metric, *den, window=window, fn=fn)
    return f"({rate_sum(by, metric, *num, window=window, fn=fn)} or {d} * 0) / {d}"


def quantile(q: float, metric: str, by: str, *matchers: str) -> str:
    """`histogram_quantile(q, sum by (by, le) (rate(metric_bucket{...}[rate])))`."""
    return f"histogram_quantile({q}, {rate_sum(f'{by}, le', metric + '_bucket', *matchers)})"


def or_zero(expr: str, label: str) -> str:
    """For series that legitimately do not exist until something happens (drops):
    a single 0 series labelled `label="none"` while `expr` is empty. (`or on ()` matches on
    the empty label set, so the fallback is dropped as soon as `expr` has any series.)"""
    return f'{expr} or on () label_replace(vector(0), "{label}", "none", "", "")'


# --- queries and panels ----------------------------------------------------------------


def query(expr: str, legend: str = "", ref: int = 0, *, table: bool = False) -> prom_b.Dataquery:
    q = prom_b.Dataquery().expr(expr).ref_id(REF_IDS[ref]).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if table:
        q = q.instant().format(prom_m.PromQueryFormat.TABLE)
    else:
        q = q.range()
    return q


def _targets(panel, targets: list[tuple[str, str]]):
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend, i))
    return panel


def _legend() -> common_b.VizLegendOptions:
    return (
        common_b.VizLegendOptions()
        .show_legend(True)
        .display_mode(common_m.LegendDisplayMode.LIST)
        .placement(common_m.LegendPlacement.BOTTOM)
    )


def timeseries(
    title: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    stacked: bool = False,
    bars: bool = False,
    min_val: float | None = 0,
    max_val: float | None = None,
    width: int = 12,
    height: int = 8,
) -> timeseries_b.Panel:
    """A time series panel; `targets` are (expr, legend format) pairs."""
    p = (
        timeseries_b.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .legend(_legend())
        .line_width(1)
        .fill_opacity(40 if stacked else 10)
    )
    if description:
        p = p.description(description)
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if stacked:
        p = p.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    if bars:
        p = p.draw_style(common_m.GraphDrawStyle.BARS)
    return _targets(p, targets)


def stat(
    title: str,
    targets: list[tuple[str, str]],
    *,
    unit: str = "short",
    description: str = "",
    width: int = 6,
    height: int = 4,
) -> stat_b.Panel:
    p = (
        stat_b.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .graph_mode(common_m.BigValueGraphMode.AREA)
    )
    if description:
        p = p.description(description)
    return _targets(p, targets)


def state_timeline(
    title: str,
    targets: list[tuple[str, str]],
    *,
    description: str = "",
    width: int = 12,
    height: int = 8,
) -> statetimeline_b.Panel:
    """Phase over time: each series is 1 while its phase is current, 0 otherwise."""
    mappings = [
        dash_m.ValueMap(options={
            "0": dash_m.ValueMappingResult(text=" ", color="transparent", index=0),
            "1": dash_m.ValueMappingResult(text="current", color="green", index=1),
        }),
    ]
    p = (
        statetimeline_b.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .mappings(mappings)
        .show_value(common_m.VisibilityMode.NEVER)
        .merge_values(True)
        .fill_opacity(70)
        .line_width(0)
    )
    if description:
        p = p.description(description)
    return _targets(p, targets)


def table(
    title: str,
    targets: list[tuple[str, str]],
    *,
    rename: dict[str, str],
    units: dict[str, str],
    exclude: tuple[str, ...] = ("Time",),
    description: str = "",
    width: int = 24,
    height: int = 10,
) -> table_b.Panel:
    """An instant table; the targets are merged into one row per label set and
    their `Value #<refId>` columns renamed by `rename` (refId → column name)."""
    p = (
        table_b.Panel()
        .title(title)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .show_header(True)
        .with_transformation(dash_m.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(dash_m.DataTransformerConfig(id_val="organize", options={
            "excludeByName": {name: True for name in exclude},
            "renameByName": {f"Value #{ref}": name for ref, name in rename.items()},
        }))
    )
    for column, unit in units.items():
        p = p.override_by_name(column, [dash_m.DynamicConfigValue(id_val="unit", value=unit)])
    if description:
        p = p.description(description)
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(query(expr, legend, i, table=True))
    return p


def row(title: str) -> dash_b.Row:
    return dash_b.Row(title)


# --- variables and the dashboard -----------------------------------------------


def datasource_variable() -> dash_b.DatasourceVariable:
    return dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def route_variable(*, include_all: bool = False) -> dash_b.QueryVariable:
    v = (
        dash_b.QueryVariable("route")
        .label("Route")
        .datasource(DATASOURCE)
        .query("label_values(modelcanary_requests_total, route)")
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )
    if include_all:
        v = v.include_all(True).all_value(".*").multi(True)
    return v


def dashboard(uid: str, title: str, description: str, *, route_all: bool = False) -> dash_b.Dashboard:
    return (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .timezone("browser")
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
        .with_variable(route_variable(include_all=route_all))
    )
