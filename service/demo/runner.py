"""`modelcanary demo`: simulator + proxy (embedded mode) + mixed traffic + a live view of the rollout."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from service.demo import llama as llama_server
from service.rollout.segments import TERMINAL

CONFIGS = resources.files("service.demo") / "configs"  # package data: works from an installed wheel
ROUTE = "support-bot"
MAX_UNATTENDED_S = 180.0
TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Find an order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "issue_refund", "description": "Refund an order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
        "required": ["order_id", "amount"]}}},
]
TOPICS = ["my invoice", "a refund", "my password", "the delivery date", "an upgrade", "a duplicate charge"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the request mix: cumulative shares of tools, JSON, multi-turn and billing requests (the rest is chat)
ROUTE_MIX = (0.25, 0.40, 0.52, 0.60)
SEGMENT_MIX = (0.25, 0.55, 0.55, 0.55)  # tools, JSON and chat only: three segments, each with traffic enough


def _request(i: int, rng: random.Random, mix: tuple[float, ...] = ROUTE_MIX) -> tuple[dict, dict]:
    """One request of the mix: chat, multi-turn, JSON, tools, streaming, a billing task."""
    topic = rng.choice(TOPICS)
    headers = {"x-session-id": f"user-{rng.randrange(400)}"}
    body: dict = {"model": ROUTE, "messages": [{"role": "user", "content": f"Question {i}: help me with {topic}."}]}
    kind = rng.random()
    if kind < mix[0]:
        body["tools"] = TOOLS
    elif kind < mix[1]:
        body["response_format"] = {"type": "json_object"}
        body["messages"][0]["content"] += " Answer in JSON."
    elif kind < mix[2]:
        body["messages"] = [
            {"role": "user", "content": f"Conversation {i}: hello"}, {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": f"I need help with {topic}"}, {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "What should I do next?"}]
    elif kind < mix[3]:
        headers["x-task-type"] = "billing"
    if rng.random() < 0.2 and "tools" not in body:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body, headers


@dataclass
class Roll:
    phase: str = "shadow"
    weight: float = 0.0
    step: int = -1
    decision: str = "hold"
    reasons: list[str] = field(default_factory=list)
    history: list[str] = field(default_factory=list)
    version: int = -1
    segments: dict[str, dict] = field(default_factory=dict)  # rollout.scope segment: each segment's state
    candidates: list[str] = field(default_factory=list)


async def _traffic(url: str, stop: asyncio.Event, rate: float, sent: list[int], concurrency: int,
                   mix: tuple[float, ...] = ROUTE_MIX) -> None:
    rng = random.Random(7)
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(i: int) -> None:
            body, headers = _request(i, rng, mix)
            try:
                async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
            except (TimeoutError, aiohttp.ClientError):
                pass
            finally:
                sem.release()

        i = 0
        start = time.monotonic()
        while not stop.is_set():
            await sem.acquire()
            asyncio.get_running_loop().create_task(one(i))
            i += 1
            sent[0] = i
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        for _ in range(concurrency):  # the requests in flight finish before the session closes
            await sem.acquire()


def _scrape(text: str, stable: str) -> dict:  # noqa: C901 - one flat dispatch on metric names
    """The demo's numbers from /metrics; an evaluation is a candidate's shadow call (the `stable`
    model's are the noise floor, one per request whatever the candidates)."""
    by_role: dict = defaultdict(lambda: {"requests": 0.0, "completed": 0.0, "retries": 0.0, "buckets": {},
                                         "causes": defaultdict(float)})
    shadow = {"evaluated": 0.0, "agree": 0.0, "disagree": 0.0, "noise_agree": 0.0, "noise_disagree": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if labels.get("route") != ROUTE:
                continue
            role = labels.get("role")
            if s.name == "modelcanary_requests_total" and labels.get("segment") != "other":
                by_role[role]["requests"] += s.value
                if labels["outcome"] == "completed":
                    by_role[role]["completed"] += s.value
            elif s.name == "modelcanary_client_retries_total":
                by_role[role]["retries"] += s.value
            elif s.name == "modelcanary_failures_total":
                by_role[role]["causes"][labels["cause"]] += s.value
            elif s.name == "modelcanary_request_duration_seconds_bucket":
                le = float(labels["le"])
                by_role[role]["buckets"][le] = by_role[role]["buckets"].get(le, 0.0) + s.value
            elif s.name == "modelcanary_shadow_requests_total" and labels.get("model") != stable:
                shadow["evaluated"] += s.value
            elif s.name == "modelcanary_shadow_agreement_total":
                key = ("" if labels["comparison"] == "candidate" else "noise_") + labels["result"]
                shadow[key] += s.value
    return {"roles": by_role, "shadow": shadow}


def _quantile(buckets: dict[float, float], q: float) -> float | None:
    """histogram_quantile, as Prometheus does it: linear within the bucket."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return prev_bound
            span = buckets[b] - prev_count
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / span if span else 1.0)
        prev_bound, prev_count = b, buckets[b]
    return prev_bound


def _pct(x: float, n: float) -> str:
    return f"{100 * x / n:5.1f}%" if n else "    —"


def _ms(v: float | None) -> str:
    return f"{v * 1000:6.0f} ms" if v is not None else "      —"


def _view(stats: dict, roll: Roll, elapsed: float, sent: int) -> Group:
    table = Table(title=f"route {ROUTE} — live traffic by role", expand=False)
    for col in ("role", "requests", "completion", "retry rate", "p50", "p95", "failures by cause"):
        table.add_column(col, justify="right" if col not in ("role", "failures by cause") else "left")
    for role in ("stable", "canary"):
        r = stats["roles"].get(role)
        if not r or not r["requests"]:
            table.add_row(role, "0", "—", "—", "—", "—", "")
            continue
        causes = ", ".join(f"{c} {int(v)}" for c, v in sorted(r["causes"].items(), key=lambda kv: -kv[1]))
        table.add_row(role, f"{int(r['requests'])}", _pct(r["completed"], r["requests"]),
                      _pct(r["retries"], r["requests"]), _ms(_quantile(r["buckets"], 0.5)),
                      _ms(_quantile(r["buckets"], 0.95)), causes)
    sh = stats["shadow"]
    agree_n = sh["agree"] + sh["disagree"]
    noise_n = sh["noise_agree"] + sh["noise_disagree"]
    shadow_line = Text(f"shadow: {int(sh['evaluated'])} evaluated · candidate agrees with live answer "
                       f"{_pct(sh['agree'], agree_n).strip()} · stable agrees with itself (noise floor) "
                       f"{_pct(sh['noise_agree'], noise_n).strip()}")
    color = {"rolled_back": "red", "promoted": "green", "paused": "yellow"}.get(roll.phase, "cyan")
    phase_line = Text.assemble(("rollout: ", "bold"), (f"{roll.phase}", f"bold {color}"),
                               f" · candidate weight {roll.weight * 100:.0f}% · step {roll.step + 1} · "
                               f"judge: {roll.decision}")
    reasons = Text("\n".join(f"  ↳ {r}" for r in roll.reasons[:4]) or "  ↳ gathering evidence", style="dim")
    history = Text("\n".join(roll.history[-6:]), style="italic")
    footer = Text(f"{elapsed:5.0f} s · {sent} requests sent · Ctrl-C to stop", style="dim")
    return Group(table, shadow_line, phase_line, reasons, history, footer)


_UNLISTED = {"phase": "shadow", "step_index": -1}  # a segment not in the state yet is in shadow


async def _poll_rollout(session: aiohttp.ClientSession, url: str, token: str, roll: Roll, started: float) -> None:
    async with session.get(f"{url}/admin/rollouts/{ROUTE}", headers={"Authorization": f"Bearer {token}"}) as r:
        state = await r.json()
    observe(state, roll, time.monotonic() - started)


def observe(state: dict, roll: Roll, elapsed: float) -> None:
    """Take in one rollout state read at `elapsed` seconds: its phase changes go to the history."""
    decision = state.get("recommendation") or state.get("last_decision") or {}
    moved = state["phase"] != roll.phase or (state["step_index"] != roll.step and not state.get("segments"))
    if moved and roll.version >= 0 and state.get("segments"):  # each segment's steps are listed below
        roll.history.append(f"  {elapsed:5.0f} s  route {roll.phase} → {state['phase']}")
    elif moved and roll.version >= 0:
        roll.history.append(f"  {elapsed:5.0f} s  {roll.phase} → {state['phase']}"
                            f" ({state['canary_weight'] * 100:.0f}%): {(state.get('last_decision') or {}).get('reasons', [''])[0]}")
    for name, seg in (state.get("segments") or {}).items():
        was = roll.segments.get(name, _UNLISTED)  # first listed already decided: it moved out of shadow
        if (was["phase"], was["step_index"]) != (seg["phase"], seg["step_index"]):
            roll.history.append(f"  {elapsed:5.0f} s  segment {name}: {was['phase']} → "
                                f"{seg['phase']} ({seg['canary_weight'] * 100:.0f}%"
                                f"{', ' + seg['candidate'] if seg.get('candidate') else ''}): "
                                f"{(seg.get('last_decision') or {}).get('reasons', [''])[0]}")
        roll.segments[name] = seg
    roll.candidates = state.get("candidates") or []
    roll.phase, roll.weight, roll.step = state["phase"], state["canary_weight"], state["step_index"]
    roll.version = state["version"]
    roll.decision = decision.get("decision", "hold")
    roll.reasons = decision.get("reasons") or []
    if state["phase"] in TERMINAL:
        last = state.get("last_decision") or {}
        roll.decision, roll.reasons = last.get("decision", roll.decision), last.get("reasons") or roll.reasons


async def _run(url: str, token: str, duration: float | None, console: Console, pace: tuple[float, int],
               stable: str, mix: tuple[float, ...] = ROUTE_MIX) -> tuple[dict, Roll, float]:
    """Traffic at `pace` (requests a second, at most this many at once) of the `mix`, and the live view."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sent = [0]
    traffic = asyncio.create_task(_traffic(url, stop, rate=pace[0], sent=sent, concurrency=pace[1], mix=mix))
    roll = Roll()
    started = time.monotonic()
    terminal_at: float | None = None
    stats: dict = {"roles": {}, "shadow": defaultdict(float)}
    live = Live(console=console, refresh_per_second=4, transient=False) if console.is_terminal else None
    last_print = 0.0
    async with aiohttp.ClientSession() as session:
        if live:
            live.start()
        try:
            while not stop.is_set():
                await asyncio.sleep(0.5)
                elapsed = time.monotonic() - started
                async with session.get(url + "/metrics") as r:
                    stats = _scrape(await r.text(), stable)
                await _poll_rollout(session, url, token, roll, started)
                if live:
                    live.update(_view(stats, roll, elapsed, sent[0]))
                elif elapsed - last_print >= 5:
                    last_print = elapsed
                    print(f"[{elapsed:4.0f} s] sent={sent[0]} phase={roll.phase} weight={roll.weight:.2f} "
                          f"judge={roll.decision}", flush=True)
                if roll.phase in TERMINAL and terminal_at is None:
                    terminal_at = elapsed
                if _done(duration, elapsed, terminal_at):
                    break
        finally:
            stop.set()
            await traffic
            if live:
                live.stop()
    return stats, roll, time.monotonic() - started


def _done(duration: float | None, elapsed: float, terminal_at: float | None) -> bool:
    """After `duration` seconds; without one, soon after the rollout ended (or at the unattended cap)."""
    if duration is not None:
        return elapsed >= duration
    return (terminal_at is not None and elapsed - terminal_at >= 3) or elapsed >= MAX_UNATTENDED_S


def _summary(stats: dict, roll: Roll, elapsed: float, candidate: str) -> str:
    lines = [f"modelcanary demo — {elapsed:.0f} s of traffic, candidate: {candidate}", ""]
    lines.append(f"{'role':<8} {'requests':>8} {'completion':>10} {'retry':>7} {'p50':>9} {'p95':>9}  failures")
    for role in ("stable", "canary"):
        r = stats["roles"].get(role)
        if not r or not r["requests"]:
            continue
        causes = ", ".join(f"{c}={int(v)}" for c, v in sorted(r["causes"].items()))
        lines.append(f"{role:<8} {int(r['requests']):>8} {_pct(r['completed'], r['requests']):>10} "
                     f"{_pct(r['retries'], r['requests']):>7} {_ms(_quantile(r['buckets'], 0.5)):>9} "
                     f"{_ms(_quantile(r['buckets'], 0.95)):>9}  {causes}")
    sh = stats["shadow"]
    lines.append(f"shadow evaluations: {int(sh['evaluated'])}")
    lines.append("")
    lines.append("rollout history:")
    lines.extend(roll.history or ["  (no phase change)"])
    lines.append("")
    if roll.segments:
        lines += ["candidates, per segment:", *_standing(roll), ""]
    decision, reasons = roll.decision, roll.reasons
    kept = [seg for seg in roll.segments.values() if seg["phase"] == "rolled_back" and seg.get("last_decision")]
    if kept:  # rollout.scope segment: the evidence that kept a segment on stable, against a candidate
        promoted = {seg.get("candidate") for seg in roll.segments.values() if seg["phase"] == "promoted"}
        ruled_out = kept[0].get("rejected") or {}  # promoted elsewhere, if one is
        chosen = next((d for c, d in ruled_out.items() if c in promoted), kept[0]["last_decision"])
        decision, reasons = "rollback", chosen["reasons"]
    reason = (reasons[0] if reasons else "not enough evidence yet").replace("\n", " ")
    line = f"final: route={ROUTE} phase={roll.phase} decision={decision} reason={reason}"
    if roll.segments:
        line += " segments=" + ",".join(f"{name}:{seg['phase']}" for name, seg in sorted(roll.segments.items()))
    lines.append(line)
    return "\n".join(lines)


# (config file, good candidate, traffic: requests a second and at most this many at once)
SIMULATED = ("modelcanary.yaml", "better-m", (250.0, 64))
SEGMENTED = ("modelcanary-segments.yaml", None, (250.0, 64))  # the default: rollout.scope segment
REAL_MODEL = ("modelcanary-real.yaml", "smol-polite", (3.0, 2))  # one local model answers a few a second


def _standing(roll: Roll) -> list[str]:
    """Where each candidate ended up: promoted, canaried or ruled out, in which segments."""
    out = []
    for candidate in roll.candidates:
        where: dict[str, list[str]] = defaultdict(list)
        for name, seg in sorted(roll.segments.items()):
            if candidate in (seg.get("rejected") or {}):
                where["ruled out in"].append(name)
            elif seg.get("candidate") == candidate:
                where[f"{seg['phase']} in"].append(name)
        out.append(f"  {candidate}: " + ("; ".join(f"{k} {', '.join(v)}" for k, v in where.items()) or "in shadow"))
    return out


class DemoStack:
    """Simulator (or, with `real_model`, llama.cpp's server: service/demo/llama.py) + proxy (embedded
    shadow workers and controller) as subprocesses on free ports, from the configs shipped in
    service/demo/configs/."""

    def __init__(self, workdir: Path, good_candidate: bool, real_model: bool = False, route_scope: bool = False):
        self.workdir = workdir
        self.log_path = workdir / "services.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.procs: list[subprocess.Popen] = []
        self.llama: llama_server.LlamaProcess | None = None
        try:
            self._start(good_candidate, real_model, route_scope)
        except BaseException:  # a failure or an interrupt half-way: what started stops
            self.stop()
            raise

    def _start(self, good_candidate: bool, real_model: bool, route_scope: bool) -> None:
        workdir = self.workdir
        self.proxy_port = _free_port()
        chosen = REAL_MODEL if real_model else SIMULATED if route_scope or good_candidate else SEGMENTED
        config_file, good, self.pace = chosen
        self.mix = SEGMENT_MIX if chosen is SEGMENTED else ROUTE_MIX
        cfg = yaml.safe_load((CONFIGS / config_file).read_text())
        cli = [sys.executable, "-m", "modelcanary"]
        if real_model:
            missing = llama_server.missing_components()
            if missing:
                raise RuntimeError(f"the real model needs {', '.join(missing)}: run `make real-llm`")
            path = llama_server.smollm2_path()
            assert path is not None
            self.llama = llama_server.start(workdir / "llama", [llama_server.model_settings(path, llama_server.CHAT_ALIAS)])
            cfg["providers"]["llama"]["base_url"] = self.llama.base_url
            self.upstream = f"llama.cpp server :{self.llama.port} (SmolLM2-135M)"
        else:
            sim_port = _free_port()
            sim_cfg = workdir / "simulator.yaml"
            sim_cfg.write_text((CONFIGS / "simulator.yaml").read_text())
            cfg["providers"]["sim"]["base_url"] = f"http://127.0.0.1:{sim_port}/v1"
            self.procs.append(subprocess.Popen(cli + ["simulate", "--config", str(sim_cfg), "--port", str(sim_port)],
                                               stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir,
                                               start_new_session=True))
            self.upstream = f"simulator :{sim_port}"
        cfg["server"]["port"] = self.proxy_port
        cfg["state_dir"] = str(workdir / "state")
        cfg["events"]["spool"] = {"dir": str(workdir / "spool")}
        if good_candidate:
            cfg["routes"][ROUTE]["candidate"] = good
        self.stable = cfg["routes"][ROUTE]["stable"]
        self.candidate = ", ".join(cfg["routes"][ROUTE].get("candidates") or [cfg["routes"][ROUTE]["candidate"]])
        proxy_cfg = workdir / "modelcanary.yaml"
        proxy_cfg.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.token = secrets.token_hex(16)
        env = {**os.environ, "MODELCANARY_ADMIN_TOKEN": self.token}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.procs.append(subprocess.Popen(cli + ["serve", "--config", str(proxy_cfg), "--port", str(self.proxy_port)],
                                           stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                                           start_new_session=True))
        self.url = f"http://127.0.0.1:{self.proxy_port}"

    def ready(self, timeout_s: float = 30) -> bool:
        return _wait_ready(self.url + "/readyz", self.procs, timeout_s)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.llama is not None:
            self.llama.stop()
        self._log.close()


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the `finally` that stops the services runs


def run_demo(duration: float | None = None, good_candidate: bool = False, real_model: bool = False,
             route_scope: bool = False) -> int:
    signal.signal(signal.SIGTERM, _interrupted)  # also while the services start
    console = Console()
    try:
        stack = DemoStack(Path(tempfile.mkdtemp(prefix="modelcanary-demo-")), good_candidate, real_model, route_scope)
    except RuntimeError as e:  # the real model is not installed, or its server did not start
        console.print(f"[red]{e}[/red]")
        return 1
    try:
        if not stack.ready():
            console.print(f"[red]services did not start; see {stack.log_path}[/red]")
            return 1
        console.print(f"[bold]modelcanary demo[/bold]: proxy {stack.url}/v1 → {stack.upstream}; "
                      f"candidate {stack.candidate}; logs in {stack.workdir}")
        stats, roll, elapsed = asyncio.run(_run(stack.url, stack.token, duration, console, stack.pace, stack.stable,
                                                stack.mix))
        signal.signal(signal.SIGTERM, _interrupted)  # the loop's handler is gone: stopping still cleans up
        print(_summary(stats, roll, elapsed, stack.candidate), flush=True)
        return 0
    finally:
        stack.stop()


def _wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float) -> bool:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)
    return False
