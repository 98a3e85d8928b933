"""`modelcanary` command line (DESIGN §3)."""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from service.config import (
    Config,
    ConfigError,
    environment_problems,
    load_config,
    port_number,
    redacted_url,
    tls_file_problems,
)

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

log = logging.getLogger("modelcanary")

STARTUP_FAILURE = 3  # as uvicorn's: the service could not listen, or its startup failed


def cannot_listen(where: str, e: OSError) -> int:
    """Say on stderr that the address `where` (the fields or flags it came from) could not be listened
    on, and why in a few words (aiohttp's own message is long); STARTUP_FAILURE."""
    reason = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or str(e)
    print(f"error: cannot listen on {where}: {reason}", file=sys.stderr)
    return STARTUP_FAILURE


class Wiring(Protocol):
    """What the commands need of `collectors`, handed in by the composition root
    (`modelcanary.compose`): this package never imports `collectors`."""

    WORKER_FACTORY: str  # "module:function" (config, its path, N) -> one worker's app in `serve --workers N`

    def create_app(self, config: Config, config_path: str | None = None) -> FastAPI: ...

    def collect(self, config: Config) -> int: ...

    def capture(self, args: argparse.Namespace) -> int: ...

    def dataset_stats(self, path: str) -> int: ...

    def replay(self, args: argparse.Namespace) -> int: ...


def _config_or_exit(path: str, proxy: bool = False) -> Config:
    """The config, with what it names in the environment (`proxy`: also what only the proxy reads) and
    the TLS files it opens; else the problems, and exit 1."""
    try:
        config = load_config(path)
        problems = environment_problems(config, proxy) + tls_file_problems(config)
        if problems:
            raise ConfigError(path, problems)
        return config
    except ConfigError as e:
        print(e.explain(), file=sys.stderr)
        raise SystemExit(1) from None


def config_notes(config: Config) -> list[str]:
    """What a valid config does that its author may not expect (said at start, never silent): providers
    that forward each client's own key upstream, routes whose shadow phase can never end on its own,
    and candidates whose cost can't be compared with the stable model's (one of the two has no price)."""
    keys = [f"provider {name} {reason}: each client's own Authorization header is forwarded to it"
            for name, provider in config.providers.items() if (reason := provider.forwards_client_key())]
    stuck = [f"route {name}: shadow.sample_rate is 0, so the {rc.rollout.min_shadow_samples} shadow samples of "
             "rollout.min_shadow_samples never come and the judge never moves the rollout out of shadow: promote "
             "it by hand, or set rollout.min_shadow_samples: 0"
             for name, rc in config.routes.items()
             if rc.candidates and rc.shadow.sample_rate == 0 and rc.rollout.min_shadow_samples > 0]
    unpriced = [f"route {name}: {free} has no price and {priced} has one, so the judge can't compare cost per "
                f"completion (no estimate, it never gates promotion): give models.{free}.price, or neither a price"
                for name, rc in config.routes.items() for candidate in rc.candidates
                for free, priced in ((rc.stable, candidate), (candidate, rc.stable))
                if not _priced(config, free) and _priced(config, priced)]
    return keys + stuck + unpriced


def _priced(config: Config, model: str) -> bool:
    price = config.models[model].price
    return price.input_per_mtok > 0 or price.output_per_mtok > 0


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


# A proxy keeps a steady set of long-lived objects (config, connection pools, bounded caches) and makes
# many short-lived ones per request. With CPython's default thresholds (700, 10, 10) a full collection
# then runs every couple of thousand requests and walks every long-lived object: measured at ~15% of a
# busy proxy's CPU, in pauses of tens of ms. So: freeze what exists once started (it is never garbage)
# and collect young objects less often. Cycles are still collected, just in larger batches.
GC_THRESHOLDS = (20_000, 20, 20)


