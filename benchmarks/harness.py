"""Shared plumbing for the benchmarks: start and stop the real processes (simulator, proxy,
LiteLLM, Portkey's gateway, the Tansu broker), drive them with wrk or hey, parse what those
print, read a process's CPU time and RSS from /proc, and write tables and JSON results.

Everything listens on 127.0.0.1 only; every load run is bounded in time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
LITELLM_VENV = Path(os.environ.get("LITELLM_VENV", BENCH / ".litellm-venv"))
LITELLM_VERSION = "1.108.7"
PORTKEY_DIR = Path(os.environ.get("PORTKEY_DIR", BENCH / ".portkey"))
PORTKEY_VERSION = "1.15.2"
PORTKEY_ENTRY = PORTKEY_DIR / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
CLI = [sys.executable, "-m", "modelcanary"]
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fixtures.servers import free_port, wait_http  # noqa: E402

CHAT_BODY = {"model": "support-bot", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
DIRECT_BODY = {**CHAT_BODY, "model": "good-model"}   # the same request, sent straight to the simulator


# ---- processes ------------------------------------------------------------------------------------

def tail(path: Path | None, n: int = 3000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-n:]


class Proc:
    """A subprocess in its own session, with a log file; `stop()` is idempotent."""

    def __init__(self, name: str, args: list[str], log: Path, env: dict | None = None,
                 ready_url: str | None = None, port: int | None = None, cwd: Path | None = None):
        self.name = name
        self.args = args
        self.log = log
        self.env = {**os.environ, **(env or {})}
        self.ready_url = ready_url
        self.port = port
        self.url = f"http://127.0.0.1:{port}" if port else None
        self.cwd = cwd or ROOT
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> Proc:
        self._fh = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._fh, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, stdin=subprocess.DEVNULL, start_new_session=True)
        if self.ready_url:
            try:
                wait_http(self.ready_url, timeout_s, self.proc, self.log)
            except Exception:
                self.stop()
                raise
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        self._fh.close()
        self.proc = None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            self.proc.wait(5)  # type: ignore[union-attr]

    def tree(self) -> list[int]:
        """This process and its descendants (uvicorn workers, say)."""
        return [self.pid, *descendants(self.pid)]

    def cpu_s(self) -> float:
        return sum(cpu_seconds(p) for p in self.tree())

    def rss_bytes(self) -> int:
        return sum(rss_bytes(p) for p in self.tree())


def loadavg() -> float:
    """The machine's 1-minute load average: above the core count, other work was competing."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return 0.0


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of one process (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except OSError:
        return 0


class Stack(ExitStack):
    """Stops every process it started, in reverse order, whatever happens."""

    def __init__(self, name: str, keep_logs: bool = False):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"mcbench-{name}-"))
        self.keep_logs = keep_logs or bool(os.environ.get("BENCH_KEEP_LOGS"))

    def start(self, proc: Proc, timeout_s: float = 60.0) -> Proc:
        self.callback(proc.stop)
        proc.start(timeout_s)
        return proc

    def __exit__(self, *exc) -> bool:
        try:
            return super().__exit__(*exc)
        finally:
            if not self.keep_logs and exc[0] is None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            elif exc[0] is not None:
                print(f"  (logs kept in {self.tmp})", file=sys.stderr)


# ---- configs --------------------------------------------------------------------------------------

def sim_model(output_tokens: int = 30) -> dict:
    return {"latency_s": {"median": 0.01, "p95": 0.02}, "ttft_s": {"median": 0.002, "p95": 0.004},
            "output_tokens": {"median": output_tokens, "p95": output_tokens}, "context_tokens": 128000,
            "divergence": 0.0, "failures": {}}


def sim_config(time_scale: float = 0.0, output_tokens: int = 30) -> dict:
    return {"seed": 42, "time_scale": time_scale,
            "models": {"good-model": sim_model(output_tokens), "new-model": sim_model(output_tokens)}}


