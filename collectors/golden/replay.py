"""`modelcanary replay`: run a golden set against a candidate offline, judged like a shadow rollout.

Each case becomes the TrafficEvent it came from, and the shadow worker's own machinery handles
it (collectors.worker.ShadowWorker.handle): the candidate is asked, and the stable model again
(the noise floor), through the config's providers, retry rules and `shadow.max_usd_per_hour`,
with at most `collect.concurrency` cases at once; each answer is classified by the proxy's code;
the evaluators run (similarity, the pairwise judge when the route has one, stability on every
case with `--repeats k`, and the case's own checks, checks.py). The resulting EvaluationRecords
go through the live judge's evidence and comparisons (service.judge) with a fixed-horizon
boundary (the sample is fixed: one look), against the route's `rollout.margins`.

Offline, the stable reference for latency, cost and stability is the stable model asked now (its
second answer, and k fresh answers for stability), not what was recorded live at another time and
load; the live answer stays the reference for similarity and the judge.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from collectors.evaluators import default_evaluators
from collectors.evaluators.base import ShadowCall
from collectors.golden.checks import CaseChecksEvaluator
from collectors.golden.dataset import Case
from collectors.spend import OverBudget
from collectors.worker import ShadowClient, ShadowWorker
from service import __version__
from service.bus.memory import MemoryBus
from service.config import Config, RouteConfig
from service.judge.catalog import SHADOW_CANDIDATE, MetricSpec, comparisons_budget, route_segments
from service.judge.comparisons import FixedBoundary, PairedMeanTest, compare
from service.judge.decide import Comparison, evaluate
from service.judge.evidence import RouteEvidence
from service.judge.shadow_report import ShadowStats
from service.records import CandidateResult, EvaluationRecord, PrimaryResult, RolloutState, TrafficEvent
from service.upstream import make_providers
from service.upstream.model_settings import settings_record

BOUNDARY = FixedBoundary()
CHECKS_TEST = PairedMeanTest()
Progress = Callable[[str, int, int], None]   # (step, cases done, cases)
WINDOW_PER_SLOT = 8   # cases answered, then evaluated, together: this many per unit of `collect.concurrency`


class ReplayInputError(Exception):
    """A replay that can't start: a bad flag or a dataset that doesn't fit the config (exit 2)."""


@dataclass
class RouteRun:
    route: str
    rc: RouteConfig                       # the route as replayed: candidate and stable set, noise floor on
    records: list[EvaluationRecord] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    alpha_each: float = 0.0
    budget: int = 0
    skipped: Counter = field(default_factory=Counter)   # reason -> cases not evaluated

    @property
    def stable(self) -> str:
        return self.rc.stable

    @property
    def candidate(self) -> str:
        assert self.rc.candidate is not None
        return self.rc.candidate


class RecordingClient(ShadowClient):
    """The worker's client, also noting which model version answered each call and what it cost.

    `prefetch` asks the candidate and the stable model a case's request ahead of its evaluation;
    the worker's first call to each of them for that request (the same object: `event.request`)
    then gets that answer. So the calls whose latencies are compared run while the loop does
    nothing else, and their latencies are the models' (collectors.worker.LoopLag)."""

    def __init__(self, config: Config, providers: dict):
        super().__init__(config, providers)
        self.served: dict[str, set[str]] = {}
        self.cost_usd: dict[str, float] = {}
        self.calls: Counter = Counter()
        self._fetched: dict[tuple[int, str], list[ShadowCall]] = {}  # (id of a request, model key) -> answers

    async def prefetch(self, event: TrafficEvent, candidate: str, stable: str) -> None:
        """The candidate's and the stable model's answers to the event's request, as the worker asks
        for them (ShadowWorker._evaluate), kept for its calls. A call over budget is left to the worker."""
        async def fetch(key: str, share: str | None) -> None:
            try:
                answer = await self.call(event.route, key, event.request, share=share, client_headers=event.headers)
            except OverBudget:
                return
            self._fetched.setdefault((id(event.request), key), []).append(answer)

        await asyncio.gather(fetch(candidate, candidate), fetch(stable, None))

    def forget(self, event: TrafficEvent) -> None:
        """Drop what the worker did not ask for of the event's request."""
        for key in [k for k in self._fetched if k[0] == id(event.request)]:
            del self._fetched[key]

    async def call(self, route: str, model_key: str, *args, **kwargs) -> ShadowCall:
        body = args[0] if args else kwargs.get("body")
        if fetched := self._fetched.get((id(body), model_key)):
            return fetched.pop()
        result = await super().call(route, model_key, *args, **kwargs)
        self.calls[model_key] += 1
        self.cost_usd[model_key] = self.cost_usd.get(model_key, 0.0) + result.cost_usd
        served = (result.response or {}).get("model")
        if isinstance(served, str):
            self.served.setdefault(model_key, set()).add(served)
        return result


