"""Imports run one way: the folders follow the request's path (README "Code map")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> packages it must never import (at run time; `if TYPE_CHECKING:` imports are types only)
FORBIDDEN = {
    "service": ["collectors", "modelcanary"],
    "collectors": ["modelcanary"],
    "service.upstream": ["service.proxy", "service.rollout", "service.admin", "service.demo", "service.bus"],
    "service.bus": ["service.proxy", "service.rollout", "service.admin", "service.demo", "service.upstream"],
    "service.judge": ["service.proxy", "service.rollout", "service.admin", "service.demo", "service.bus"],
    "service.rollout": ["service.proxy", "service.admin", "service.demo"],
    "service.simulator": ["service.rollout", "service.admin", "service.demo", "service.bus", "service.judge"],
    "service.admin": ["service.proxy", "service.demo", "service.simulator"],
    "service.proxy": ["service.demo", "service.simulator"],
    "service.proxy.formats": ["service.rollout", "service.admin", "service.bus", "service.judge", "service.demo"],
    "collectors.similarity": ["collectors.worker", "collectors.evaluators", "collectors.golden", "collectors.embedded",
                              "service.proxy", "service.rollout", "service.bus"],
    "collectors.evaluators": ["collectors.worker", "collectors.golden", "collectors.embedded"],
    "collectors.worker": ["collectors.golden", "collectors.embedded"],
    "dashboards": ["service", "collectors", "modelcanary"],
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.lineno, child.module))
            visit(child)

    visit(tree)
    return found


def violations() -> list[str]:
    out = []
    for path in sorted(p for folder in ("service", "collectors", "dashboards") for p in (ROOT / folder).rglob("*.py")):
        mod = _module(path)
        for line, target in _runtime_imports(ast.parse(path.read_text())):
            for owner, banned in FORBIDDEN.items():
                if mod != owner and not mod.startswith(owner + "."):
                    continue
                hit = next((b for b in banned if target == b or target.startswith(b + ".")), None)
                if hit:
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({owner} may not import {hit})")
    return out


def test_imports_run_one_way():
    assert violations() == []


def test_the_check_sees_a_reverse_import(tmp_path, monkeypatch):
    bad = ROOT / "service" / "judge" / "_layout_probe.py"
    bad.write_text("from collectors.worker import run_workers\nimport service.proxy.chat\n")
    try:
        found = violations()
    finally:
        bad.unlink()
    assert any("_layout_probe.py:1 imports collectors.worker" in v for v in found)
    assert any("_layout_probe.py:2 imports service.proxy.chat" in v for v in found)


@pytest.mark.parametrize("folder", ["modelcanary", "service", "collectors"])
def test_code_map_names_every_folder(folder):
    readme = (ROOT / "README.md").read_text()
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("__init__.py"))
    missing = [p for p in packages if f"`{p}/`" not in readme]
    assert missing == [], f"README's code map lacks {missing}"
