"""Build, write and push the dashboards (`modelcanary dashboards build | push`).

The JSON is generated deterministically (sorted keys, fixed panel ids, no
timestamps) and committed under `dashboards/json/`; a test fails when it is
stale. In a source checkout `write` also refreshes the Helm chart's copies
(`helm/modelcanary/files/dashboards/<uid>.json` and
`helm/modelcanary/files/prometheus/rules.yaml`).
"""

from __future__ import annotations

import json
import sys
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
        written = write(out)
    except OSError as e:
        print(f"error: --out {out}: cannot write there: {e.strerror or e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


def main_push(url: str, token: str | None, redacted: Callable[[str], str]) -> int:
    """Exit 1 when Grafana cannot be reached or refuses (the URL was checked by the caller); what is
    printed passes through `redacted`, which hides a URL's password."""
    from grafana_client.client import GrafanaException

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