def proxy_config(tmp: Path, sim_url: str, *, shadow_rate: float = 0.1, max_per_minute: int | None = None,
                 extra_upstreams: dict[str, str] | None = None, events: dict | None = None,
                 candidate: bool = True) -> dict:
    """modelcanary with everything on: metrics, outcome events, shadow sampling, memory bus.

    The route stays in its shadow phase (advisory judge), so live traffic all goes to the stable
    model and a run is the same from start to end; the controller still runs and judges.
    `extra_upstreams` adds a route per name, served by a provider at that base URL (no candidate).
    """
    shadow: dict = {"sample_rate": shadow_rate}
    if max_per_minute is not None:
        shadow["max_per_minute"] = max_per_minute
    cfg: dict = {
        "providers": {"sim": {"base_url": sim_url + "/v1", "timeout_s": 30, "connect_timeout_s": 5, "max_retries": 2}},
        "models": {
            "stable-m": {"provider": "sim", "name": "good-model", "price": {"input_per_mtok": 0.4, "output_per_mtok": 1.6}},
            "candidate-m": {"provider": "sim", "name": "new-model", "price": {"input_per_mtok": 0.2, "output_per_mtok": 0.8}},
        },
        "routes": {"support-bot": {"stable": "stable-m", "candidate": "candidate-m", "shadow": shadow,
                                   "rollout": {"mode": "advisory"}}},
        "state_dir": str(tmp / "state"),
        "events": copy.deepcopy(events) if events else {"backend": "memory"},
    }
    cfg["events"].setdefault("spool", {"dir": str(tmp / "spool")})
    if not candidate:  # no rollout: no shadow sampling, nothing for the judge to do
        cfg["routes"]["support-bot"] = {"stable": "stable-m"}
    for name, url in (extra_upstreams or {}).items():
        cfg["providers"][name] = {"base_url": url + "/v1", "timeout_s": 30, "connect_timeout_s": 5, "max_retries": 0}
        cfg["models"][name + "-m"] = {"provider": name, "name": name + "-model"}
        cfg["routes"][name] = {"stable": name + "-m"}
    return cfg


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def simulator(stack: Stack, config: dict | None = None, name: str = "sim") -> Proc:
    port = free_port()
    cfg = write_yaml(stack.tmp / f"{name}.yaml", config or sim_config())
    return stack.start(Proc(name, CLI + ["simulate", "--config", str(cfg), "--port", str(port)],
                            stack.tmp / f"{name}.log", ready_url=f"http://127.0.0.1:{port}/healthz", port=port))


def proxy(stack: Stack, config: dict, name: str = "modelcanary", workers: int = 1, env: dict | None = None,
          tree: Path | None = None) -> Proc:
    """`modelcanary serve`. With `tree`, from that source tree (`git archive <commit> | tar -x -C DIR`),
    with this venv's python: cwd and PYTHONPATH are the tree, so its own code is imported; as
    `python -m modelcanary` if the tree has it, else `python -m service.cli` (its entry point before)."""
    port = free_port()
    cfg = write_yaml(stack.tmp / f"{name}.yaml", config)
    cli = CLI
    if tree is not None:
        if not (tree / "modelcanary" / "__main__.py").exists():
            cli = [sys.executable, "-m", "service.cli"]
        env = {**(env or {}), "PYTHONPATH": str(tree)}
    args = cli + ["serve", "--config", str(cfg), "--port", str(port)]
    if workers > 1:
        args += ["--workers", str(workers)]
    return stack.start(Proc(name, args, stack.tmp / f"{name}.log", env=env,
                            ready_url=f"http://127.0.0.1:{port}/readyz", port=port, cwd=tree))


BASELINE = "modelcanary@baseline"
BASELINE_TOLERANCE = 0.05   # a same-run check passes within 5% of the baseline tree


def baseline_proxy(stack: Stack, sim_url: str, tree: Path) -> Proc:
    """modelcanary@baseline: the benchmarks' proxy config, run from `tree`, with its own state and spool."""
    (stack.tmp / "baseline").mkdir()
    return proxy(stack, proxy_config(stack.tmp / "baseline", sim_url, shadow_rate=0.1), name=BASELINE, tree=tree)


