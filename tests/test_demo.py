"""`modelcanary demo --duration N` tells the story: a candidate worse at tool calls is rolled back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_rolls_back_the_candidate_that_breaks_tools():
    result = subprocess.run([sys.executable, "-m", "service.cli", "demo", "--duration", "55"],
                            capture_output=True, text=True, cwd=ROOT, timeout=150)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"final: route=(\S+) phase=(\S+) decision=(\S+) reason=(.+)", last)
    assert match, last
    route, phase, decision, reason = match.groups()
    assert (route, phase, decision) == ("support-bot", "rolled_back", "rollback"), last
    assert "tools" in reason and "n=" in reason
    assert "canary" in result.stdout and "stable" in result.stdout
