"""How low added latency at concurrency 1 can go for a proxy in Python on this machine, beside
modelcanary and Portkey in the same run: what bounds the "≥ 5× less added p50 than Portkey" goal.

Two bare forwarders (this file, run with `--serve`) stand for the least any Python proxy does: uvloop
and httptools, one keep-alive upstream connection, the request's bytes forwarded and the answer's
sent back. `floor` forwards the body as it came; `floor+json` also parses it, rewrites `model` and
serializes it again, and parses the answer, the least a proxy that routes by `model` and judges the
answer does. Neither routes, classifies, records or measures anything.

    python benchmarks/python_floor.py [--quick] [--rounds N] [--no-portkey]

Added latency = a target's p50 − the direct p50 of the same rounds (wrk -t1 -c1, taking turns).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h
from benchmarks.proxy_overhead import PATH, TARGET_RATIO_PORTKEY, _start_portkey


def serve(upstream_port: int, port: int, parse: bool) -> None:
    """A bare forwarder on 127.0.0.1:port to the simulator on upstream_port, until killed."""
    import httptools
    import uvloop

    idle: list[Upstream] = []

    class Upstream(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpResponseParser(self)
            self.answer: asyncio.Future[bytes] | None = None
            self.body: list[bytes] = []

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            assert self.answer is not None
            self.answer.set_result(b"".join(self.body))
            self.body = []

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.body: list[bytes] = []

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            body, self.body = b"".join(self.body), []
            asyncio.get_running_loop().create_task(self.forward(body))

        async def forward(self, body: bytes) -> None:
            if parse:
                request = json.loads(body)
                request["model"] = "good-model"
                body = json.dumps(request, separators=(",", ":")).encode()
            loop = asyncio.get_running_loop()
            up = idle.pop() if idle else (await loop.create_connection(Upstream, "127.0.0.1", upstream_port))[1]
            up.answer = loop.create_future()
            up.transport.write(b"POST %s HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
                               b"content-length: %d\r\n\r\n%s" % (PATH.encode(), len(body), body))
            answer = await up.answer
            idle.append(up)
            if parse:
                json.loads(answer)
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(answer), answer))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


def forwarder(st: h.Stack, sim: h.Proc, name: str, parse: bool) -> h.Proc:
    port = h.free_port()
    args = [sys.executable, str(Path(__file__).resolve()), "--serve", str(sim.port), str(port)] + (["--parse"] if parse else [])
    proc = h.Proc(name, args, st.tmp / f"{name}.log", port=port)
    st.start(proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            h.check_ok(proc.url + PATH, h.DIRECT_BODY)
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.proc is None or proc.proc.poll() is not None:
                raise RuntimeError(f"{name} did not answer: {h.tail(proc.log)}") from None
            time.sleep(0.05)


def run(quick: bool = False, rounds: int = 8, with_portkey: bool = True) -> dict:
    per_run = 1.0 if quick else 2.0
    runs: dict[str, list[dict]] = {}
    with h.Stack("floor") as st:
        sim = h.simulator(st)
        targets: dict[str, tuple[h.Proc, dict, dict | None]] = {
            "direct": (sim, h.DIRECT_BODY, None),
            "floor": (forwarder(st, sim, "floor", parse=False), h.DIRECT_BODY, None),
            "floor+json": (forwarder(st, sim, "floor+json", parse=True), h.DIRECT_BODY, None),
            "modelcanary": (h.proxy(st, h.proxy_config(st.tmp, sim.url, shadow_rate=0.1)), h.CHAT_BODY, None)}
        pk, why = _start_portkey(st, sim) if with_portkey else (None, "Portkey not asked for (--no-portkey).")
        if pk is not None:
            targets["portkey"] = (pk, h.DIRECT_BODY, h.portkey_headers(sim.url))
        for name, (proc, body, headers) in targets.items():  # warm-up; Portkey's JIT needs thousands
            h.wrk(proc.url + PATH, body, 16, 20 if name == "portkey" and not quick else 3, tmp=st.tmp, headers=headers)
        for _ in range(rounds):
            for name, (proc, body, headers) in targets.items():
                runs.setdefault(name, []).append(h.wrk(proc.url + PATH, body, 1, per_run, tmp=st.tmp, headers=headers))
    p50 = {name: statistics.median(r["p50_ms"] for r in rs) for name, rs in runs.items()}
    added = {name: p50[name] - p50["direct"] for name in p50 if name != "direct"}
    budget = added["portkey"] / TARGET_RATIO_PORTKEY if "portkey" in added else None
    rows = [[name, p50[name], added.get(name), None if budget is None or name == "direct" else added[name] <= budget]
            for name in runs]
    md = ["### The Python floor at concurrency 1 (wrk -t1 -c1, "
          f"{rounds} rounds × {per_run:g} s per target, taking turns; medians)", "",
          h.table(["target", "p50 ms", "added p50 ms", f"within Portkey's ÷ {TARGET_RATIO_PORTKEY:g}"], rows, 3), ""]
    if budget is not None:
        md.append(f"{TARGET_RATIO_PORTKEY:g}× less added p50 than Portkey needs ≤ {budget:.3f} ms added; "
                  f"a bare Python forwarder adds {added['floor']:.3f} ms, one that parses the JSON "
                  f"{added['floor+json']:.3f} ms, modelcanary {added['modelcanary']:.3f} ms "
                  f"({added['portkey'] / added['modelcanary']:.1f}× less than Portkey).")
    else:
        md.append(why or "Portkey was not measured.")
    data = {"rounds": rounds, "per_run_s": per_run, "p50_ms": p50, "added_p50_ms": added,
            "budget_ms": budget, "runs": runs, "portkey_skipped_because": why}
    h.write_result("python_floor", data)
    return {"markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--no-portkey", action="store_true")
    p.add_argument("--serve", nargs=2, type=int, metavar=("UPSTREAM_PORT", "PORT"), help=argparse.SUPPRESS)
    p.add_argument("--parse", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve[0], args.serve[1], args.parse)
        return 0
    print(run(args.quick, max(1, args.rounds), not args.no_portkey)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