def within_baseline(current: float | None, baseline: float | None, higher_is_better: bool = False) -> bool:
    """Within BASELINE_TOLERANCE: latency ≤ 1.05× the baseline's, a rate ≥ 0.95× it."""
    if current is None or baseline is None:
        return False
    if higher_is_better:
        return current >= (1 - BASELINE_TOLERANCE) * baseline
    return current <= (1 + BASELINE_TOLERANCE) * baseline


def tree_label(tree: Path) -> str:
    """A source tree's commit, from its `COMMIT` file if it has one, else the directory's name."""
    f = tree / "COMMIT"
    return f.read_text().strip() if f.exists() else tree.name


def vs_name(benchmark: str, label: str) -> str:
    """The result file's name for a run against a baseline tree: one file per baseline, so a check
    against a newer commit leaves the older ones (cited in the READMEs) alone."""
    return f"{benchmark}_vs_{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}"


def litellm_available() -> str | None:
    """None when the pinned LiteLLM is installed, else why not."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        return f"LiteLLM is not installed: run `bash benchmarks/litellm/setup.sh` (creates {LITELLM_VENV})"
    return None


def ensure_litellm() -> str | None:
    """Install the pinned LiteLLM into its own venv if missing. None on success, else the reason."""
    if litellm_available() is None:
        return None
    if os.environ.get("BENCH_NO_LITELLM_INSTALL"):
        return litellm_available()
    print(f"  installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} (once) ...", file=sys.stderr)
    r = subprocess.run(["bash", str(BENCH / "litellm" / "setup.sh")], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return "LiteLLM install failed: " + (r.stderr or r.stdout)[-500:]
    return litellm_available()


def litellm(stack: Stack, upstreams: dict[str, str], name: str = "litellm") -> Proc:
    """The LiteLLM proxy, one worker, offline flags from DESIGN §10. `upstreams`: model_name → base URL;
    model_name `support-bot` is served by the simulator's good-model, others by `<name>-model`."""
    template = (BENCH / "litellm" / "config.template.yaml").read_text()
    head, _, rest = template.partition("# --- model entry ---")
    entry, _, settings = rest.partition("# --- end model entry ---")
    entries = []
    for model_name, url in upstreams.items():
        upstream_model = "good-model" if model_name == "support-bot" else model_name + "-model"
        entries.append(entry.strip("\n").replace("${MODEL_NAME}", model_name)
                       .replace("${UPSTREAM_MODEL}", upstream_model).replace("${API_BASE}", url + "/v1"))
    cfg = stack.tmp / f"{name}.yaml"
    cfg.write_text(head + "\n".join(entries) + "\n" + settings)
    port = free_port()
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
           "LITELLM_LOG": "ERROR", "NO_DOCS": "True", "DISABLE_ADMIN_UI": "True"}
    for k in ("DATABASE_URL", "LITELLM_MASTER_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
        env[k] = ""
    proc = Proc(name, [str(LITELLM_VENV / "bin" / "litellm"), "--config", str(cfg), "--port", str(port),
                       "--host", "127.0.0.1", "--num_workers", "1"],
                stack.tmp / f"{name}.log", env=env, ready_url=f"http://127.0.0.1:{port}/health/liveliness", port=port)
    proc.env = {k: v for k, v in proc.env.items() if v != ""}
    return stack.start(proc, timeout_s=180)


def portkey_available() -> str | None:
    """None when the pinned Portkey gateway is installed and Node is there, else why not."""
    if shutil.which("node") is None:
        return "Portkey's gateway needs Node >= 18, and `node` is not on PATH"
    if not PORTKEY_ENTRY.exists() or not (PORTKEY_DIR / f".installed-{PORTKEY_VERSION}").exists():
        return (f"Portkey's gateway {PORTKEY_VERSION} is not installed: run `bash benchmarks/portkey/setup.sh` "
                f"(creates {PORTKEY_DIR})")
    return None


def ensure_portkey() -> str | None:
    """Install the pinned Portkey gateway (npm) if missing. None on success, else the reason."""
    if portkey_available() is None:
        return None
    if os.environ.get("BENCH_NO_PORTKEY_INSTALL") or shutil.which("node") is None:
        return portkey_available()
    print(f"  installing @portkey-ai/gateway@{PORTKEY_VERSION} into {PORTKEY_DIR} (once) ...", file=sys.stderr)
    try:
        r = subprocess.run(["bash", str(BENCH / "portkey" / "setup.sh")], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "Portkey install (npm ci) did not finish in 900 s"
    if r.returncode != 0:
        return "Portkey install failed: " + (r.stderr or r.stdout)[-500:]
    return portkey_available()


def portkey_headers(upstream_url: str) -> dict[str, str]:
    """What each request to Portkey carries to reach `upstream_url` as an OpenAI-compatible provider."""
    return {"x-portkey-provider": "openai", "x-portkey-custom-host": upstream_url + "/v1"}


def portkey(stack: Stack, name: str = "portkey") -> Proc:
    """Portkey's open-source gateway (Node, one process), `--headless` (no web UI and no request-log
    middleware, as it is run in production). It has a `--port=N` flag but no host flag; the preload
    `benchmarks/portkey/loopback.cjs` binds it to 127.0.0.1. The upstream is chosen per request by
    the headers of `portkey_headers`."""
    port = free_port()
    proc = Proc(name, ["node", "--require", str(BENCH / "portkey" / "loopback.cjs"), str(PORTKEY_ENTRY),
                       f"--port={port}", "--headless"],
                stack.tmp / f"{name}.log", ready_url=f"http://127.0.0.1:{port}/", port=port, cwd=PORTKEY_DIR)
    return stack.start(proc, timeout_s=60)


def broker(stack: Stack):
    from tests.fixtures.broker import TansuBroker

    b = TansuBroker(log_path=stack.tmp / "tansu.log")
    stack.callback(b.stop)
    return b.start()


# ---- load generators ------------------------------------------------------------------------------

WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = [==[%s]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
%s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\\"requests\\":%%d,\\"duration_us\\":%%d,\\"p50\\":%%d,\\"p90\\":%%d,\\"p99\\":%%d,\\"p999\\":%%d," ..
    "\\"mean\\":%%.1f,\\"max\\":%%d,\\"connect\\":%%d,\\"read\\":%%d,\\"write\\":%%d,\\"status\\":%%d,\\"timeout\\":%%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.mean, latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def wrk(url: str, body: dict | bytes, concurrency: int, duration_s: float, threads: int = 1,
        timeout_s: float = 5.0, tmp: Path | None = None, headers: dict[str, str] | None = None) -> dict:
    """Closed-loop load with wrk. Latencies in milliseconds; `errors` counts non-2xx and socket errors.
    `headers` are sent with every request, besides Content-Type and Authorization."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    script = Path(tempfile.mkstemp(suffix=".lua", dir=tmp)[1])
    extra = "\n".join(f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in (headers or {}).items())
    script.write_text(WRK_SCRIPT % (raw.decode(), extra))
    try:
        args = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, round(duration_s))}s",
                f"--timeout={timeout_s:.0f}s", "-s", str(script), url]
        r = subprocess.run(args, capture_output=True, text=True, timeout=duration_s + 60)
    finally:
        script.unlink(missing_ok=True)
    m = re.search(r"^WRKJSON (.*)$", r.stdout, re.M)
    if not m:
        raise RuntimeError(f"wrk printed no result (exit {r.returncode}): {r.stdout[-1000:]} {r.stderr[-1000:]}")
    d = json.loads(m.group(1))
    seconds = d["duration_us"] / 1e6
    errors = d["connect"] + d["read"] + d["write"] + d["status"] + d["timeout"]
    return {"tool": "wrk", "concurrency": concurrency, "duration_s": round(seconds, 2), "requests": d["requests"],
            "rps": round(d["requests"] / seconds, 1), "errors": errors,
            "p50_ms": d["p50"] / 1000, "p90_ms": d["p90"] / 1000, "p99_ms": d["p99"] / 1000,
            "p999_ms": d["p999"] / 1000, "mean_ms": round(d["mean"] / 1000, 4), "max_ms": d["max"] / 1000}


def hey(url: str, body: dict | bytes, concurrency: int, duration_s: float | None = None,
        requests: int | None = None, headers: dict[str, str] | None = None) -> dict:
    """Closed-loop load with hey (the alternative to wrk). Latencies in milliseconds."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    args = ["hey", "-c", str(concurrency), "-m", "POST", "-T", "application/json", "-d", raw.decode()]
    for k, v in (headers or {}).items():
        args += ["-H", f"{k}: {v}"]
    args += ["-z", f"{max(1, round(duration_s))}s"] if duration_s else ["-n", str(requests or 1000)]
    r = subprocess.run(args + [url], capture_output=True, text=True, timeout=(duration_s or 60) + 60)
    return parse_hey(r.stdout, concurrency)


def parse_hey(out: str, concurrency: int = 0) -> dict:
    def num(pattern: str) -> float | None:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else None

    pct = {int(p): float(v) * 1000 for p, v in re.findall(r"^\s+(\d+)%% in ([\d.]+) secs".replace("%%", "%"), out, re.M)}
    codes = {int(c): int(n) for c, n in re.findall(r"\[(\d+)\]\s+(\d+) responses", out)}
    ok = sum(n for c, n in codes.items() if 200 <= c < 300)
    total = sum(codes.values())
    return {"tool": "hey", "concurrency": concurrency, "requests": total, "rps": num(r"Requests/sec:\s+([\d.]+)"),
            "errors": total - ok, "p50_ms": pct.get(50), "p90_ms": pct.get(90), "p99_ms": pct.get(99),
            "mean_ms": (num(r"Average:\s+([\d.]+) secs") or 0) * 1000}


def loadgen(url: str, body: dict | bytes, *, rate: float | None = None, duration_s: float = 10.0,
            concurrency: int = 16, requests: int = 10000, vary: bool = False, connections: int = 32,
            timeout_s: float = 600.0, headers: dict[str, str] | None = None) -> dict:
    """benchmarks/loadgen.py in its own process: open loop at `rate` req/s for `duration_s`, or closed
    loop with `concurrency` connections until `requests` answers. Latencies in milliseconds."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    args = [sys.executable, str(BENCH / "loadgen.py"), url, "--body", raw.decode()]
    if rate:
        args += ["--rate", str(rate), "--duration", str(duration_s), "--connections", str(connections)]
        limit = duration_s + 60
    else:
        args += ["--concurrency", str(concurrency), "--requests", str(requests), "--timeout", str(timeout_s)]
        limit = timeout_s + 30
    if vary:
        args.append("--vary")
    for k, v in (headers or {}).items():
        args += ["--header", f"{k}: {v}"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=limit)
    if r.returncode != 0:
        raise RuntimeError(f"loadgen failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def post(url: str, body: dict, headers: dict | None = None, timeout_s: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk-bench",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check_ok(url: str, body: dict | None = None, headers: dict | None = None) -> None:
    status, data = post(url, body or CHAT_BODY, headers)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {data[:500]!r}")


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        return r.read().decode()


def metric_sum(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# ---- output ---------------------------------------------------------------------------------------

def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "kernel": platform.release(), "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * PAGE / 2**30, 1)}


def fmt(v: object, digits: int = 2) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(headers: list[str], rows: list[list[object]], digits: int = 2) -> str:
    cells = [[fmt(c, digits) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def cli(run, description: str, argv: list[str] | None = None, litellm: bool = False) -> int:
    """A benchmark's own command line: `--quick` (and `--no-litellm` for the side-by-side ones)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true")
    if litellm:
        p.add_argument("--no-litellm", action="store_true")
    args = p.parse_args(argv)
    result = run(args.quick, not args.no_litellm) if litellm else run(args.quick)
    print(result["markdown"])
    return 0
