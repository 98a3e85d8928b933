"""Build, write and push the dashboards (`modelcanary dashboards build | push`).

The JSON is generated deterministically (sorted keys, fixed panel ids, no
timestamps) and committed under `dashboards/json/`; a test fails when it is
stale. In a source checkout `write` also refreshes the Helm chart's copies
(`helm/modelcanary/files/dashboards/<uid>.json` and
`helm/modelcanary/files/prometheus/rules.yaml`).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from dashboards import health, rollout, shadow

PACKAGE_DIR = Path(__file__).resolve().parent
RULES_FILE = PACKAGE_DIR / "prometheus" / "rules.yaml"
CHART_DIR = PACKAGE_DIR.parent / "helm" / "modelcanary"
FOLDER_UID = "modelcanary"
FOLDER_TITLE = "modelcanary"

BUILDERS: dict[str, Callable[[], Dashboard]] = {
    rollout.UID: rollout.build,
    shadow.UID: shadow.build,
    health.UID: health.build,
}


def _number_panels(model: dict) -> dict:
    """Give every panel (rows and the panels inside collapsed rows too) a stable id, in order."""
    next_id = 1
    for panel in model.get("panels", []):
        panel["id"] = next_id
        next_id += 1
        for inner in panel.get("panels", []) or []:
            inner["id"] = next_id
            next_id += 1
    return model


def build_one(uid: str) -> dict:
    model = json.loads(json.dumps(BUILDERS[uid]().build(), cls=JSONEncoder))
    return _number_panels(model)


def build_all() -> dict[str, dict]:
    """uid → dashboard JSON model, as Grafana imports it."""
    return {uid: build_one(uid) for uid in BUILDERS}


def render(model: dict) -> str:
    """The committed text of one dashboard: sorted keys, indent 2, trailing newline."""
    return json.dumps(model, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _in_checkout() -> bool:
    return (PACKAGE_DIR.parent / "pyproject.toml").is_file()


def write(out_dir: str | Path | None = None, chart_dir: str | Path | None = None) -> list[Path]:
    """Write `<out_dir>/json/<uid>.json` (default: this package's directory).

    Also copies every dashboard and the Prometheus rules into the Helm chart: `chart_dir`, or, when
    building into this package in a source checkout, `helm/modelcanary`; a build into `out_dir`
    writes nothing outside it. Returns the paths written.
    """
    out = Path(out_dir) if out_dir is not None else PACKAGE_DIR
    chart = Path(chart_dir) if chart_dir is not None else (CHART_DIR if out_dir is None and _in_checkout() else None)
    written: list[Path] = []
    models = build_all()
    for uid, model in models.items():
        path = out / "json" / f"{uid}.json"
        written.append(_write_text(path, render(model)))
    if chart is not None:
        for uid, model in models.items():
            written.append(_write_text(chart / "files" / "dashboards" / f"{uid}.json", render(model)))
        written.append(_write_text(chart / "files" / "prometheus" / "rules.yaml", RULES_FILE.read_text(encoding="utf-8")))
    return written


def _write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def push(grafana_url: str, token: str | None = None, models: dict[str, dict] | None = None) -> list[str]:
    """Upload every dashboard into the "modelcanary" folder (created when missing), overwriting.

    `token` is a Grafana service-account token; without it, credentials in the URL
    (`http://user:pass@host:3000`) are used. Returns the uids pushed.
    """
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(grafana_url, credential=token) if token else GrafanaApi.from_url(grafana_url)
    try:
        api.folder.get_folder(FOLDER_UID)
    except GrafanaClientError as e:
        if e.status_code != 404:
            raise
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
    pushed = []
    for uid, model in (models or build_all()).items():
        api.dashboard.update_dashboard({
            "dashboard": model,
            "folderUid": FOLDER_UID,
            "overwrite": True,
            "message": "modelcanary dashboards push",
        })
        pushed.append(uid)
    return pushed


# --- CLI entry points (`modelcanary dashboards build|push`) ---------------------


def main_build(out: str | None = None) -> int:
    try:
        for path in write(out):
            print(f"wrote {path}")
    except OSError as e:
        print(f"error: --out {out}: cannot write there: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


_USERINFO = re.compile(r"(?<=://)[^/@\s]*@")


def redacted(text: str) -> str:
    """`text` with any URL's user:password@ shown as ***@ (as service.config's redacted_url, which
    this package may not import)."""
    return _USERINFO.sub("***@", text)


def grafana_url_problem(url: str) -> str | None:
    """Why `url` is no http(s)://[USER:PASS@]HOST[:PORT] URL, or None; the message never shows the password."""
    hint = "give http://HOST:PORT, e.g. http://127.0.0.1:3000"
    shown = repr(redacted(url))
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is what checks it
    except ValueError as e:
        return f"{shown} is not a URL ({e}); {hint}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{shown} is not an http(s) URL; {hint}"
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"{shown} contains spaces or control characters; {hint}"
    return None


def main_push(url: str, token: str | None = None) -> int:
    """Exit 2 for a --grafana-url that is no URL (nothing was asked), 1 when Grafana cannot be reached
    or refuses; the URL is printed without its password."""
    from grafana_client.client import GrafanaException

    if (problem := grafana_url_problem(url)) is not None:
        print(f"error: --grafana-url: {problem}", file=sys.stderr)
        return 2
    shown = redacted(url)
    try:
        uids = push(url, token)
    except GrafanaException as e:
        print(f"error: Grafana at {shown} refused the upload: {redacted(str(e))}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: cannot reach Grafana at {shown}: {redacted(str(e))}", file=sys.stderr)
        return 1
    for uid in uids:
        print(f"pushed {uid} to {shown} (folder {FOLDER_TITLE})")
    return 0


if __name__ == "__main__":
    sys.exit(main_build(sys.argv[1] if len(sys.argv) > 1 else None))
