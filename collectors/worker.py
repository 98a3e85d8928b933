"""Shadow workers (issue 3 §3): replay sampled live requests to the candidate, score them, publish.

For each TrafficEvent from the `traffic` topic (consumer group `modelcanary-shadow`):

1. the live request goes to the route's candidate (its upstream `model` name, never streamed),
   with the proxy's retry rules (`send_with_retries`, one RetryBudget per route); with
   `shadow.noise_floor` it goes to the stable model a second time, concurrently;
2. each answer is classified by the proxy's own code (the request's API format: Chat
   Completions, Responses or Anthropic Messages, `service.proxy.formats`) and priced from the
   model's `price` and its usage; evaluators read every answer as its chat view;
3. the evaluators (collectors/evaluators) run, and one EvaluationRecord is published to
   `evaluations`; the shadow metrics of DESIGN §7 and, when tracing is on, a span per shadow
   call (linked to the live call's span) record the same.

Delivery is at least once below the spool limit, as for every topic (docs/reliability.md):
offsets are committed only after every record taken from the subscription has been published and
the bus confirmed it (`bus.flush`: acknowledged by the broker or written to the local spool), so a
kill -9 right after a commit loses no evaluation. An evaluation that a full spool drops is counted
(`modelcanary_events_dropped_total`), not evaluated again: a later confirmed flush commits past it. Records are
idempotent by request_id: a request already evaluated by this worker is skipped (bounded
memory). Tool calls in answers are recorded and scored, never executed. Credentials: the
provider's own key (`api_key_env`) only; TrafficEvents carry none from the client.

`run_workers(...)` is what `modelcanary serve` runs in memory mode; `main(path)` is
`modelcanary collect --config FILE` (Kafka mode), with `/metrics` and `/healthz` on
`collect.metrics_port`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable

from collectors.evaluators import default_evaluators
from collectors.evaluators.agreement import measure
from collectors.evaluators.base import EvalContext, Evaluator, ShadowCall, StableSide
from collectors.evaluators.llm_judge import Verdicts, repro_params
from collectors.similarity import repro as similarity_repro
from collectors.similarity.configured import RouteEmbedders
from collectors.spend import OverBudget, SpendCap
from service import __version__, metrics
from service.bus import EventBus, Subscription, make_bus
from service.bus.base import SHADOW_GROUP
from service.cli import cannot_listen
from service.config import Checks, Config, ModelConfig
from service.proxy.formats import CHAT, ApiFormat, format_of
from service.proxy.outcome import failed, upstream_refused
from service.recent import Recent
from service.records import (
    CandidateResult,
    EvaluationRecord,
    EvaluationResult,
    PairwiseJudgement,
    PrimaryResult,
    Repro,
    Stability,
    TrafficEvent,
)
from service.upstream import make_providers
from service.upstream.base import Provider
from service.upstream.model_settings import settings_record
from service.upstream.retry import RetryBudget, send_with_retries

log = logging.getLogger("modelcanary.shadow")

GROUP = SHADOW_GROUP
DEDUP_MEMORY = 200_000          # request ids remembered as evaluated
COMMIT_INTERVAL_S = 1.0         # commit at least this often under steady load
DRAIN_TIMEOUT_S = 10.0          # on stop: how long in-flight evaluations may take to finish
FLUSH_TIMEOUT_S = 10.0          # how long to wait for the bus to confirm records before a commit
POLL_TIMEOUT_S = 0.5
MIN_BATCH = 100


# ---- upstream calls -------------------------------------------------------------------------------


def shadow_body(request: dict, upstream_model: str, fmt: ApiFormat = CHAT) -> dict:
    """The live request for another model: its upstream name, never streamed (nor stored upstream)."""
    return fmt.shadow_body(request, upstream_model)


class LoopLag:
    """How late the event loop runs a short timer, summed: the time it spent on other work.

    A shadow call's latency is measured on the worker's loop; when the worker is saturated (a
    backlog, many evaluations scoring at once) the loop picks up answers late, and the measure is
    the worker's delay, not the model's. Such a latency is not recorded (None): a call keeps its
    latency only when the loop was late by at most LAG_TOLERANCE of it (or LAG_FLOOR_S) meanwhile.
    A tick's first TIMER_SLACK_S of lateness is the loop's own timer resolution (epoll waits whole
    milliseconds), not work: uncounted, or an idle loop would seem 5-10% late. Lateness from before a
    call started is not the call's. The timer runs only while a call is measured: an idle worker
    does not wake up.
    """

    INTERVAL_S = 0.005
    TIMER_SLACK_S = 0.001
    LAG_TOLERANCE = 0.1
    LAG_FLOOR_S = 0.002

    def __init__(self) -> None:
        self.total = 0.0
        self._measuring = 0
        self._due = 0.0
        self._ticker: asyncio.Task | None = None

    def start(self) -> float:
        """Begin measuring one call; the mark to hand to `stop`."""
        self._measuring += 1
        if self._ticker is None:
            loop = asyncio.get_running_loop()
            self._due = loop.time() + self.INTERVAL_S
            self._ticker = loop.create_task(self._tick(), name="shadow-loop-lag")
        return self.total + self._pending()

    def stop(self, latency_s: float, mark: float) -> bool:
        """End one call's measure: whether its latency is the model's (the loop was on time meanwhile)."""
        self._measuring -= 1
        late = self.total + self._pending() - mark
        if not self._measuring and self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        return late <= max(self.LAG_FLOOR_S, self.LAG_TOLERANCE * latency_s)

    def _pending(self) -> float:
        """The lateness of a tick due and not run yet."""
        return max(0.0, asyncio.get_running_loop().time() - self._due - self.TIMER_SLACK_S)

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, self._due - loop.time()))
            self.total += self._pending()
            self._due = loop.time() + self.INTERVAL_S


class ShadowClient:
    """Sends shadow calls through the proxy's providers and retry rules (the evaluators' Caller)."""

    def __init__(self, config: Config, providers: dict[str, Provider], tracing: object | None = None):
        self.config = config
        self.providers = providers
        self.tracing = tracing if getattr(tracing, "enabled", False) else None
        self.budgets: dict[str, RetryBudget] = {}
        self.spend = SpendCap(config)
        self.lag = LoopLag()

    async def call(self, route: str, model_key: str, body: dict, checks: Checks | None = None,
                   link_traceparent: str | None = None, finish_span: bool = True, share: str | None = None,
                   client_headers: dict[str, str] | None = None) -> ShadowCall:
        """One shadow call; a Messages request carries the `client_headers` its client sent with it
        (anthropic-version, anthropic-beta: the API features the request relies on). With
        `finish_span=False` the caller ends the span (`end_span`), so that evaluation results can be
        added to it first. Raises OverBudget, before calling, when the
        route's `shadow.max_usd_per_hour` is spent, or the share of it of the candidate `share`
        (the one whose evaluation this call is for, on a route with several)."""
        self.spend.check(route, share=share)
        config = self.config
        model = config.models[model_key]
        provider = self.providers[model.provider]
        if checks is None:
            rc = config.routes.get(route)
            checks = rc.checks if rc is not None else Checks()
        fmt = self.format_of(model_key, body)
        asked = fmt.model_body(body, model)  # the model's own settings, as live calls get them
        data = json.dumps(shadow_body(asked, model.name, fmt), separators=(",", ":"), ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if client_headers and fmt.name == "messages":
            headers.update(client_headers)
        auth = provider.auth_header(None)  # the provider's own key; shadow calls never carry a client's
        if auth:
            headers["Authorization"] = auth
        span = None
        if self.tracing is not None:
            span = self.tracing.start_call(route=route, role="shadow", request_model=model.name,  # type: ignore[attr-defined]
                                           provider=model.provider, traceparent=None, stream=False,
                                           link_traceparent=link_traceparent)
            if span is not None:
                headers.update(span.upstream_headers())
        budget = self.budgets.get(route)
        if budget is None:
            budget = self.budgets[route] = RetryBudget()
        retry_no = 0

        def on_retry(cause: str, t0: int, t1: int) -> None:
            nonlocal retry_no
            retry_no += 1
            if span is not None:
                span.retry(retry_no, cause, t0, t1)

        started, mark = time.perf_counter(), self.lag.start()
        try:
            result = await self._send(provider, data, headers, budget, on_retry, model_key, asked, checks, fmt)
        finally:
            latency = time.perf_counter() - started
            trusted = self.lag.stop(latency, mark)
        result.latency_s = latency if trusted else None
        result.cost_usd = model.price.cost(result.input_tokens, result.output_tokens)
        self.spend.add(route, result.cost_usd, share=share)
        result.span = span
        if finish_span:
            end_span(result, body, fmt, model)
        return result

    def format_of(self, model_key: str, body: dict) -> ApiFormat:
        """The API format of a recorded request, as the model's provider speaks it."""
        return format_of(body, self.config.providers[self.config.models[model_key].provider].api)

    async def _send(self, provider, data: bytes, headers: dict, budget: RetryBudget, on_retry: Callable,
                    model_key: str, request: dict, checks: Checks, fmt: ApiFormat) -> ShadowCall:
        """The call and its verdict; the answer is kept as its chat view (what the evaluators read)."""
        try:
            attempt = await send_with_retries(provider, fmt.path, data, headers, False, budget,
                                              on_retry=on_retry,
                                              deadline_s=self.config.providers[provider.name].timeout_s)
        except Exception as e:  # our own bug, not the model's
            log.exception("shadow call to %s failed", model_key)
            return ShadowCall(model_key, failed("proxy_error", type(e).__name__))
        if attempt.failure is not None:
            return ShadowCall(model_key, failed(attempt.failure.cause, attempt.failure.detail), retries=attempt.retries)
        reply = attempt.reply
        assert reply is not None
        status = reply.status
        if not 200 <= status < 300:
            try:
                parsed = json.loads(reply.body)
            except ValueError:
                parsed = None
            cause = fmt.error_cause(status, parsed if isinstance(parsed, dict) else None)
            return ShadowCall(model_key, upstream_refused(cause, client_credential=False),  # never a client's key
                              status=status, retries=attempt.retries)
        try:
            response = json.loads(reply.body)
        except ValueError:
            response = None
        if not isinstance(response, dict):
            return ShadowCall(model_key, failed("bad_response", "malformed JSON from upstream"), status=status,
                              retries=attempt.retries)
        view = fmt.view(request)
        verdict = fmt.classify(view, response, checks)
        usage = fmt.usage(view, response)
        if verdict.cause == "bad_response":
            return ShadowCall(model_key, verdict, status=status, retries=attempt.retries,
                              input_tokens=usage.total_input, output_tokens=usage.output)
        return ShadowCall(model_key, verdict, response=fmt.chat_view(response), status=status,
                          retries=attempt.retries, input_tokens=usage.total_input, output_tokens=usage.output)


