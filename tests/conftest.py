import os

import pytest

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

# Fixture modules: what a missing component does (require), then one per real component the suite starts.
pytest_plugins = [p for p in (
    "tests.fixtures.require",
    "tests.fixtures.servers",
    "tests.fixtures.broker",
    "tests.fixtures.prometheus",
    "tests.fixtures.llama_server",
) if os.path.exists(os.path.join(os.path.dirname(__file__), "fixtures", p.rsplit(".", 1)[1] + ".py"))]


@pytest.fixture
def anyio_backend():
    return "asyncio"