@dataclass(frozen=True)
class Unanswered:
    """A side of a route's replay that answered no case: nothing of it can be compared."""
    role: str            # "candidate" | "stable"
    model: str
    cause: str           # the most frequent cause of its failed calls
    n_cause: int
    n_calls: int


def _answered(result: CandidateResult) -> bool:
    """The model answered, well or badly (its own failures are the judge's to compare)."""
    return result.outcome == "completed" or result.blame == "model"


def unanswered(rr: RouteRun) -> list[Unanswered]:
    """The candidate and the stable model (asked again) when not one of their calls got an answer."""
    sides = (("candidate", rr.candidate, [r.candidate for r in rr.records]),
             ("stable", rr.stable, [r.stable_again for r in rr.records if r.stable_again is not None]))
    out = []
    for role, model, results in sides:
        if results and not any(_answered(x) for x in results):
            cause, n = Counter(x.cause or "unknown" for x in results).most_common(1)[0]
            out.append(Unanswered(role, model, cause, n, len(results)))
    return out


@dataclass(frozen=True)
class LatencyEvidence:
    """What a route's latency comparison rests on: the cases with both latencies (candidate and stable
    asked again, both completed), and per side the completed calls and those whose latency was
    discarded (measured while the loop was late: collectors.worker.LoopLag)."""
    pairs: int
    completed: dict[str, int]
    discarded: dict[str, int]

    def as_dict(self) -> dict:
        return {"pairs": self.pairs, "completed": self.completed, "discarded": self.discarded}


def latency_evidence(rr: RouteRun) -> LatencyEvidence:
    completed = {"candidate": 0, "stable": 0}
    discarded = {"candidate": 0, "stable": 0}
    for r in rr.records:
        for side, x in (("candidate", r.candidate), ("stable", r.stable_again)):
            if x is not None and x.outcome == "completed":
                completed[side] += 1
                discarded[side] += x.latency_s is None
    pairs = sum(1 for r in rr.records if r.candidate.outcome == "completed" and r.candidate.latency_s is not None
                and r.stable_latency_s is not None)   # as the judge pairs them (service.judge.evidence)
    return LatencyEvidence(pairs, completed, discarded)


def replay_config(config: Config, routes: set[str], candidate: str, stable: str | None,
                  repeats: int | None) -> Config:
    """The config as replayed: each route's candidate and stable set, the noise floor on, every
    case evaluated (sample_rate 1), and stability with k = repeats on every case when given."""
    if candidate not in config.models:
        raise ReplayInputError(f"--candidate: {candidate!r} is not a model of the config; models: "
                               f"{', '.join(sorted(config.models))}")
    if stable is not None and stable not in config.models:
        raise ReplayInputError(f"--stable: {stable!r} is not a model of the config; models: "
                               f"{', '.join(sorted(config.models))}")
    if repeats is not None and not 1 <= repeats <= 10:
        raise ReplayInputError(f"--repeats: must be 1 (no stability) to 10, got {repeats}")
    out = {}
    for route in routes:
        rc = config.routes[route]
        stability = rc.shadow.stability
        if repeats is not None:
            stability = stability.model_copy(update={"sample_rate": 1.0 if repeats >= 2 else 0.0,
                                                     "k": max(repeats, 2)})
        shadow = rc.shadow.model_copy(update={"noise_floor": True, "sample_rate": 1.0, "stability": stability})
        out[route] = rc.model_copy(update={"candidate": candidate, "candidates": [candidate], "stable": stable or rc.stable,
                                           "shadow": shadow})
    return config.model_copy(update={"routes": {**config.routes, **out}})


