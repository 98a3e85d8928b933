"""The composition root: the one module that imports both `service` and `collectors`, and the
`modelcanary` command's entry point. `service.cli` parses and runs the commands; what needs the
shadow workers or the golden sets comes from here (`service.cli.Wiring`), so `service` never
imports `collectors`.

`modelcanary serve` in memory mode runs the proxy and the controller in one process and the shadow
workers in a child process of it (collectors.embedded), and `modelcanary collect` runs the workers
alone. Everywhere else the parts meet only on the event bus.

Everything is imported where it is used: importing this module (the console script's first step)
costs next to nothing, so that `main` is there to catch a Ctrl-C while the rest is still being imported.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import argparse

    from fastapi import FastAPI

    from service.config import Config

# uvicorn imports this (`serve --workers N`): each worker process builds its own app
WORKER_FACTORY = "modelcanary.compose:worker_app"


def create_app(config: Config, config_path: str | None = None, workers: int = 1) -> FastAPI:
    from collectors.embedded import run_in_child
    from service.proxy import app

    return app.create_app(config, config_path, shadow_workers=run_in_child, workers=workers)


def worker_app(config: Config, config_path: str, workers: int) -> FastAPI:
    """One worker's app in `serve --workers N` (service.proxy.server.WorkerProcess), on the config the
    supervisor checked; logging and the GC are set up as in one process."""
    from service import cli

    cli.configure_logging()
    application = create_app(config, config_path, workers=workers)
    cli.tune_gc()
    return application


def collect(config: Config) -> int:
    """`modelcanary collect`: shadow workers of Kafka mode, until SIGTERM."""
    from collectors import worker

    return worker.main(config)


def capture(args: argparse.Namespace) -> int:
    """`modelcanary capture`: sampled live traffic to a golden set."""
    from collectors.golden.commands import capture as run

    return run(args.config, args.out, args.per_segment, args.since, args.until, args.url, args.token)


def dataset_stats(path: str) -> int:
    """`modelcanary dataset stats DATASET`."""
    from collectors.golden.commands import dataset_stats as run

    return run(path)


def replay(args: argparse.Namespace) -> int:
    """`modelcanary replay DATASET --candidate KEY`: offline, judged like a shadow rollout."""
    from collectors.golden.commands import replay as run

    return run(args.dataset, args.candidate, args.stable, args.repeats, args.config, args.json, args.against_report,
               args.route)


def main(argv: list[str] | None = None) -> int:
    """The `modelcanary` command. Without `argv` it is this process's own command line, and a Ctrl-C at
    any point, the imports included, ends the process quietly by SIGINT (see `_end_by`)."""
    if argv is not None:
        from service import cli

        return cli.main(argv, wiring=sys.modules[__name__])
    try:
        return main(sys.argv[1:])
    except KeyboardInterrupt:
        _end_by(signal.SIGINT)
    finally:  # done: a Ctrl-C while the process exits ends it at once
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _end_by(sig: signal.Signals) -> NoReturn:
    """End the process by `sig`, as Python ends on an uncaught Ctrl-C but without its traceback: the
    `finally` blocks on the way here have run; a shell says 128 + the signal's number (130) and a
    script that ran the command stops too. SIGTERM needs nothing of this: by default it ends the
    process quietly, and the commands that serve until stopped drain on it and exit 0."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    raise SystemExit(128 + sig)  # only if the signal is blocked