class RecordCaller:
    """The client as the evaluators of one candidate's record see it: their calls' spans link to the
    live call's, on a route with several candidates they are paid from `share`, that candidate's
    share of the route's shadow budget, and they repeat the live request's `client_headers`."""

    def __init__(self, client: ShadowClient, link_traceparent: str | None, share: str | None,
                 client_headers: dict[str, str] | None):
        self.client = client
        self.link_traceparent = link_traceparent
        self.share = share
        self.client_headers = client_headers

    async def call(self, route: str, model_key: str, body: dict, checks: Checks | None = None) -> ShadowCall:
        return await self.client.call(route, model_key, body, checks, link_traceparent=self.link_traceparent,
                                      share=self.share, client_headers=self.client_headers)


def end_span(call: ShadowCall, body: dict, fmt: ApiFormat, model: ModelConfig) -> None:
    """End a shadow call's span with its outcome (no-op without tracing). Its content is the chat
    view of the request (`body`, in `fmt`) as `model` was asked it (its system_prompt and params in)
    and of the answer, as on the live span."""
    span = call.span
    if span is None:
        return
    response = call.response or {}
    span.finish(response_model=response.get("model"), input_tokens=call.input_tokens,  # type: ignore[attr-defined]
                output_tokens=call.output_tokens,
                finish_reasons=[c.get("finish_reason") for c in response.get("choices") or ()
                                if isinstance(c, dict) and c.get("finish_reason")],
                cause=None if call.verdict.ok else call.verdict.cause,  # max_tokens: completed, no error
                prompt=fmt.view(fmt.model_body(body, model)).get("messages"), completion=response.get("choices"))