def check_cases(cases: list[Case], config: Config) -> None:
    """Every case on a route of the config, in one of its segments (a case in none would count in no
    segment's verdict)."""
    unknown = sorted({c.route for c in cases} - set(config.routes))
    if unknown:
        first = next(i for i, c in enumerate(cases, start=1) if c.route in unknown)
        raise ReplayInputError(f"case {first}: route: {unknown[0]!r} is not a route of the config; routes: "
                               f"{', '.join(sorted(config.routes))}")
    for i, case in enumerate(cases, start=1):
        known = [s for s in route_segments(config.routes[case.route]) if s != "overall"]
        if case.segment not in known:
            raise ReplayInputError(f"case {i}: segment: {case.segment!r} is not a segment of route {case.route!r}; "
                                   f"its segments: {', '.join(known)}")


def servable(cases: list[Case], config: Config, candidate: str, stable: str | None,
             routes: list[str] | None) -> tuple[list[Case], dict[str, str]]:
    """The cases to replay and the routes left out, with why: with `routes` (--route) those routes'
    cases, each of which the candidate must be able to serve; else every route's whose stable model
    speaks the candidate's API (a route on another API is left out, not an error)."""
    if routes is not None:
        if unknown := sorted(set(routes) - set(config.routes)):
            raise ReplayInputError(f"--route: {unknown[0]!r} is not a route of the config; routes: "
                                   f"{', '.join(sorted(config.routes))}")
        cases = [c for c in cases if c.route in routes]
        if not cases:
            raise ReplayInputError(f"--route: the dataset has no case on {', '.join(map(repr, routes))}")
    check_cases(cases, config)
    left_out: dict[str, str] = {}
    for route in sorted({c.route for c in cases}):
        stable_key = stable or config.routes[route].stable
        if {stable_key, candidate} <= config.models.keys() and (why := config.mixed_apis(stable_key, candidate)):
            if routes is not None:
                raise ReplayInputError(f"--candidate: route {route!r}: {why}")
            left_out[route] = why
    kept = [c for c in cases if c.route not in left_out]
    if not kept:
        raise ReplayInputError("--candidate: no route of the dataset can be replayed against it: "
                               + "; ".join(f"route {r!r}: {why}" for r, why in left_out.items()))
    return kept, left_out


def _event(case: Case, stable: str, config_version: str) -> TrafficEvent:
    live = case.live
    primary = PrimaryResult(model=stable, status=live.status if live else 200, body=live.body if live else None,
                            latency_s=live.latency_s if live else 0.0, ttft_s=live.ttft_s if live else None,
                            usage=live.usage if live else None, outcome="completed")
    return TrafficEvent(request_id=case.request_id, ts=time.time(), route=case.route, segment=case.segment,
                        request=case.request, primary=primary, config_version=case.config_version or config_version,
                        headers=case.headers)


def _fresh_reference(record: EvaluationRecord) -> None:
    """Latency and cost of the stable side: its answer now (see the module doc)."""
    again = record.stable_again
    done = again is not None and again.outcome == "completed"
    record.stable_latency_s = again.latency_s if done and again is not None else None
    record.stable_cost_usd = again.cost_usd if done and again is not None else None


