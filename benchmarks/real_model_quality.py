"""Answer quality on a real model: an A/A and a degraded candidate, decided by the judge.

SmolLM2-135M-Instruct behind llama.cpp's server (tests/fixtures/llama_server.py), `modelcanary serve`
in memory mode in front of it, every request shadowed with the noise floor, the pairwise judge (the
same small model, constrained to the verdict schema) on `--judge-rate` of them. Requests are varied
questions a new user would ask, at temperature 0.7, so the model rephrases from call to call.

- A/A: the same weights as stable and candidate. Targets: the similarity gap's interval (the
  judge's anytime-valid one, overall) contains 0; the judge preference against its own noise
  floor contains 0; no rollback.
- degraded: the same weights with a system prompt that makes the answers worse (`--degrade`,
  default "answer in French"). Target: rolled back on `similarity_gap` or `judge_preference`,
  the reason naming the metric, while the completion rate stays equal.

Each run stops at `--requests` shadowed requests (or at the rollback). The route stays in shadow
(min_shadow_samples is out of reach), so every decision is the judge's on shadow evidence.

    python benchmarks/real_model_quality.py [--requests 200] [--judge-rate 0.25] [--only aa|degraded] [--quick]

A 135M model on 2 cores answers a few requests per second: a run of 200 takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as h  # noqa: E402
from collectors.evaluators.llm_judge import VERDICT_SCHEMA  # noqa: E402

ROUTE = "assistant"
TOKEN = "bench-real-model-token"
DEGRADE = "Always answer in French, whatever the language of the question."
MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What do bees make?",
    "How many legs does a spider have?", "What is water made of?", "Which planet is the largest?",
    "What language is spoken in Brazil?", "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?", "What is the tallest animal?", "How many days are in a week?",
    "What gas do plants take in?", "What is the opposite of hot?", "Which ocean is the biggest?",
    "What do you call a baby cat?", "How many continents are there?", "What is the color of the sky?",
    "What is 2 plus 2?", "Name a fruit that is yellow.", "Where do penguins live?",
    "What is the main ingredient of bread?", "What instrument has 88 keys?", "What is ice?",
    "Why do we need sleep?", "What is a noun?", "How do you say hello in Spanish?",
    "Give me a tip to save money.", "What is the sun?", "What is a computer?", "Suggest a name for a dog.",
    "What should I eat for breakfast?", "How can I learn to cook?", "What is the speed of light?",
    "What is a volcano?", "Explain what rain is.",
]


def proxy_config(tmp: Path, base_url: str, system_prompt: str | None, judge_rate: float) -> dict:
    candidate: dict = {"provider": "llama", "name": "smollm2"}
    if system_prompt:
        candidate["system_prompt"] = system_prompt
    return {
        "providers": {"llama": {"base_url": base_url, "timeout_s": 300, "max_retries": 0}},
        "models": {"stable-m": {"provider": "llama", "name": "smollm2"}, "candidate-m": candidate,
                   "judge-m": {"provider": "llama", "name": "smollm2",
                               "params": {"response_format": {"type": "json_object", "schema": VERDICT_SCHEMA}}}},
        "routes": {ROUTE: {"stable": "stable-m", "candidate": "candidate-m",
                           "shadow": {"sample_rate": 1.0, "max_per_minute": 100_000, "noise_floor": True,
                                      "stability": {"sample_rate": 0.0},
                                      "judge": {"model": "judge-m", "sample_rate": judge_rate}},
                           "rollout": {"min_shadow_samples": 1_000_000, "min_step_seconds": 0, "mode": "auto",
                                       "max_step_seconds": 86_400}}},
        "control": {"interval_s": 1.0, "report_interval_s": 2.0},
        "state_dir": str(tmp / "state"),
        "events": {"backend": "memory", "spool": {"dir": str(tmp / "spool")}},
    }


def admin(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def shadowed(url: str) -> float:
    return h.metric_sum(h.scrape(url), "modelcanary_shadow_requests_total", route=ROUTE)


def comparison(report: dict, metric: str, segment: str = "overall") -> dict | None:
    return next((c for c in (report.get("judge") or {}).get("comparisons", [])
                 if c["metric"] == metric and c["segment"] == segment), None)


def one_run(name: str, llama, requests: int, judge_rate: float, system_prompt: str | None) -> dict:
    import openai

    with h.Stack(f"real-{name}") as stack:
        cfg = proxy_config(stack.tmp, llama.base_url, system_prompt, judge_rate)
        proxy = h.proxy(stack, cfg, name=f"modelcanary-{name}", env={"MODELCANARY_ADMIN_TOKEN": TOKEN})
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-bench", max_retries=0, timeout=300)
        stop = threading.Event()
        sent = [0]

        def drive() -> None:
            i = 0
            while not stop.is_set() and sent[0] < requests:
                question = QUESTIONS[i % len(QUESTIONS)]
                i += 1
                try:
                    client.chat.completions.create(model=ROUTE, max_tokens=MAX_TOKENS, temperature=0.7,
                                                   messages=[{"role": "user", "content": question}])
                    sent[0] += 1
                except openai.APIError:
                    pass

        driver = threading.Thread(target=drive, daemon=True)
        started = time.monotonic()
        driver.start()
        state: dict = {}
        while True:
            time.sleep(5.0)
            state = admin(proxy.url, f"/admin/rollouts/{ROUTE}")
            done = shadowed(proxy.url)
            print(f"  {name}: {sent[0]} sent, {done:.0f} shadowed, phase {state['phase']}, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr)
            if state["phase"] == "rolled_back" or done >= requests:
                break
        stop.set()
        driver.join(300)
        time.sleep(5.0)  # the controller's last judgement and report
        state = admin(proxy.url, f"/admin/rollouts/{ROUTE}")
        report = admin(proxy.url, f"/admin/rollouts/{ROUTE}/report")["report"] or {}
    overall = ((report.get("shadow") or {}).get("segments") or {}).get("overall", {})
    decision = state.get("last_decision") or state.get("recommendation") or {}
    return {"run": name, "system_prompt": system_prompt, "sent": sent[0], "seconds": time.monotonic() - started,
            "phase": state["phase"], "decision": decision.get("decision"), "reasons": decision.get("reasons", []),
            "similarity_gap": comparison(report, "similarity_gap"),
            "judge_preference": comparison(report, "judge_preference"),
            "completion_rate": comparison(report, "completion_rate"),
            "quality": overall.get("quality"), "shadow_completion": overall.get("completion_rate")}


def contains_zero(c: dict | None) -> bool | None:
    return None if not c or not c.get("interval") else c["interval"][0] <= 0.0 <= c["interval"][1]


def run(requests: int, judge_rate: float, only: str | None) -> dict:
    from tests.fixtures.llama_server import missing_components, start_llama_server

    missing = missing_components()
    if missing:
        raise SystemExit("the real model is not installed (make real-llm): " + "; ".join(missing))
    runs = []
    with h.Stack("real-llama") as stack:
        llama = start_llama_server(stack.tmp / "llama")
        stack.callback(llama.stop)
        if only in (None, "degraded"):  # first: it ends at its rollback
            runs.append(one_run("degraded", llama, requests, judge_rate, DEGRADE))
        if only in (None, "aa"):
            runs.append(one_run("aa", llama, requests, judge_rate, None))
    checks = {}
    for r in runs:
        if r["run"] == "aa":
            checks["A/A: similarity_gap interval contains 0"] = contains_zero(r["similarity_gap"])
            checks["A/A: judge_preference interval contains 0"] = contains_zero(r["judge_preference"])
            checks["A/A: no rollback"] = r["phase"] != "rolled_back"
        else:
            named = any("similarity" in x or "judge preference" in x for x in r["reasons"])
            checks["degraded: rolled back, the reason names similarity_gap or judge_preference"] = \
                r["phase"] == "rolled_back" and named
            sc = r["shadow_completion"] or {}
            cand, stab = (sc.get("candidate") or {}).get("value"), (sc.get("stable") or {}).get("value")
            checks["degraded: completion rate equal (shadow, ±2 pts)"] = \
                None if cand is None or stab is None else abs(cand - stab) <= 0.02
    rows = []
    for r in runs:
        q = r["quality"] or {}
        sim = q.get("similarity", {})
        judge = q.get("judge", {})
        for metric in ("similarity_gap", "judge_preference"):
            c = r[metric] or {}
            rows.append([r["run"], metric, r["sent"], c.get("n"), c.get("stable"), c.get("candidate"), c.get("effect"),
                         f"{c['interval'][0]:.3f}…{c['interval'][1]:.3f}" if c.get("interval") else None,
                         c.get("verdict"), r["phase"]])
        r["summary"] = {"similarity_candidate": (sim.get("candidate_vs_stable") or {}).get("value"),
                        "similarity_noise_floor": (sim.get("noise_floor") or {}).get("value"),
                        "judge_candidate": {k: v for k, v in (judge.get("candidate") or {}).items() if k != "preference"},
                        "judge_noise_floor": {k: v for k, v in (judge.get("noise_floor") or {}).items()
                                              if k != "preference"}}
    md = ["### Answer quality on a real model (SmolLM2-135M, llama.cpp; A/A and degraded candidate)", "",
          h.table(["run", "comparison", "requests", "n", "stable side", "candidate side", "effect",
                   "anytime interval", "verdict", "phase"], rows, digits=3), ""]
    for r in runs:
        md.append(f"- {r['run']}: {r['decision']} after {r['seconds']:.0f} s; similarity candidate "
                  f"{h.fmt(r['summary']['similarity_candidate'], 3)} vs noise floor "
                  f"{h.fmt(r['summary']['similarity_noise_floor'], 3)}; judge candidate {r['summary']['judge_candidate']}, "
                  f"noise floor {r['summary']['judge_noise_floor']}; reasons: {'; '.join(r['reasons'][:2])}")
    md += ["", "Checks: " + "; ".join(f"{k}: {'met' if v else 'NOT met' if v is False else 'n/a'}"
                                       for k, v in checks.items())]
    data = {"requests": requests, "judge_rate": judge_rate, "degrade_prompt": DEGRADE, "runs": runs, "checks": checks}
    h.write_result("real_model_quality", data)
    return {"name": "real_model_quality", "markdown": "\n".join(md), "data": data}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--judge-rate", type=float, default=0.25)
    p.add_argument("--only", choices=("aa", "degraded"))
    p.add_argument("--quick", action="store_true", help="40 requests per run (a smoke test, not the targets)")
    args = p.parse_args(argv)
    print(run(40 if args.quick else args.requests, args.judge_rate, args.only)["markdown"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
