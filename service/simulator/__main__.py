"""`python -m service.simulator --config FILE [--host H] [--port P]` (the CLI's `simulate` runs `run`, too)."""

from __future__ import annotations

import argparse
import sys

from service.config import ConfigError, port_number
from service.simulator.config import load_simulator_config
from service.simulator.server import serve


def run(config_path: str, host: str, port: int) -> int:
    """Serve the simulator config file until SIGINT or SIGTERM: 0, or 1 after printing its problems.
    An OSError (cannot listen) is the caller's to report: each command words it its own way."""
    try:
        config = load_simulator_config(config_path)
    except ConfigError as e:
        print(e.explain("simulator config"), file=sys.stderr)
        return 1
    serve(config, host, port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.simulator",
                                     description="OpenAI-compatible simulated LLMs (DESIGN §8b).")
    parser.add_argument("--config", required=True, help="simulator YAML file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=9001, help="0 picks a free port (printed on start)")
    args = parser.parse_args(argv)
    try:
        return run(args.config, args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
