"""`modelcanary demo` tells the story: capability is a profile, not one number. Each
segment has its own rollout: the cheaper candidate is promoted for chat and JSON, tools stay on the
stable model, and the candidate worse everywhere is ruled out everywhere. `--route-scope` tells the
older story: one rollout for the whole route, so the candidate that breaks tool calls is rolled back."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.demo.runner import MAX_UNATTENDED_S, Roll, observe

ROOT = Path(__file__).resolve().parents[1]


def demo(*args: str) -> tuple[str, str]:
    """Without `--duration` the demo ends 3 s after the rollout does (at most after MAX_UNATTENDED_S)."""
    result = subprocess.run([sys.executable, "-m", "modelcanary", "demo", *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=MAX_UNATTENDED_S + 60)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout, result.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(MAX_UNATTENDED_S + 90)
def test_demo_promotes_per_segment_where_the_evidence_is():
    out, last = demo()
    match = re.fullmatch(r"final: route=(\S+) phase=(\S+) decision=(\S+) reason=(.+) segments=(\S+)", last)
    assert match, last
    route, phase, decision, reason, segments = match.groups()
    assert segments == "chat:promoted,json:promoted,tools:rolled_back", last
    assert (route, phase, decision) == ("support-bot", "partial", "rollback"), last
    # the reason is the tools evidence against the candidate that serves chat and JSON now
    assert reason.startswith("segment tools, candidate-m: ") and "n=" in reason, reason
    assert "candidate-m picked (select cheapest" in out and "segment tools: shadow → rolled_back" in out
    assert "  candidate-m: promoted in chat, json; ruled out in tools" in out
    assert "  budget-m: ruled out in chat, json, tools" in out  # worse everywhere


def test_history_keeps_a_segment_decided_before_it_was_first_seen():
    """On a slow machine the first state that lists the segments may already carry the controller's
    first decisions: those are moves out of shadow, and the history shows them."""
    def state(version: int, **segments: dict) -> dict:
        return {"phase": "canary", "step_index": 0, "canary_weight": 0.3, "version": version, "segments": segments}

    def seg(phase: str, step: int, reason: str, candidate: str | None = None) -> dict:
        return {"phase": phase, "step_index": step, "canary_weight": 0.3 if step >= 0 else 0.0,
                "candidate": candidate, "last_decision": {"reasons": [reason]}}

    roll = Roll()
    observe({"phase": "shadow", "step_index": -1, "canary_weight": 0.0, "version": 1}, roll, 1.0)
    observe(state(2, tools=seg("rolled_back", -1, "segment tools, budget-m: worse"),
                  chat=seg("canary", 0, "segment chat: candidate-m picked", "candidate-m"),
                  json=seg("shadow", -1, "")), roll, 5.0)
    observe(state(3, json=seg("canary", 0, "segment json: candidate-m picked", "candidate-m")), roll, 6.0)
    assert roll.history == [
        "      5 s  route shadow → canary",
        "      5 s  segment tools: shadow → rolled_back (0%): segment tools, budget-m: worse",
        "      5 s  segment chat: shadow → canary (30%, candidate-m): segment chat: candidate-m picked",
        "      6 s  segment json: shadow → canary (30%, candidate-m): segment json: candidate-m picked",
    ]


def test_the_demo_counts_an_evaluation_per_candidate_call_not_the_noise_floors():
    """Each shadowed request is one evaluation per candidate; the stable model asked again (the noise
    floor) is part of each, not one more."""
    from service.demo.runner import ROUTE, _scrape

    text = "".join(f'modelcanary_shadow_requests_total{{route="{ROUTE}",model="{m}",outcome="completed"}} {n}\n'
                   for m, n in (("candidate-m", 40), ("budget-m", 40), ("stable-m", 40)))
    assert _scrape(text, "stable-m")["shadow"]["evaluated"] == 80


def test_stopping_the_demo_while_it_starts_leaves_no_process(tmp_path):
    """SIGTERM before the services are ready (as a terminal's close or a CI timeout sends it): the
    simulator and the proxy, in sessions of their own, are stopped too."""
    import os
    import signal
    import tempfile
    import time

    before = set(Path(tempfile.gettempdir()).glob("modelcanary-demo-*"))
    demo = subprocess.Popen([sys.executable, "-m", "modelcanary", "demo", "--duration", "60"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        workdir = None
        while workdir is None or not (workdir / "modelcanary.yaml").exists():  # the proxy is being started
            assert time.monotonic() < deadline and demo.poll() is None, "the demo never started its services"
            new = set(Path(tempfile.gettempdir()).glob("modelcanary-demo-*")) - before
            workdir = next(iter(new), None)
            time.sleep(0.05)
        demo.send_signal(signal.SIGTERM)
        demo.wait(30)
    finally:
        if demo.poll() is None:
            demo.kill()
    left = [line for line in subprocess.run(["ps", "-eww", "-o", "pid,args"], capture_output=True, text=True).stdout.splitlines()
            if str(workdir) in line]
    for line in left:  # clean up before failing
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, left


@pytest.mark.timeout(MAX_UNATTENDED_S + 90)
def test_demo_route_scope_rolls_back_the_candidate_that_breaks_tools():
    result_stdout, last = demo("--route-scope")
    match = re.fullmatch(r"final: route=(\S+) phase=(\S+) decision=(\S+) reason=(.+)", last)
    assert match, last
    route, phase, decision, reason = match.groups()
    assert (route, phase, decision) == ("support-bot", "rolled_back", "rollback"), last
    assert "tools" in reason and "n=" in reason and "segments=" not in last
    assert "canary" in result_stdout and "stable" in result_stdout


@pytest.mark.timeout(180)
def test_demo_runs_from_an_installed_wheel(tmp_path):
    """The wheel alone carries what `modelcanary demo` needs (its configs are package data): build it
    from a copy of the sources, install it into a fresh venv, and run the demo outside the repository.
    The venv sees the dependencies through a .pth naming the project venv's site-packages, whose
    editable install of this repository is not activated by a plain path line."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("modelcanary", "service", "collectors", "dashboards"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist, venv, cwd = tmp_path / "dist", tmp_path / "venv", tmp_path / "elsewhere"
    pip = [sys.executable, "-m", "pip"]
    run([*pip, "wheel", "--no-deps", "-q", str(src), "-w", str(dist)])
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    run([*pip, "--python", str(python), "install", "-q", "--no-index", "--no-deps", "--find-links", str(dist),
         "modelcanary"])
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and (p / "fastapi").is_dir())
    (Path(site) / "project-deps.pth").write_text(f"{deps}\n")
    cwd.mkdir()
    where = run([str(python), "-c", "import service; print(service.__file__)"], cwd=cwd).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the installed package, not the source tree
    result = run([str(venv / "bin" / "modelcanary"), "demo", "--duration", "20"], cwd=cwd, timeout=120)
    assert re.fullmatch(r"final: route=support-bot phase=\S+ decision=\S+ reason=.+",
                        result.stdout.strip().splitlines()[-1]), result.stdout[-2000:]


def run(args: list[str], cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
    return result