# ---- the worker ----------------------------------------------------------------------------------


class ShadowWorker:
    """One consumer of the traffic topic with up to `collect.concurrency` evaluations in flight."""

    def __init__(self, config: Config, bus: EventBus, providers: dict[str, Provider],
                 tracing: object | None = None, evaluators: list[Evaluator] | None = None, group: str = GROUP):
        self.config = config
        self.bus = bus
        self.group = group
        self.client = ShadowClient(config, providers, tracing)
        self.embedders = RouteEmbedders(config, providers, self.client.spend)
        self.evaluators = evaluators if evaluators is not None else default_evaluators()
        self.concurrency = config.collect.concurrency
        self.batch_size = max(self.concurrency, MIN_BATCH)  # records taken per read (fewer round trips)
        self.config_version = config.version()
        self.seen = Recent(DEDUP_MEMORY)  # request ids already evaluated, oldest forgotten first
        self._working: set[str] = set()
        self._warned: set[str] = set()
        self.evaluated = 0
        self.skipped = 0
        self.errors = 0
        self._warn_keyless(providers)

    def _warn_keyless(self, providers: dict[str, Provider]) -> None:
        """Shadow calls never carry a client's key: a provider without `api_key_env` gets none."""
        used = set()
        for rc in self.config.routes.values():
            if rc.candidates:
                used.update({*rc.candidates, rc.stable})
                if rc.shadow.judge is not None:
                    used.add(rc.shadow.judge.model)
        for name in sorted({self.config.models[m].provider for m in used}):
            provider = providers.get(name)
            if provider is not None and provider.auth_header(None) is None:
                log.warning("provider %s has no api_key_env (or it is unset): shadow calls to it carry no "
                            "credentials (a client's key is never reused)", name)

    # ---- the consume loop ----------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:  # noqa: C901 - the consume loop's states (take, start, wait, commit, drain) read best together
        """Take traffic in batches, keep up to `concurrency` evaluations in flight, and commit once
        everything taken so far is published: when the worker runs dry, or every COMMIT_INTERVAL_S
        (it then stops taking new records until those in flight are done)."""
        self.embedders.load()
        sub = self.bus.subscribe(["traffic"], group=self.group)
        inflight: set[asyncio.Task] = set()
        backlog: deque = deque()  # taken from the bus, not started yet (at most `batch_size`)
        uncommitted = 0
        last_commit = time.monotonic()
        max_uncommitted = max(100, 10 * self.concurrency)
        log.info("shadow worker started (group %s, concurrency %d)", self.group, self.concurrency)
        try:
            while not stop.is_set():
                while backlog and len(inflight) < self.concurrency:
                    task = asyncio.create_task(self._guarded(backlog.popleft()))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                if uncommitted and not backlog and not inflight:
                    await self._commit(sub)
                    uncommitted, last_commit = 0, time.monotonic()
                    continue
                draining = uncommitted and (time.monotonic() - last_commit >= COMMIT_INTERVAL_S
                                            or uncommitted >= max_uncommitted)
                if draining or backlog or len(inflight) >= self.concurrency:
                    await asyncio.wait(inflight, timeout=POLL_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    batch = await sub.get_batch(self.batch_size, 0.05 if inflight else POLL_TIMEOUT_S)
                except Exception:  # the bus recovers on its own; keep the worker alive
                    log.exception("reading traffic failed; retrying")
                    await asyncio.sleep(1.0)
                    continue
                backlog.extend(batch)
                uncommitted += len(batch)
                if not batch and inflight:
                    await asyncio.wait(inflight, timeout=POLL_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            # stopping: finish what is in flight; commit only if nothing taken was left undone
            unfinished = len(backlog)
            if inflight:
                _, pending = await asyncio.wait(inflight, timeout=DRAIN_TIMEOUT_S)
                for task in pending:
                    task.cancel()
                if pending:
                    await asyncio.wait(pending)
                    unfinished += len(pending)
            if uncommitted and not unfinished:
                await self._commit(sub)
            elif uncommitted:
                log.warning("stopped with %d traffic records unfinished; they will be delivered again", unfinished)
        finally:
            for task in list(inflight):
                task.cancel()
            await sub.close()
            await self.embedders.aclose()
            log.info("shadow worker stopped: %d evaluated, %d skipped, %d errors",
                     self.evaluated, self.skipped, self.errors)

    async def _commit(self, sub: Subscription) -> None:
        if not await self.bus.flush(FLUSH_TIMEOUT_S):
            log.warning("evaluation records not confirmed by the bus in %.0f s; the traffic's offsets wait for "
                        "the next confirmed flush (a restart before it evaluates that traffic again; records a "
                        "full spool dropped are counted in modelcanary_events_dropped_total)", FLUSH_TIMEOUT_S)
            return
        await sub.commit()

    async def _guarded(self, event: object) -> None:
        route = getattr(event, "route", "unknown")
        try:
            if not isinstance(event, TrafficEvent):
                raise TypeError(f"not a TrafficEvent: {type(event).__name__}")
            await self.handle(event)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.errors += 1
            metrics.shadow_dropped_total.labels(route, "error").inc()
            log.exception("shadow evaluation of %s failed", getattr(event, "request_id", "?"))

    # ---- one event -----------------------------------------------------------------------------
    async def handle(self, event: TrafficEvent) -> EvaluationRecord | None:
        """Evaluate one sampled request with each of the route's candidates and publish their records;
        returns the first candidate's (None: skipped, or every candidate over its budget)."""
        rid = event.request_id
        if rid in self.seen or rid in self._working:
            self.skipped += 1
            return None
        rc = self.config.routes.get(event.route)
        if rc is None or rc.candidate is None:
            self.skipped += 1
            metrics.shadow_dropped_total.labels(event.route, "error").inc()
            if event.route not in self._warned:
                self._warned.add(event.route)
                log.warning("traffic for route %r skipped: %s", event.route,
                            "not in this config" if rc is None else "it has no candidate")
            return None
        if event.config_version != self.config_version and event.config_version not in self._warned:
            self._warned.add(event.config_version)
            log.info("traffic from a proxy with config version %s; this worker runs %s (if routes or models "
                     "differ, give both the same config)", event.config_version, self.config_version)
        self._working.add(rid)
        try:
            records = await self._evaluate(event)
        finally:
            self._working.discard(rid)
        if not records:
            return None
        for record in records:
            self.bus.publish("evaluations", record)
        self.seen.add(rid)
        self.evaluated += 1
        return records[0]

    async def _evaluate(self, event: TrafficEvent) -> list[EvaluationRecord]:
        """Every candidate of the route on the same request, concurrently; the stable asked again once
        for all of them (the noise floor of each record). A candidate over its budget has no record."""
        config = self.config
        route = event.route
        rc = config.routes[route]
        stable_key = event.primary.model if event.primary.model in config.models else rc.stable
        calls: list[tuple[str | None, Callable[[], Awaitable[ShadowCall]]]] = [
            (key, functools.partial(self.client.call, route, key, event.request, link_traceparent=event.traceparent,
                                    finish_span=False, share=key, client_headers=event.headers))
            for key in rc.candidates]
        if rc.shadow.noise_floor:
            calls.append((None, functools.partial(self.client.call, route, stable_key, event.request,
                                                  link_traceparent=event.traceparent, client_headers=event.headers)))
        # started in a random order: on an upstream that serves one call at a time, no side waits more often
        random.shuffle(calls)
        started = {key: asyncio.ensure_future(call()) for key, call in calls}
        again_task = started.get(None)
        stable_side = StableSide(RecordCaller(self.client, event.traceparent, None, event.headers))
        try:
            done = await asyncio.gather(*(self._one(event, key, stable_key, started[key], again_task, stable_side)
                                          for key in rc.candidates), return_exceptions=True)
        finally:
            stable_side.close()
            if again_task is not None:
                _noise_floor_counted(route, stable_key, again_task)
            for task in started.values():
                _cancel_unawaited(task)
        records = [r for r in done if isinstance(r, EvaluationRecord)]
        if records:  # one noise floor per request, whatever the candidates: counted once
            _observe_noise_floor(route, stable_key, records[0])
        errors = [r for r in done if isinstance(r, BaseException) and not isinstance(r, OverBudget)]
        if errors and not records:
            raise errors[0]
        for result in done:
            if isinstance(result, OverBudget):
                metrics.shadow_dropped_total.labels(route, "budget").inc()
            elif isinstance(result, BaseException):  # the other candidates' records still count
                self.errors += 1
                metrics.shadow_dropped_total.labels(route, "error").inc()
                log.error("shadow evaluation of %s failed for one candidate: %r", event.request_id, result)
        return records

    async def _one(self, event: TrafficEvent, candidate_key: str, stable_key: str, call: asyncio.Future,
                   again_task: asyncio.Future | None, stable_side: StableSide) -> EvaluationRecord:
        request = event.request
        model = self.config.models[candidate_key]  # as asked (a reload may take it off meanwhile)
        candidate: ShadowCall | None = None
        try:
            candidate = await call
            stable_again = await asyncio.shield(again_task) if again_task is not None else None
            return await self._score(event, stable_key, candidate, stable_again, stable_side)
        finally:
            if candidate is not None:  # after the evaluations were added to its span
                end_span(candidate, request, self.client.format_of(candidate_key, request), model)

    async def _score(self, event: TrafficEvent, stable_key: str, candidate: ShadowCall,
                     stable_again: ShadowCall | None, stable_side: StableSide) -> EvaluationRecord:
        config = self.config
        route = event.route
        rc = config.routes[route]
        candidate_key = candidate.model
        request = event.request
        fmt = self.client.format_of(stable_key, request)
        live = fmt.chat_view(event.primary.body)
        caller = RecordCaller(self.client, event.traceparent, candidate_key if len(rc.candidates) > 1 else None,
                              event.headers)
        ctx = EvalContext(config=config, route=route, route_cfg=rc, event=event, request=request, view=fmt.view(request),
                          live=live, candidate=candidate, stable_again=stable_again,
                          caller=caller, stable_side=stable_side, embedder=self.embedders.for_route(route, rc))
        measured = await measure(ctx)
        chosen = [e for e in self.evaluators if e.selected(ctx)]
        evaluations = [await self._run_one(e, ctx) for e in chosen]  # the slow ones (judge, stability) are rare

        stable_cost = paired_stable_cost(config, event.primary, stable_key, stable_again)
        verdict = candidate.verdict
        params: dict = {"candidate": candidate_key, "candidate_upstream": config.models[candidate_key].name,
                        "stable": stable_key, "noise_floor": rc.shadow.noise_floor,
                        "traffic_config_version": event.config_version}
        if isinstance(request.get("temperature"), (int, float)):
            params["temperature"] = request["temperature"]
        if measured.problem is None:
            params["similarity"] = {**similarity_repro(ctx.embedder), "agree_at": rc.shadow.similarity.agree_at}
        if any(e.name == "stability" for e in chosen):
            params["stability_k"] = rc.shadow.stability.k
        if rc.shadow.judge is not None and any(e.name == "judge" for e in chosen):
            params.update(repro_params(rc.shadow.judge))
        verdicts: Verdicts | None = ctx.extra.get("judge")
        seed = request.get("seed") if isinstance(request.get("seed"), int) else None
        record = EvaluationRecord(
            request_id=event.request_id, ts=time.time(), route=route, segment=event.segment,
            stable_model=stable_key, candidate_model=candidate_key,
            candidate=CandidateResult(outcome=verdict.outcome, cause=verdict.cause, blame=verdict.blame,
                                      latency_s=candidate.latency_s, usage=candidate.usage,
                                      cost_usd=candidate.cost_usd),
            evaluations=evaluations, agreement=measured.agreement, similarity=measured.similarity.as_dict(),
            judge=verdicts.record() if verdicts is not None else PairwiseJudgement(),
            stability=ctx.extra.get("stability") or Stability(),
            repro=Repro(modelcanary_version=__version__, config_version=self.config_version,
                        evaluator_versions={e.name: e.version for e in chosen}, params=params, seed=seed,
                        model_settings={key: settings_record(config.models[key])
                                        for key in (candidate_key, stable_key)}),
            stable_latency_s=paired_stable_latency(event.primary, stable_again), stable_cost_usd=stable_cost,
        )
        if stable_again is not None:
            sv = stable_again.verdict
            record.stable_again = CandidateResult(
                outcome=sv.outcome, cause=sv.cause, blame=sv.blame, latency_s=stable_again.latency_s,
                usage=stable_again.usage, cost_usd=stable_again.cost_usd)
        self._observe(route, candidate_key, record, candidate, verdicts)
        return record

    async def _run_one(self, evaluator: Evaluator, ctx: EvalContext) -> EvaluationResult:
        try:
            return await evaluator.evaluate(ctx)
        except asyncio.CancelledError:
            raise
        except OverBudget as e:
            return EvaluationResult(name=evaluator.name, version=evaluator.version, passed=None, detail=str(e))
        except Exception as e:
            log.exception("evaluator %s failed on %s", evaluator.name, ctx.request_id)
            return EvaluationResult(name=evaluator.name, version=evaluator.version, passed=None,
                                    detail=f"evaluator error: {type(e).__name__}")

    def _observe(self, route: str, candidate_key: str, record: EvaluationRecord, candidate: ShadowCall,
                 verdicts: Verdicts | None) -> None:
        metrics.shadow_requests_total.labels(route, candidate_key, record.candidate.outcome).inc()
        sim = record.similarity
        if sim.candidate_vs_stable is not None:
            metrics.shadow_similarity.labels(route, candidate_key, "candidate").observe(sim.candidate_vs_stable)
        if verdicts is not None and verdicts.candidate is not None:
            result = verdicts.candidate if verdicts.candidate in ("win", "tie", "loss") else "error"
            metrics.shadow_judge_total.labels(route, candidate_key, "candidate", result).inc()
        agree = record.agreement
        if agree.candidate_vs_stable is not None:
            metrics.shadow_agreement_total.labels(route, candidate_key, "candidate",
                                                  "agree" if agree.candidate_vs_stable else "disagree").inc()
        span = candidate.span
        for result in record.evaluations:
            outcome = "pass" if result.passed else "fail" if result.passed is False else "error"
            metrics.shadow_evaluations_total.labels(route, candidate_key, result.name, outcome).inc()
            if span is not None:
                span.evaluation(result.name, result.score, result.passed, result.detail)


def paired_stable_latency(primary: PrimaryResult, stable_again: ShadowCall | None) -> float | None:
    """The stable side of the candidate's latency pair: the stable model asked again when the noise
    floor is on (the same path, at the same time, as the candidate's call: a shadow call is slower than
    a live one for the worker's reasons, not the model's), else the live answer; None when the one asked
    again failed or its latency was not the model's."""
    if stable_again is None:
        return primary.latency_s
    return stable_again.latency_s if stable_again.verdict.ok else None


def paired_stable_cost(config: Config, primary: PrimaryResult, stable_key: str,
                       stable_again: ShadowCall | None) -> float | None:
    """The stable side of the candidate's cost pair: the live answer priced on its usage. Usage the
    proxy estimated from the text (a stream whose upstream told none) is no match for the candidate's
    measured call, so the stable model asked again (the noise floor, measured the same way) stands in,
    as in a golden-set replay; without a completed one there is no pair (None)."""
    if primary.usage_estimated:
        return stable_again.cost_usd if stable_again is not None and stable_again.verdict.ok else None
    usage = primary.usage or {}
    return config.models[stable_key].price.cost(int(usage.get("prompt_tokens") or 0),
                                                int(usage.get("completion_tokens") or 0))


def _observe_noise_floor(route: str, stable_key: str, record: EvaluationRecord) -> None:
    """The noise floor's metrics: the stable model asked again, against the live answer."""
    if record.similarity.stable_vs_stable is not None:
        metrics.shadow_similarity.labels(route, stable_key, "noise_floor").observe(record.similarity.stable_vs_stable)
    if record.judge.noise is not None or record.judge.noise_failed:
        metrics.shadow_judge_total.labels(route, stable_key, "noise_floor", record.judge.noise or "error").inc()
    if record.agreement.stable_vs_stable is not None:
        metrics.shadow_agreement_total.labels(route, stable_key, "noise_floor",
                                              "agree" if record.agreement.stable_vs_stable else "disagree").inc()


async def run_workers(config: Config, bus: EventBus, providers: dict[str, Provider],
                      tracing: object | None, stop: asyncio.Event) -> None:
    """Shadow workers until `stop` is set (in-process under `serve` in memory mode, or `collect`)."""
    if not any(rc.candidate for rc in config.routes.values()):
        log.info("no route has a candidate; shadow workers idle")
    worker = ShadowWorker(config, bus, providers, tracing)
    await worker.run(stop)


# ---- `modelcanary collect` -------------------------------------------------------------------------


async def _serve_health(host: str, port: int, alive: Callable[[], bool]):
    from aiohttp import web

    async def metrics_handler(_request: web.Request) -> web.Response:
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(_request: web.Request) -> web.Response:
        ok = alive()
        return web.json_response({"status": "ok" if ok else "stopped"}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner


async def _collect(config: Config) -> int:
    from service.tracing import Tracing

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP: `modelcanary collect` reads its config at start "
                            "only; restart it (and `control`) with the changed file, as the chart does")
    bus = make_bus(config.events)
    providers = make_providers(config)
    tracing = Tracing(config.tracing, service_name="modelcanary-collect")
    for route in config.routes:
        metrics.shadow_drops_from_zero(route)
    workers: asyncio.Task | None = None
    runner = None
    try:
        try:
            runner = await _serve_health(config.server.host, config.collect.metrics_port,
                                         lambda: workers is not None and not workers.done())
        except OSError as e:
            return cannot_listen(f"server.host {config.server.host}, collect.metrics_port {config.collect.metrics_port}", e)
        await bus.start()
        log.info("collect: metrics on http://%s:%d/metrics", config.server.host, config.collect.metrics_port)
        workers = asyncio.create_task(run_workers(config, bus, providers, tracing, stop))
        await workers
    finally:
        if workers is not None and not workers.done():
            workers.cancel()
        await bus.close()
        for provider in providers.values():
            await provider.close()
        tracing.shutdown()
        if runner is not None:
            await runner.cleanup()
    return 0


def _cancel_unawaited(task: asyncio.Future) -> None:
    """Cancel a shadow call nobody awaited (the worker stopped first, or no candidate waited for the
    noise floor); its failure, if any, is the candidates' and counted there."""
    if not task.done():
        task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _noise_floor_counted(route: str, stable_key: str, task: asyncio.Future) -> None:
    """Count the noise-floor call if it answered."""
    if task.done() and not task.cancelled() and task.exception() is None:
        metrics.shadow_requests_total.labels(route, stable_key, task.result().verdict.outcome).inc()


def main(config: Config) -> int:
    """`modelcanary collect --config FILE`: shadow workers in Kafka mode until SIGTERM/SIGINT."""
    if config.events.backend != "kafka":
        print("error: `modelcanary collect` needs events.backend: kafka (in memory mode the shadow workers run "
              "inside `modelcanary serve`)", file=sys.stderr)
        return 1
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    try:
        return runner(_collect(config))
    except KeyboardInterrupt:
        return 0
