"""`modelcanary` command line (DESIGN §3)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import tempfile

from service.config import ConfigError, load_config


def _config_or_exit(path: str):
    try:
        return load_config(path)
    except ConfigError as e:
        print(e.explain(), file=sys.stderr)
        raise SystemExit(1) from None


def _logging(level: str = "INFO") -> None:
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


def worker_app():
    """uvicorn factory for `serve --workers N` (each worker process): the app, with the GC tuned."""
    from service.compose import create_app_from_env

    app = create_app_from_env()
    tune_gc()
    return app


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    config = _config_or_exit(args.config)
    host = args.host or config.server.host
    port = args.port if args.port is not None else config.server.port
    workers = args.workers or 1
    if workers > 1 and config.events.backend != "kafka":
        print("error: --workers > 1 needs events.backend: kafka (each worker follows the rollouts topic); "
              "memory mode is one process", file=sys.stderr)
        return 1
    _logging()
    from service.proxy.server import GuardedHttpToolsProtocol  # httptools with head size and time limits

    common = dict(host=host, port=port, log_level="warning", access_log=False, loop="uvloop",
                  http=GuardedHttpToolsProtocol,
                  timeout_graceful_shutdown=config.server.drain_seconds, proxy_headers=False,
                  server_header=False, date_header=False)
    if workers > 1:
        os.environ["MODELCANARY_CONFIG"] = os.path.abspath(args.config)
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="modelcanary-metrics-"))
        uvicorn.run("service.cli:worker_app", factory=True, workers=workers, **common)
        return 0
    from service.compose import create_app
    from service.proxy.server import DrainingServer

    app = create_app(config, os.path.abspath(args.config))
    server = DrainingServer(uvicorn.Config(app, **common), app.state.runtime)
    tune_gc()
    server.run()
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from service.compose import collect

    config = _config_or_exit(args.config)
    _logging()
    return collect(config)


def cmd_control(args: argparse.Namespace) -> int:
    from service.rollout.controller import main

    config = _config_or_exit(args.config)
    _logging()
    return main(config)


def cmd_simulate(args: argparse.Namespace) -> int:
    from service.simulator.config import load_simulator_config
    from service.simulator.server import serve

    try:
        sim = load_simulator_config(args.config)
    except ConfigError as e:
        print(e.explain("simulator config"), file=sys.stderr)
        return 1
    serve(sim, args.host, args.port)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from service.demo.runner import run_demo

    return run_demo(duration=args.duration, good_candidate=args.good_candidate)


def cmd_check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as e:
        for problem in e.problems:
            print(f"{problem}", file=sys.stderr)
        print(f"{e.source}: {len(e.problems)} problem(s)", file=sys.stderr)
        return 1
    routes = ", ".join(f"{name} ({rc.stable}{' → ' + rc.candidate if rc.candidate else ''})"
                       for name, rc in config.routes.items())
    print(f"{args.file}: ok — {len(config.providers)} provider(s), {len(config.models)} model(s), routes: {routes}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from service.admin.cli import status

    return status(args.url, args.token, args.route)


def cmd_action(args: argparse.Namespace) -> int:
    from service.admin.cli import act

    return act(args.url, args.token, args.route, args.command)


def cmd_report(args: argparse.Namespace) -> int:
    from service.admin.cli import report

    return report(args.url, args.token, args.route, args.json)


def cmd_dashboards(args: argparse.Namespace) -> int:
    from dashboards.build import main_build, main_push

    if args.dashboards_command == "build":
        return main_build(args.out) or 0
    return main_push(args.grafana_url, args.token) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelcanary", description="Canary and shadow rollouts for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the proxy (and, in memory mode, shadow workers and controller)")
    p.add_argument("--config", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int, default=1)
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
    p.add_argument("--port", type=int, default=9001)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("demo", help="everything embedded + simulator + traffic + live view")
    p.add_argument("--duration", type=float, default=None, help="seconds of traffic, then a summary (default: until Ctrl-C)")
    p.add_argument("--good-candidate", action="store_true", help="a candidate that deserves promotion")
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

    for action in ("promote", "pause", "resume", "rollback"):
        p = sub.add_parser(action, help=f"{action} a route's rollout")
        p.add_argument("route")
        p.add_argument("--url", required=True)
        p.add_argument("--token", default=token_default)
        p.set_defaults(func=cmd_action)

    p = sub.add_parser("report", help="capability matrix: per segment, stable vs candidate")
    p.add_argument("route")
    p.add_argument("--url", required=True)
    p.add_argument("--token", default=token_default)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("dashboards", help="Grafana dashboards")
    dsub = p.add_subparsers(dest="dashboards_command", required=True)
    b = dsub.add_parser("build", help="generate dashboard JSON and rules")
    b.add_argument("--out")
    b = dsub.add_parser("push", help="upload dashboards to Grafana")
    b.add_argument("--grafana-url", required=True)
    b.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"))
    p.set_defaults(func=cmd_dashboards)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
