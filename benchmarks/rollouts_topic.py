"""Rollouts topic growth: a proxy and a controller in Kafka mode (Tansu, which does not compact) on a
steady rollout, held at its canary step and judged every second, with live traffic; how many bytes
the rollouts and reports topics gain per hour, and how long a new follower takes to catch up.

`--tree DIR` runs the processes from another source tree (e.g. `git archive <commit> | tar -x -C DIR`),
which is how the number before the topics were bounded was taken (results/rollouts_topic_other_tree.json:
commit 5f8563f, 4.8 MiB/hour of rollout states with their reports, one every 5 s).

    python benchmarks/rollouts_topic.py [--seconds 120] [--rate 20] [--tree DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    CHAT_BODY,
    CLI,
    ROOT,
    Proc,
    Stack,
    broker,
    free_port,
    loadgen,
    proxy_config,
    sim_config,
    table,
    write_result,
    write_yaml,
)
from service.bus.kafka import read_messages  # noqa: E402

PREFIX = "growth"


def topic_bytes(bootstrap: str, topic: str) -> tuple[int, int]:
    """(records, bytes of their JSON values) on a topic."""
    values = [m.value for m in read_messages(bootstrap, topic, timeout_s=20) if "_raw" not in m.value]
    return len(values), sum(len(json.dumps(v, separators=(",", ":"))) for v in values)


def start(stack: Stack, name: str, args: list[str], tree: Path, ready: str, port: int | None = None) -> Proc:
    return stack.start(Proc(name, CLI + args, stack.tmp / f"{name}.log", ready_url=ready, port=port, cwd=tree))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=20.0, help="client requests per second")
    ap.add_argument("--tree", type=Path, default=ROOT, help="source tree to run the processes from")
    args = ap.parse_args(argv)
    tree = args.tree.resolve()

    with Stack("rollouts-topic") as stack:
        bk = broker(stack)
        sim_port, proxy_port, control_port = free_port(), free_port(), free_port()
        sim_path = write_yaml(stack.tmp / "sim.yaml", sim_config())
        start(stack, "sim", ["simulate", "--config", str(sim_path), "--port", str(sim_port)], tree,
              f"http://127.0.0.1:{sim_port}/healthz")
        events = {"backend": "kafka", "kafka": {"bootstrap_servers": bk.bootstrap, "topic_prefix": PREFIX,
                                                "partitions": 2}}
        cfg = proxy_config(stack.tmp, f"http://127.0.0.1:{sim_port}", shadow_rate=0.0, events=events)
        # held at its first step: far too few samples to step on, nothing worse; judged every second
        cfg["routes"]["support-bot"]["rollout"] = {"steps": [50], "min_shadow_samples": 0, "min_step_seconds": 1,
                                                   "min_samples_per_step": 10_000_000, "mode": "auto"}
        cfg["control"] = {"interval_s": 1.0, "metrics_port": control_port}
        path = write_yaml(stack.tmp / "config.yaml", cfg)
        proxy = start(stack, "proxy", ["serve", "--config", str(path), "--port", str(proxy_port)], tree,
                      f"http://127.0.0.1:{proxy_port}/readyz", proxy_port)
        start(stack, "control", ["control", "--config", str(path)], tree, f"http://127.0.0.1:{control_port}/healthz")
        url = proxy.url + "/v1/chat/completions"
        loadgen(url, CHAT_BODY, rate=args.rate, duration_s=15, vary=True)  # into the canary step
        before = {t: topic_bytes(bk.bootstrap, f"{PREFIX}.{t}") for t in ("rollouts", "reports")}
        t0 = time.monotonic()
        loadgen(url, CHAT_BODY, rate=args.rate, duration_s=args.seconds, vary=True)
        elapsed = time.monotonic() - t0
        after = {t: topic_bytes(bk.bootstrap, f"{PREFIX}.{t}") for t in ("rollouts", "reports")}
        t1 = time.monotonic()
        read_messages(bk.bootstrap, f"{PREFIX}.rollouts", timeout_s=20)
        read_s = time.monotonic() - t1

    rows, out = [], {}
    for topic in ("rollouts", "reports"):
        records = after[topic][0] - before[topic][0]
        nbytes = after[topic][1] - before[topic][1]
        per_hour = nbytes * 3600 / elapsed
        out[topic] = {"records": records, "bytes": nbytes, "bytes_per_hour": round(per_hour),
                      "mean_record_bytes": round(nbytes / records) if records else None}
        rows.append([topic, records, nbytes, f"{per_hour / 2**20:.2f}", out[topic]["mean_record_bytes"]])
    result = {"tree": str(tree), "seconds": round(elapsed, 1), "rate": args.rate, "topics": out,
              "read_whole_rollouts_topic_s": round(read_s, 2)}
    path = write_result("rollouts_topic" if tree == ROOT else "rollouts_topic_other_tree", result)
    print(table(["topic", "records", "bytes", "MiB/hour", "bytes/record"], rows))
    print(f"\n{elapsed:.0f} s of a steady rollout judged every second ({tree}); results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