async def run(cases: list[Case], config: Config, candidate: str, stable: str | None, repeats: int | None,
              progress: Progress) -> tuple[dict[str, RouteRun], RecordingClient]:
    """Replay every case (of those `servable` kept) window by window, each in two steps: its cases'
    candidate and stable calls (`progress("answered", done, total)`), then their evaluations
    (`"evaluated"`). The evaluations' work on the loop would otherwise delay the calls still in
    flight, and their latencies would be discarded. Only a window's answers are held at a time:
    `cases` is emptied as the replay goes, and a case's answers are let go once it is evaluated
    (its record keeps the scores, checks and latencies the verdict needs)."""
    routes = {c.route for c in cases}
    cfg = replay_config(config, routes, candidate, stable, repeats)
    runs = {route: RouteRun(route, cfg.routes[route]) for route in sorted(routes)}
    checks = CaseChecksEvaluator({c.request_id: c.checks for c in cases if c.checks is not None and c.check_kinds})
    providers = make_providers(cfg)
    worker = ShadowWorker(cfg, MemoryBus(), providers, evaluators=[*default_evaluators(live_is_recorded=True), checks])
    client = worker.client = RecordingClient(cfg, providers)
    version = cfg.version()
    limit = asyncio.Semaphore(cfg.collect.concurrency)
    window = WINDOW_PER_SLOT * cfg.collect.concurrency
    total = len(cases)

    async def answer(event: TrafficEvent) -> None:
        async with limit:
            await client.prefetch(event, candidate, runs[event.route].stable)

    async def evaluate(event: TrafficEvent) -> None:
        rr = runs[event.route]
        async with limit:
            record = await worker.handle(event)
        client.forget(event)
        if record is None:
            rr.skipped["shadow.max_usd_per_hour reached"] += 1
        else:
            _fresh_reference(record)
            rr.records.append(record)

    try:
        for done in range(0, total, window):
            events = [_event(case, runs[case.route].stable, version) for case in cases[:window]]
            del cases[:window]
            await _each("answered", events, answer, progress, done, total)
            await _each("evaluated", events, evaluate, progress, done, total)
    finally:
        await worker.embedders.aclose()
        for provider in providers.values():
            await provider.close()
    for rr in runs.values():
        rr.records.sort(key=lambda r: r.request_id)
        judge(rr, checks.stable)
    return runs, client


async def _each(step: str, events: list[TrafficEvent], work: Callable[[TrafficEvent], Awaitable[None]],
                progress: Progress, done: int, total: int) -> None:
    """`work` on every event of a window at once (each bounded by its own semaphore), with progress
    over the whole replay: `done` of its `total` cases went through this step before this window."""
    async def one(event: TrafficEvent) -> None:
        nonlocal done
        await work(event)
        done += 1
        progress(step, done, total)

    if not done:
        progress(step, 0, total)
    await asyncio.gather(*(one(e) for e in events))


def judge(rr: RouteRun, stable_checks: dict[str, bool]) -> None:
    """The live judge's comparisons on the replayed records (fixed-horizon), and the case checks'
    pass rate against the stable model's on the same cases."""
    ev = RouteEvidence(rr.route, rr.rc, rr.stable, rr.candidate)
    ev.sync(RolloutState(route=rr.route, stable=rr.stable, candidate=rr.candidate, phase="shadow", since=0.0))
    for record in rr.records:
        ev.add_evaluation(record)
    pairs = _check_pairs(rr.records, stable_checks, ev.segments)
    rr.budget = comparisons_budget(rr.rc) + (len(ev.segments) if pairs is not None else 0)
    rr.alpha_each = rr.rc.rollout.alpha / rr.budget
    rr.comparisons = evaluate(ev, rr.rc, BOUNDARY, rr.alpha_each)
    if pairs is not None:
        rr.comparisons += _checks_comparisons(rr, pairs, ev.segments)