def tune_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def directory_problems(config: Config, create: bool = True) -> list[str]:
    """The directory the proxy writes to that it could not (`create` False: judged without touching
    the disk): memory mode's `state_dir`, Kafka mode's `events.spool.dir`."""
    from service.rollout.state_file import state_dir_problem

    if config.events.backend == "memory":
        problem = state_dir_problem(Path(config.state_dir), create)
        return [f"state_dir: {problem}; the rollout state would be lost on restart"] if problem else []
    problem = state_dir_problem(Path(config.events.spool.dir), create)
    return [f"events.spool.dir: {problem}; records the broker can't take would be lost"] if problem else []


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    config = _config_or_exit(args.config, proxy=True)
    if problems := directory_problems(config):
        print(f"error: {problems[0]}", file=sys.stderr)
        return 1
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    workers = args.workers
    if workers > 1 and config.events.backend != "kafka":
        print("error: --workers > 1 needs events.backend: kafka (each worker follows the rollouts topic); "
              "memory mode is one process", file=sys.stderr)
        return 1
    from service.proxy.server import GuardedHttpToolsProtocol, listening_socket  # httptools with head limits

    try:
        sock = listening_socket(host, port)
        sock.listen()  # the address is ours from here: another process could take a port only bound
    except OSError as e:  # one line naming where the address came from, before anything starts
        where = f"{'--host' if args.host else 'server.host'} {host}, {'--port' if args.port is not None else 'server.port'} {port}"
        return cannot_listen(where, e)
    configure_logging()
    for note in config_notes(config):
        log.warning(note)

    common = dict(host=host, port=port, log_level="warning", access_log=False, loop="uvloop",
                  http=GuardedHttpToolsProtocol,
                  timeout_graceful_shutdown=config.server.drain_seconds, proxy_headers=False,
                  server_header=False, date_header=False)
    if workers > 1:
        return _serve_workers(args, config, sock, uvicorn.Config(args.wiring.WORKER_FACTORY, workers=workers, **common))
    from service.proxy.server import DrainingServer

    app = args.wiring.create_app(config, os.path.abspath(args.config))
    server = DrainingServer(uvicorn.Config(app, **common), app.state.runtime)
    tune_gc()
    try:
        server.run(sockets=[sock])
    except SystemExit:  # how uvicorn ends when the app's startup failed (it logged why)
        if server.started:
            raise
    if not server.started:
        print("error: the proxy did not start: its startup failed (the lines above say why)", file=sys.stderr)
        return STARTUP_FAILURE
    return 0


