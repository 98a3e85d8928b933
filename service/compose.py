"""The composition root: the one module under `service/` that imports `collectors`.

`modelcanary serve` in memory mode runs the proxy, the controller and the shadow workers in one
process, and `modelcanary collect` runs the workers alone. Everywhere else the parts meet only on
the event bus.
"""

from __future__ import annotations

import os

from fastapi import FastAPI

from collectors import worker
from service.config import Config, load_config
from service.proxy import app


def create_app(config: Config, config_path: str | None = None) -> FastAPI:
    return app.create_app(config, config_path, shadow_workers=worker.run_workers)


def create_app_from_env() -> FastAPI:
    """uvicorn factory for `serve --workers N`: the config path comes from MODELCANARY_CONFIG."""
    path = os.environ["MODELCANARY_CONFIG"]
    return create_app(load_config(path), path)


def collect(config: Config) -> int:
    """`modelcanary collect`: shadow workers of Kafka mode, until SIGTERM."""
    return worker.main(config)
