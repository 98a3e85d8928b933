"""A missing real component skips a test locally and fails it when CI is set (tests/fixtures/require.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NEEDS_AN_ABSENT_COMPONENT = '''
import pytest
from tests.fixtures import require

require.COMPONENTS["absent-thing"] = (lambda: False, "get it from nowhere")


@pytest.mark.requires("absent-thing")
def test_marked():
    pass


def test_called():
    require.require("absent-thing")
'''


@pytest.mark.parametrize("ci", [None, "true"], ids=["local", "CI"])
def test_a_missing_component_skips_locally_and_fails_under_ci(tmp_path, ci):
    (tmp_path / "test_absent.py").write_text(NEEDS_AN_ABSENT_COMPONENT)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "tests.fixtures.require",
                             "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    out = result.stdout
    assert "absent-thing not available: get it from nowhere" in out, out
    if ci:
        # the mark fails the test in its setup (an error), the call in its body (a failure)
        assert result.returncode == 1 and "1 failed, 1 error" in out and "CI is set" in out, out
    else:
        assert result.returncode == 0 and "2 skipped" in out, out
