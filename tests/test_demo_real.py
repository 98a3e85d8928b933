"""`modelcanary demo --real-model` tells the same story on a real local model (SmolLM2-135M on
llama.cpp's server, both arms): the candidate is the same model with a "be thorough" system prompt
and a higher `max_tokens`, and the judge rolls it back on evidence it measured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.llama_server import require_real_llm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.real_llm
@pytest.mark.timeout(420)
def test_real_model_demo_rolls_back_the_verbose_prompt():
    require_real_llm()
    result = subprocess.run([sys.executable, "-m", "modelcanary", "demo", "--real-model"],
                            capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "llama.cpp server" in result.stdout and "candidate: smol-verbose" in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"final: route=(\S+) phase=(\S+) decision=(\S+) reason=(.+)", last)
    assert match, last
    route, phase, decision, reason = match.groups()
    assert (route, phase, decision) == ("support-bot", "rolled_back", "rollback"), last
    assert "n=" in reason, reason