def _check_pairs(records: list[EvaluationRecord], stable_checks: dict[str, bool],
                 segments: list[str]) -> np.ndarray | None:
    """(segments, 1 window, (n, Σd, Σd², Σcandidate, Σstable)) of the checks' pass/fail pairs."""
    out = np.zeros((len(segments), 1, 5))
    index = {s: i for i, s in enumerate(segments)}
    found = False
    for r in records:
        mine = next((e.passed for e in r.evaluations if e.name == CaseChecksEvaluator.name), None)
        theirs = stable_checks.get(r.request_id)
        if mine is None or theirs is None:
            continue
        found = True
        c, s = float(mine), float(theirs)
        for seg in {"overall", r.segment}:
            if seg in index:
                out[index[seg], 0] += (1, c - s, (c - s) ** 2, c, s)
    return out if found else None


def checks_spec(rc: RouteConfig) -> MetricSpec:
    """The cases' own checks as a terminal-state success rate, held to the task-success margin."""
    margin = rc.rollout.margins.task_success_rate
    return MetricSpec("checks_pass_rate", "case checks pass rate", "shadow", CHECKS_TEST, SHADOW_CANDIDATE,
                      SHADOW_CANDIDATE, "pair:checks", "pair:checks", -margin, "below", "pts", margin)


def _checks_comparisons(rr: RouteRun, pairs: np.ndarray, segments: list[str]) -> list[Comparison]:
    spec = checks_spec(rr.rc)
    res = compare(CHECKS_TEST, BOUNDARY, pairs, pairs, rr.alpha_each, spec.bound, spec.worse_if)
    est = res.estimate
    out = []
    for i, seg in enumerate(segments):
        n, n_stable, effect = int(est.n_candidate[i]), int(est.n_stable[i]), float(est.effect[i])
        if n == 0 or not math.isfinite(effect):
            continue
        out.append(Comparison(spec=spec, segment=seg, stable=float(est.stable[i]), candidate=float(est.candidate[i]),
                              effect=effect, interval=(float(res.lo[i]), float(res.hi[i])), n=n,
                              n_stable=n_stable, verdict=int(res.verdict[i]), source="shadow",
                              parts=({"source": "shadow", "effect": effect, "n": n, "n_stable": n_stable},)))
    return out


def shadow_summary(rr: RouteRun) -> dict:
    """The capability matrix's numbers (the shadow report's format, per segment with intervals)."""
    stats = ShadowStats(rr.route)
    for record in rr.records:
        stats.add(record)
    return stats.summary()


def repro(runs: dict[str, RouteRun], client: RecordingClient, config: Config, dataset: Path,
          repeats: int | None) -> dict:
    """What it takes to run this replay again: versions of everything, the models' settings and the
    versions that answered, the evaluators', the dataset's digest."""
    evaluators: dict[str, str] = {}
    params: dict = {}
    settings: dict[str, dict] = {}
    for rr in runs.values():
        for record in rr.records:
            evaluators.update(record.repro.evaluator_versions)
            params.update({k: v for k, v in record.repro.params.items() if k != "traffic_config_version"})
            settings.update(record.repro.model_settings)
    models = {}
    for key in sorted(client.calls):
        m = config.models[key]
        models[key] = {"provider": m.provider, "settings": settings.get(key) or settings_record(m),
                       "served": sorted(client.served.get(key, ())), "calls": client.calls[key],
                       "cost_usd": client.cost_usd.get(key, 0.0)}
    return {"modelcanary_version": __version__, "config_version": config.version(),
            "dataset": {"path": str(dataset), "sha256": hashlib.sha256(dataset.read_bytes()).hexdigest()},
            "models": models, "evaluator_versions": dict(sorted(evaluators.items())), "params": params,
            # nothing here is drawn at random (stability and the judge sample by request id); a
            # case's own `seed` travels in its request
            "repeats": repeats, "boundary": BOUNDARY.name, "seed": None}
