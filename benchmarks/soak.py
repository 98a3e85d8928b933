"""Soak: mixed traffic for N minutes on the real stack (Kafka mode: `serve`, `collect`, two `control`
processes, a Tansu broker, the simulator), with a fault injected every 30 s through TCP fault proxies
in front of the simulator and the broker, and a SIGKILL of the leading controller every 2 minutes
(restarted at once, as Kubernetes would). Not part of `make test`.

Reports errors by cause (proxy metrics and client statuses), RSS and open file descriptors over
time with a fitted growth trend, client latency with and without a fault, events in vs out (what
the proxy produced against what is on the topics once the spool has drained, after de-duplication
by request id), what the controllers judged (outcomes, feedback and evaluations counted in the last
report, against what is on the topics), how long each failover took, and whether any route and
version was published twice. Prints a table; writes benchmarks/results/soak.json.

    python benchmarks/soak.py [--minutes 10] [--rate 20] [--fault-every 30] [--kill-controller-every 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import (  # noqa: E402
    CLI,
    Proc,
    Stack,
    free_port,
    loadavg,
    metric_sum,
    rss_bytes,
    scrape,
    table,
    write_result,
    write_yaml,
)
from service.bus.kafka import read_messages  # noqa: E402
from tests.faults.fault_proxy import FaultProxy, ProxiedBroker  # noqa: E402

ROUTE = "support-bot"
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "parameters": {
    "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}]
SAMPLE_EVERY_S = 5.0
UPSTREAM_TIMEOUT_S = 3.0
_BODY_503 = b'{"error": {"message": "overloaded", "type": "server_error", "code": "service_unavailable"}}'
HTTP_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (len(_BODY_503), _BODY_503))

# (name, target, mode, kwargs, seconds): broker faults outlast the producer's 15 s delivery timeout,
# so the spool is used, not only the producer's buffer
FAULTS = [
    ("upstream delay 0.5 s", "upstream", "delay", {"delay_s": 0.5}, 10),
    ("broker blackhole", "broker", "blackhole", {}, 20),
    ("upstream reset mid-stream", "upstream", "reset", {"after_bytes": 900}, 10),
    ("upstream 503 storm", "upstream", "reply", {"reply": HTTP_503}, 10),
    ("broker down (drop)", "broker", "drop", {}, 20),
    ("upstream blackhole", "upstream", "blackhole", {}, 10),
    ("upstream drop", "upstream", "drop", {}, 8),
]


def sim_config() -> dict:
    model = {"latency_s": {"median": 0.08, "p95": 0.3}, "ttft_s": {"median": 0.02, "p95": 0.06},
             "output_tokens": {"median": 40, "p95": 120}, "context_tokens": 128000, "divergence": 0.05,
             "failures": {"rate_limited": 0.005, "provider_5xx": 0.003, "truncated": 0.005, "refusal": 0.002,
                          "invalid_json": 0.01, "invalid_tool_call": 0.01}}
    return {"seed": 17, "time_scale": 1.0, "models": {"good-model": model, "new-model": dict(model)}}


def stack_config(tmp: Path, sim_url: str, bootstrap: str) -> dict:
    return {
        "server": {"drain_seconds": 5},
        "providers": {"sim": {"base_url": sim_url + "/v1", "timeout_s": UPSTREAM_TIMEOUT_S, "connect_timeout_s": 1,
                              "max_retries": 2}},
        "models": {"stable-m": {"provider": "sim", "name": "good-model",
                                "price": {"input_per_mtok": 0.4, "output_per_mtok": 1.6}},
                   "candidate-m": {"provider": "sim", "name": "new-model",
                                   "price": {"input_per_mtok": 0.2, "output_per_mtok": 0.8}}},
        "routes": {ROUTE: {"stable": "stable-m", "candidate": "candidate-m",
                           "shadow": {"sample_rate": 0.3, "max_per_minute": 100_000, "noise_floor": True},
                           "rollout": {"steps": [10, 50], "mode": "advisory", "min_step_seconds": 30},
                           "task_types": ["billing"]}},
        "events": {"backend": "kafka", "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": "soak",
                                                 "partitions": 3},
                   "spool": {"dir": str(tmp / "spool")}},
        "state_dir": str(tmp / "state"),
        "control": {"report_interval_s": 5},
    }


class Controllers:
    """Two `modelcanary control` processes; `kill_leader()` SIGKILLs the leading one, waits for the
    other to lead (off the caller's thread) and starts the killed one again."""

    def __init__(self, stack: Stack, cfg: dict):
        self.stack, self.cfg = stack, cfg
        self.procs: dict[str, Proc] = {}
        self.failovers: list[dict] = []
        self._threads: list[threading.Thread] = []

    def start(self, name: str) -> Proc:
        port = free_port()
        cfg = {**self.cfg, "control": {**self.cfg["control"], "metrics_port": port},
               "events": {**self.cfg["events"], "spool": {"dir": str(self.stack.tmp / f"{name}-spool")}}}
        path = write_yaml(self.stack.tmp / f"{name}.yaml", cfg)
        proc = self.procs[name] = self.stack.start(Proc(name, CLI + ["control", "--config", str(path)],
                                                        self.stack.tmp / f"{name}.log", port=port,
                                                        ready_url=f"http://127.0.0.1:{port}/healthz"))
        return proc

    def status(self, name: str) -> str:
        try:
            with urllib.request.urlopen(self.procs[name].url + "/readyz", timeout=2) as r:
                return json.loads(r.read()).get("status", "?")
        except OSError:
            return "down"

    def leader(self) -> str | None:
        return next((n for n in self.procs if self.status(n) == "leading"), None)

    def kill_leader(self, at_s: float) -> None:
        name = self.leader()
        if name is None:
            self.failovers.append({"at_s": round(at_s, 1), "killed": None, "takeover_s": None})
            return
        self.procs[name].kill()
        killed = time.monotonic()
        other = next(n for n in self.procs if n != name)
        record = {"at_s": round(at_s, 1), "killed": name, "takeover_s": None}
        self.failovers.append(record)

        def follow_up() -> None:
            deadline = killed + 60
            while time.monotonic() < deadline and self.status(other) != "leading":
                time.sleep(0.1)
            if self.status(other) == "leading":
                record["takeover_s"] = round(time.monotonic() - killed, 1)
            self.start(name)

        thread = threading.Thread(target=follow_up, daemon=True)
        thread.start()
        self._threads.append(thread)

    def settle(self) -> None:
        for thread in self._threads:
            thread.join(90)


class Load:
    """Mixed traffic at a fixed rate: plain, stream, JSON mode, tools; sessions; some feedback."""

    def __init__(self, url: str, rate: float, concurrency: int = 32):
        self.url, self.rate, self.concurrency = url, rate, concurrency
        self.calls: list[tuple[float, float, int, str]] = []  # (start, latency, status, kind)
        self.feedback = 0
        self.stop = threading.Event()
        self.rng = random.Random(5)

    def body(self, i: int) -> tuple[dict, str]:
        r = self.rng.random()
        body: dict = {"model": ROUTE, "messages": [{"role": "user", "content": f"soak question {i % 500}"}]}
        kind = "plain"
        if r < 0.25:
            body.update(stream=True, stream_options={"include_usage": True})
            kind = "stream"
        elif r < 0.4:
            body["response_format"] = {"type": "json_object"}
            kind = "json"
        elif r < 0.5:
            body.update(tools=TOOLS)
            kind = "tools"
        return body, kind

    async def run(self) -> None:
        sem = asyncio.Semaphore(self.concurrency)
        conn = aiohttp.TCPConnector(limit=self.concurrency)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as s:
            tasks: set[asyncio.Task] = set()
            i = 0
            t0 = time.monotonic()
            while not self.stop.is_set():
                await sem.acquire()
                task = asyncio.create_task(self.one(s, i, sem))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=40)

    async def one(self, s: aiohttp.ClientSession, i: int, sem: asyncio.Semaphore) -> None:
        body, kind = self.body(i)
        headers = {"x-session-id": f"s{i % 200}", "Authorization": "Bearer sk-soak"}
        started = time.monotonic()
        status = 0
        try:
            async with s.post(self.url + "/v1/chat/completions", json=body, headers=headers) as r:
                data = await r.read()
                status = r.status
                if status == 200 and kind == "stream" and b'"error"' in data:
                    status = 299  # a stream that ended with an error event
                rid = r.headers.get("x-request-id")
            if status == 200 and rid and i % 20 == 0:
                async with s.post(self.url + "/v1/feedback", json={"request_id": rid, "success": i % 40 == 0}) as fr:
                    if fr.status == 202:
                        self.feedback += 1
        except Exception:
            status = 0
        finally:
            self.calls.append((started, time.monotonic() - started, status, kind))
            sem.release()


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) in value units per minute."""
    n = len(points)
    if n < 3:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 60 * sum((t - mx) * (v - my) for t, v in points) / var if var else 0.0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def topic_ids(bootstrap: str, topic: str, key=lambda v: v.get("request_id")) -> tuple[int, int]:
    """(records, distinct keys) on a topic."""
    values = [m.value for m in read_messages(bootstrap, topic, timeout_s=30)]
    return len(values), len({key(v) for v in values})


def judged_counts(bootstrap: str, deadline: float) -> dict:
    """Outcomes, feedback and shadow evaluations counted in the latest report, once it stops changing."""
    last, counts, stable_for = None, {}, 0
    while time.monotonic() < deadline and stable_for < 3:
        reports = [m.value for m in read_messages(bootstrap, "soak.reports", timeout_s=30)
                   if m.value.get("route") == ROUTE]
        report = max(reports, key=lambda r: r.get("ts", 0))["report"] if reports else {}
        arms = report.get("live", {}).get("segments", {}).get("overall", {})
        counts = {"outcomes": sum(a.get("n", 0) for a in arms.values()),
                  "feedback": sum(a.get("task_success_rate", {}).get("n", 0) for a in arms.values()),
                  "evaluations": (report.get("judge") or {}).get("step_samples", 0)}
        stable_for = stable_for + 1 if counts == last else 0
        last = counts
        time.sleep(4)
    return counts


def duplicate_versions(bootstrap: str) -> dict:
    """Rollout states on the topic, and the (route, version) pairs published with two different states."""
    states = [m.value for m in read_messages(bootstrap, "soak.rollouts", timeout_s=30)]
    bodies: dict[tuple, set[str]] = {}
    for state in states:
        bodies.setdefault((state["route"], state["version"]), set()).add(json.dumps(state, sort_keys=True))
    return {"states": len(states), "versions": len(bodies), "epochs": sorted({s.get("epoch", 0) for s in states}),
            "twice": sorted(v for (_, v), b in bodies.items() if len(b) > 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=20.0, help="client requests per second")
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--kill-controller-every", type=float, default=120.0,
                    help="seconds between two SIGKILLs of the leading controller")
    args = ap.parse_args(argv)
    duration = args.minutes * 60

    with Stack("soak") as stack:
        sim_port = free_port()
        sim_cfg = write_yaml(stack.tmp / "sim.yaml", sim_config())
        stack.start(Proc("sim", CLI + ["simulate", "--config", str(sim_cfg), "--port", str(sim_port)],
                         stack.tmp / "sim.log", ready_url=f"http://127.0.0.1:{sim_port}/healthz", port=sim_port))
        up = FaultProxy("127.0.0.1", sim_port).start()
        stack.callback(up.stop)
        broker_port = free_port()
        bk = FaultProxy("127.0.0.1", broker_port).start()
        stack.callback(bk.stop)
        broker = ProxiedBroker(bk.port, port=broker_port, log_path=stack.tmp / "tansu.log")
        stack.callback(broker.stop)
        broker.start()

        cfg = stack_config(stack.tmp, up.url, bk.address)
        proxy_port, collect_port = free_port(), free_port()
        path = write_yaml(stack.tmp / "proxy.yaml", cfg)
        proxy = stack.start(Proc("proxy", CLI + ["serve", "--config", str(path), "--port", str(proxy_port)],
                                 stack.tmp / "proxy.log", ready_url=f"http://127.0.0.1:{proxy_port}/readyz",
                                 port=proxy_port))
        wcfg = {**cfg, "collect": {"concurrency": 16, "metrics_port": collect_port},
                "events": {**cfg["events"], "spool": {"dir": str(stack.tmp / "workers-spool")}}}
        wpath = write_yaml(stack.tmp / "workers.yaml", wcfg)
        collect = stack.start(Proc("collect", CLI + ["collect", "--config", str(wpath)], stack.tmp / "collect.log",
                                   ready_url=f"http://127.0.0.1:{collect_port}/healthz"))
        controllers = Controllers(stack, cfg)
        for name in ("control-a", "control-b"):
            controllers.start(name)
        deadline = time.monotonic() + 60
        while controllers.leader() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        procs = {"proxy": proxy, "collect": collect}

        load = Load(proxy.url, args.rate)
        loader = threading.Thread(target=lambda: asyncio.run(load.run()), daemon=True)
        t0 = time.monotonic()
        loader.start()
        samples: list[dict] = []
        windows: list[tuple[float, float, str]] = []  # (start, end, fault) relative to t0
        fault_i, next_fault, active = 0, args.fault_every, None
        next_kill = args.kill_controller_every
        print(f"soak: {args.minutes:g} min, {args.rate:g} req/s, a fault every {args.fault_every:g} s "
              f"(logs in {stack.tmp})", flush=True)
        next_sample = 0.0
        while (now := time.monotonic() - t0) < duration:
            if active is None and now >= next_fault:
                name, target, mode, kw, seconds = FAULTS[fault_i % len(FAULTS)]
                (up if target == "upstream" else bk).set_mode(mode, **kw)
                active = (name, target, now, now + seconds)
                fault_i += 1
                print(f"  {now:6.0f}s fault: {name} for {seconds} s", flush=True)
            elif active is not None and now >= active[3]:
                (up if active[1] == "upstream" else bk).set_mode("pass")
                windows.append((active[2], now, active[0]))
                active = None
                next_fault += args.fault_every
            if now >= next_kill:
                print(f"  {now:6.0f}s fault: SIGKILL of the leading controller ({controllers.leader()})", flush=True)
                controllers.kill_leader(now)
                next_kill += args.kill_controller_every
            if now >= next_sample:
                samples.append({"t": round(now, 1), "fault": active[0] if active else None, "load": loadavg(),
                                **{f"{n}_rss_mb": round(rss_bytes(p.pid) / 2**20, 1) for n, p in procs.items()},
                                **{f"{n}_fds": fds(p.pid) for n, p in procs.items()}})
                next_sample += SAMPLE_EVERY_S
            time.sleep(0.2)
        if active is not None:
            (up if active[1] == "upstream" else bk).set_mode("pass")
            windows.append((active[2], time.monotonic() - t0, active[0]))
        load.stop.set()
        loader.join(60)
        controllers.settle()
        print("  traffic stopped; waiting for the spool to drain and the workers to catch up", flush=True)

        # drain: the proxy's spool empties, then evaluations stop growing
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = scrape(proxy.url)
            if sum(metric_sum(text, "modelcanary_events_spooled", topic=t) for t in ("outcomes", "traffic")) == 0:
                break
            time.sleep(2)
        last, stable_for = -1, 0
        while time.monotonic() < deadline and stable_for < 3:
            n = topic_ids(broker.bootstrap, "soak.evaluations")[1]
            stable_for = stable_for + 1 if n == last else 0
            last = n
            time.sleep(3)
        judged = judged_counts(broker.bootstrap, deadline)
        text = scrape(proxy.url)
        end_samples = {f"{n}_rss_mb": round(rss_bytes(p.pid) / 2**20, 1) for n, p in procs.items()}

        # ---- numbers ---------------------------------------------------------------------------------
        statuses = Counter(st for _, _, st, _ in load.calls)
        causes = {}
        for family_line in text.splitlines():
            if family_line.startswith("modelcanary_failures_total{"):
                labels = dict(kv.split("=", 1) for kv in family_line[family_line.index("{") + 1:
                                                                     family_line.index("}")].split(","))
                cause = labels["cause"].strip('"')
                causes[cause] = causes.get(cause, 0) + float(family_line.rsplit(" ", 1)[1])
        requests = metric_sum(text, "modelcanary_requests_total")
        feedback = metric_sum(text, "modelcanary_feedback_total")
        events = {}
        for topic, key in (("outcomes", lambda v: (v.get("request_id"), v.get("kind"))),
                           ("traffic", lambda v: v.get("request_id"))):
            produced = (metric_sum(text, "modelcanary_events_published_total", topic=topic)
                        + metric_sum(text, "modelcanary_events_dropped_total", topic=topic)
                        + metric_sum(text, "modelcanary_events_spooled", topic=topic))
            records, distinct = topic_ids(broker.bootstrap, f"soak.{topic}", key)
            events[topic] = {"in": produced, "records_out": records, "distinct_out": distinct,
                             "dropped": metric_sum(text, "modelcanary_events_dropped_total", topic=topic)}
        events["outcomes"]["expected"] = requests + feedback
        ev_records, ev_distinct = topic_ids(broker.bootstrap, "soak.evaluations")
        events["evaluations"] = {"in": events["traffic"]["distinct_out"], "records_out": ev_records,
                                 "distinct_out": ev_distinct, "dropped": 0}
        outcomes = [m.value for m in read_messages(broker.bootstrap, "soak.outcomes", timeout_s=30)]
        on_topic = {"outcomes": len({o["request_id"] for o in outcomes if o.get("kind") == "request"}),
                    "feedback": len({(o["request_id"], o["ts"]) for o in outcomes if o.get("kind") == "feedback"}),
                    "evaluations": ev_distinct}
        decisions = duplicate_versions(broker.bootstrap)

        warm = [s for s in samples if s["t"] >= 60] or samples
        memory = {}
        for n in procs:
            pts = [(s["t"], s[f"{n}_rss_mb"]) for s in warm]
            memory[n] = {"start_mb": samples[0][f"{n}_rss_mb"], "end_mb": end_samples[f"{n}_rss_mb"],
                         "max_mb": max(s[f"{n}_rss_mb"] for s in samples),
                         "trend_mb_per_min": round(slope_per_min(pts), 3),
                         "fds_min": min(s[f"{n}_fds"] for s in samples), "fds_max": max(s[f"{n}_fds"] for s in samples),
                         "fds_end": samples[-1][f"{n}_fds"]}

        def in_window(t: float, kind: str | None) -> bool:
            hit = [w for w in windows if w[0] <= t < w[1]]
            return (not hit) if kind is None else any(kind in w[2] for w in hit)

        lat = {}
        for label, kind in (("no fault", None), ("broker fault", "broker"), ("upstream fault", "upstream")):
            ok = [d for s, d, st, _ in load.calls if st == 200 and in_window(s - t0, kind)]
            lat[label] = {"n": len(ok), "p50_ms": (pct(ok, 0.5) or 0) * 1000, "p99_ms": (pct(ok, 0.99) or 0) * 1000}

    result = {"minutes": args.minutes, "rate": args.rate, "fault_every_s": args.fault_every,
              "calls": len(load.calls), "client_statuses": dict(statuses), "feedback_sent": load.feedback,
              "failures_by_cause": causes, "events": events, "memory": memory, "latency": lat,
              "faults": [{"start_s": round(a, 1), "end_s": round(b, 1), "fault": n} for a, b, n in windows],
              "controller_failovers": controllers.failovers, "judged": judged, "on_topic": on_topic,
              "rollout_states": decisions,
              "samples": samples}
    path = write_result("soak", result)

    print()
    print(table(["cause", "count"], [[c, n] for c, n in sorted(causes.items(), key=lambda x: -x[1])]))
    print()
    print(table(["client status", "count"], [[str(k), v] for k, v in sorted(statuses.items())]))
    print()
    print(table(["process", "RSS start MB", "RSS end MB", "RSS max MB", "trend MB/min", "fds min", "fds max",
                 "fds end"], [[n, m["start_mb"], m["end_mb"], m["max_mb"], m["trend_mb_per_min"], m["fds_min"],
                              m["fds_max"], m["fds_end"]] for n, m in memory.items()]))
    print()
    print(table(["topic", "in (proxy)", "records out", "distinct out", "dropped"],
                [[t, e["in"], e["records_out"], e["distinct_out"], e["dropped"]] for t, e in events.items()]))
    print()
    print(table(["window", "ok calls", "p50 ms", "p99 ms"], [[k, v["n"], v["p50_ms"], v["p99_ms"]]
                                                            for k, v in lat.items()]))
    print()
    print(table(["judged by the controller", "on the topics", "in the last report"],
                [[k, on_topic[k], judged.get(k)] for k in ("outcomes", "feedback", "evaluations")]))
    print()
    print(table(["controller SIGKILL at s", "killed", "standby led after s"],
                [[f["at_s"], f["killed"], f["takeover_s"]] for f in controllers.failovers]))
    print(f"rollout states: {decisions['states']} published, {decisions['versions']} versions, "
          f"epochs {decisions['epochs']}, versions published twice: {decisions['twice']}")
    print(f"\n{len(load.calls)} calls; results in {path}")
    print(json.dumps({"rss_trend_mb_per_min": {n: m["trend_mb_per_min"] for n, m in memory.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