def _serve_workers(args: argparse.Namespace, config: Config, sock: socket.socket, server: uvicorn.Config) -> int:
    """`serve --workers N`: N worker processes on the one listening socket, their metrics summed in
    PROMETHEUS_MULTIPROC_DIR (a directory of our own, removed at the end, unless one is given)."""
    from service.proxy.server import HEALTHCHECK_S, Workers

    given = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if given and not os.path.isdir(given):
        print(f"error: PROMETHEUS_MULTIPROC_DIR {given}: no such directory (serve --workers N keeps every "
              "worker's metrics there)", file=sys.stderr)
        return 1
    own = None if given else tempfile.mkdtemp(prefix="modelcanary-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = given or own or ""
    server.timeout_worker_healthcheck = HEALTHCHECK_S
    path = os.path.abspath(args.config)
    supervisor = Workers(server, [sock], config, path, partial(_reloaded, path))
    try:
        supervisor.run()
    finally:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
    if supervisor.startup_failed:
        print("error: the proxy did not start: a worker's startup failed (the lines above say why)", file=sys.stderr)
        return STARTUP_FAILURE
    return 0


def _reloaded(path: str, running: Config) -> Config:
    """The file at `path` once more, for a SIGHUP to `serve --workers N`: checked as `serve` checks it at
    start and as a reload does (what only a restart changes), else ConfigError."""
    from service.proxy.app import start_only_changes

    config = load_config(path)
    problems = (environment_problems(config, proxy=True) + tls_file_problems(config)
                + start_only_changes(running, config))
    if problems:
        raise ConfigError(path, problems)
    return config


def cmd_collect(args: argparse.Namespace) -> int:
    config = _config_or_exit(args.config)
    configure_logging()
    return args.wiring.collect(config)


def cmd_control(args: argparse.Namespace) -> int:
    from service.rollout.controller import main

    config = _config_or_exit(args.config)
    configure_logging()
    return main(config)


def cmd_simulate(args: argparse.Namespace) -> int:
    from service.simulator.__main__ import run

    try:
        return run(args.config, args.host, args.port)
    except OSError as e:  # the port is taken, or the host is not ours: one line, as `serve` says it
        print(f"ERROR:    {e}", file=sys.stderr)
        return STARTUP_FAILURE


def cmd_demo(args: argparse.Namespace) -> int:
    from service.demo.runner import run_demo

    return run_demo(duration=args.duration, good_candidate=args.good_candidate, real_model=args.real_model,
                    route_scope=args.route_scope)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
        problems = environment_problems(config, proxy=True) + directory_problems(config, create=False)
        if problems:
            raise ConfigError(args.file, problems)
    except ConfigError as e:
        for problem in e.problems:
            print(f"{problem}", file=sys.stderr)
        print(f"{e.source}: {len(e.problems)} problem(s)", file=sys.stderr)
        return 1
    routes = ", ".join(f"{name} ({rc.stable}{' → ' + ', '.join(rc.candidates) if rc.candidates else ''})"
                       for name, rc in config.routes.items())
    print(f"{args.file}: ok — {len(config.providers)} provider(s), {len(config.models)} model(s), routes: {routes}")
    for note in config_notes(config):
        print(f"note: {note}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from service.admin.cli import status

    return status(args.url, args.token, args.route)


def cmd_action(args: argparse.Namespace) -> int:
    from service.admin.cli import act

    return act(args.url, args.token, args.route, args.command, args.segment)


def cmd_report(args: argparse.Namespace) -> int:
    from service.admin.cli import report

    return report(args.url, args.token, args.route, args.json)


def cmd_capture(args: argparse.Namespace) -> int:
    return args.wiring.capture(args)


def cmd_dataset(args: argparse.Namespace) -> int:
    return args.wiring.dataset_stats(args.dataset)


def cmd_replay(args: argparse.Namespace) -> int:
    return args.wiring.replay(args)


def cmd_dashboards(args: argparse.Namespace) -> int:
    from dashboards.build import main_build, main_push

    if args.dashboards_command == "build":
        return main_build(args.out) or 0
    from service.admin.cli import BadURLError, check_url

    try:
        check_url("--grafana-url", args.grafana_url)
    except BadURLError as e:  # nothing was asked
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return main_push(args.grafana_url, args.token, redacted_url)


def seconds(text: str) -> float:
    """A `--duration`: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: give a number of seconds above 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelcanary", description="Canary and shadow rollouts for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the proxy (and, in memory mode, shadow workers and controller)")
    p.add_argument("--config", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=port_number)
    p.add_argument("--workers", type=worker_count, default=1)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("collect", help="run shadow workers (Kafka mode)")
    p.add_argument("--config", required=True)
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("control", help="run the rollout controller (Kafka mode)")
    p.add_argument("--config", required=True)
    p.set_defaults(func=cmd_control)

    p = sub.add_parser("simulate", help="serve OpenAI-compatible fake models")
    p.add_argument("--config", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=9001)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("demo", help="everything embedded + simulator + traffic + live view")
    p.add_argument("--duration", type=seconds, default=None,
                   help="seconds of traffic, then a summary (default: until the rollout ends, at most 180 s)")
    p.add_argument("--good-candidate", action="store_true",
                   help="one rollout for the whole route, of a candidate that deserves promotion")
    p.add_argument("--route-scope", action="store_true",
                   help="one rollout for the whole route (rollout.scope: route) of one candidate, instead of "
                        "each segment its own with two candidates")
    p.add_argument("--real-model", action="store_true",
                   help="both arms on a local model (SmolLM2-135M on llama.cpp's server, `make real-llm`); "
                        "the candidate is a changed system prompt and params")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("check-config", help="validate a config file")
    p.add_argument("file")
    p.set_defaults(func=cmd_check_config)

    token_default = os.environ.get("MODELCANARY_ADMIN_TOKEN")
    p = sub.add_parser("status", help="rollout state as a table")
    p.add_argument("route", nargs="?")
    p.add_argument("--url", required=True)
    p.add_argument("--token", default=token_default)
    p.set_defaults(func=cmd_status)

    helps = {"promote": "move a route's rollout one step on (shadow → first step → … → promoted)",
             "pause": "freeze a route's rollout where it is", "resume": "let a paused rollout go on",
             "rollback": "send all of a route's traffic back to the stable model"}
    for action in ("promote", "pause", "resume", "rollback"):
        p = sub.add_parser(action, help=helps[action])
        p.add_argument("route")
        p.add_argument("--segment", help="only this segment's rollout (rollout.scope: segment)")
        p.add_argument("--url", required=True)
        p.add_argument("--token", default=token_default)
        p.set_defaults(func=cmd_action)

    p = sub.add_parser("report", help="capability matrix: per segment, stable vs candidate")
    p.add_argument("route")
    p.add_argument("--url", required=True)
    p.add_argument("--token", default=token_default)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("capture", help="write sampled live traffic to a golden set (JSONL)")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="the dataset file to write")
    p.add_argument("--per-segment", type=int, help="at most N cases per route and segment")
    p.add_argument("--since", help="unix seconds, ISO 8601, or an age (2h, 7d)")
    p.add_argument("--until", help="unix seconds, ISO 8601, or an age (2h, 7d)")
    p.add_argument("--url", help="memory mode: the running proxy (default: the config's server host and port)")
    p.add_argument("--token", help="memory mode: the admin token (default: the config's admin_token_env)")
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser("dataset", help="golden sets")
    dsub = p.add_subparsers(dest="dataset_command", required=True)
    s = dsub.add_parser("stats", help="cases per segment, and how many carry checks")
    s.add_argument("dataset")
    p.set_defaults(func=cmd_dataset)

    p = sub.add_parser("replay", help="run a golden set against a candidate offline; exit 1 if something is worse")
    p.add_argument("dataset")
    p.add_argument("--candidate", required=True, help="a model key from the config's models")
    p.add_argument("--stable", help="the model asked again for the noise floor (default: the route's stable)")
    p.add_argument("--repeats", type=int, help="ask each model k times per case (stability); 1: no stability")
    p.add_argument("--route", action="append", help="replay this route's cases only (repeatable; default: every "
                   "route whose stable model speaks the candidate's API)")
    p.add_argument("--config", help="providers and models (default: $MODELCANARY_CONFIG)")
    p.add_argument("--json", action="store_true", help="the full result, with repro, as JSON on stdout")
    p.add_argument("--against-report", metavar="URL",
                   help="a proxy's admin URL: compare with the live rollout's report ($MODELCANARY_ADMIN_TOKEN)")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("dashboards", help="Grafana dashboards")
    dsub = p.add_subparsers(dest="dashboards_command", required=True)
    b = dsub.add_parser("build", help="generate dashboard JSON and rules")
    b.add_argument("--out")
    b = dsub.add_parser("push", help="upload dashboards to Grafana")
    b.add_argument("--grafana-url", required=True)
    b.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"))
    p.set_defaults(func=cmd_dashboards)
    return parser


def worker_count(text: str) -> int:
    """A `--workers` flag's value: 1 or more processes."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of worker processes: give 1 or more")
    return int(text)


def main(argv: list[str] | None, wiring: Wiring) -> int:
    """Run one command; `modelcanary.compose.main` is the entry point that hands in the wiring (and
    ends the process on a Ctrl-C)."""
    args = build_parser().parse_args(argv)
    args.wiring = wiring
    try:
        code = args.func(args) or 0
        sys.stdout.flush()  # a reader that stopped shows here, not in Python's own flush at exit
        return code
    except BrokenPipeError:  # the reader stopped (`| head`): no traceback, the shell's code for SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail
        return 141
