"""The composition root: the one module that imports both `service` and `collectors`, and the
`modelcanary` command's entry point. `service.cli` parses and runs the commands; what needs the
shadow workers or the golden sets comes from here (`service.cli.Wiring`), so `service` never
imports `collectors`.

`modelcanary serve` in memory mode runs the proxy and the controller in one process and the shadow
workers in a child process of it (collectors.embedded), and `modelcanary collect` runs the workers
alone. Everywhere else the parts meet only on the event bus.
"""

from __future__ import annotations

import os
import sys

from fastapi import FastAPI

from collectors import worker
from collectors.embedded import run_in_child
from service import cli
from service.config import Config, load_config
from service.proxy import app

# uvicorn imports this (`serve --workers N`): each worker process builds its own app
WORKER_FACTORY = "modelcanary.compose:worker_app"


def create_app(config: Config, config_path: str | None = None, workers: int = 1) -> FastAPI:
    return app.create_app(config, config_path, shadow_workers=run_in_child, workers=workers)


def worker_app() -> FastAPI:
    """uvicorn factory for `serve --workers N` (each worker process): the config path comes from
    MODELCANARY_CONFIG, N from MODELCANARY_WORKERS; the GC is tuned as in one process."""
    path = os.environ["MODELCANARY_CONFIG"]
    application = create_app(load_config(path), path, workers=int(os.environ["MODELCANARY_WORKERS"]))
    cli.tune_gc()
    return application


def collect(config: Config) -> int:
    """`modelcanary collect`: shadow workers of Kafka mode, until SIGTERM."""
    return worker.main(config)


def capture(args) -> int:
    """`modelcanary capture`: sampled live traffic to a golden set."""
    from collectors.golden.commands import capture as run

    return run(args.config, args.out, args.per_segment, args.since, args.until, args.url, args.token)


def dataset_stats(path: str) -> int:
    """`modelcanary dataset stats DATASET`."""
    from collectors.golden.commands import dataset_stats as run

    return run(path)


def replay(args) -> int:
    """`modelcanary replay DATASET --candidate KEY`: offline, judged like a shadow rollout."""
    from collectors.golden.commands import replay as run

    return run(args.dataset, args.candidate, args.stable, args.repeats, args.config, args.json, args.against_report,
               args.route)


def main(argv: list[str] | None = None) -> int:
    """The `modelcanary` command."""
    return cli.main(argv, wiring=sys.modules[__name__])
