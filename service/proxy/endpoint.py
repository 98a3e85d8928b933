"""`POST /v1/responses` and `POST /v1/messages`: the chat hot path's steps (parse once, pick a model,
forward bytes, classify, hand the rest to the Recorder) with an ApiFormat's rules, on the Proxy's
shared machinery (`Proxy.forward` / `respond`, `StreamRelay`): client keys, routing and stickiness,
client-retry detection, the retry budget, in-flight accounting, role headers and the Recorder.

Stateful follow-ups (Responses API): a request naming `previous_response_id` goes to the model that
stored that response (ResponseOwners), or gets a 409 naming the field when no replica remembers it;
one naming a `conversation` goes to the route's stable model, where `POST /v1/conversations`
(passed through) created it; a `background` one, or one whose tools run in a container the client
already has (Responses `tools[].container`, Messages `container`), is routed as usual (a background
answer is fetched later by id, like a stored response). Such requests are never shadowed
(`reason=stateful`). Fetching, cancelling or deleting a stored response (`/v1/responses/{id}…`,
passed through) goes to the model that stored it, as a follow-up does.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from functools import partial

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from service.proxy.chat import BadRequest, Proxy, client_authorization, header_map, upstream_body
from service.proxy.formats import ApiFormat
from service.proxy.formats.base import untold_usage
from service.proxy.native import on_leave_in_scope
from service.proxy.outcome import COMPLETED, Verdict, failed, upstream_refused
from service.proxy.owners import Owner, ResponseOwners
from service.proxy.recorder import Call
from service.proxy.retries import fingerprint
from service.proxy.routing import pick
from service.proxy.sampler import opted_out
from service.proxy.segments import classify_segment, user_turns
from service.proxy.streaming import SSE_HEADERS, StreamRelay, client_gone
from service.records import Conversation, Role
from service.upstream.base import UpstreamReply
from service.upstream.errors import json_object, unexplained

FORWARDED_REQUEST_HEADERS = ("anthropic-version", "anthropic-beta")


class FormatEndpoint:
    def __init__(self, proxy: Proxy, fmt: ApiFormat, owners: ResponseOwners, owner_wait_s: float = 0.0):
        self.proxy = proxy
        self.fmt = fmt
        self.owners = owners
        self.owner_wait_s = owner_wait_s

    async def __call__(self, request: Request) -> Response:  # noqa: C901 - the request's path in order, like chat(); one function on the hot path
        proxy, fmt = self.proxy, self.fmt
        started = time.perf_counter()
        request_id = os.urandom(12).hex()
        if proxy.draining:
            return fmt.error_response(503, "the proxy is shutting down; retry on another replica", code="draining")
        headers = header_map(request.scope["headers"])
        try:
            raw = await proxy.read_body(request)
            body = proxy.parse_json(raw)
            name, route = proxy.resolve(body.get("model"), headers)
            problem = fmt.check(body)
            if problem is not None:
                raise BadRequest(400, problem[1], param=problem[0])
            stream = body.get("stream", False)
            if not isinstance(stream, bool) and stream is not None:
                raise BadRequest(400, f"field 'stream' must be a boolean, got {json.dumps(stream)[:40]}", param="stream")
            session_key = headers.get("x-session-id") or (body.get("user") if isinstance(body.get("user"), str)
                                                           else None)
            stateful = fmt.stateful(body)
            view = fmt.view(body)
            proxy.refuse_other_api(name, fmt.provider_api)
            owner = None
            if stateful == "previous_response_id" and route is not None:  # once known, with the conversation's length
                owner = await self.owner(body["previous_response_id"])
            segment = classify_segment(view, headers.get("x-task-type"),
                                       proxy.config.routes[route].task_types if route is not None else (),
                                       self.owners.conversation(body.get("previous_response_id")))
            client = f"{client_authorization(headers) or ''}|{session_key or ''}"
            model_key, role = self._pick(name, route, body, session_key, stateful, segment,
                                         (client, view["messages"]), owner)
        except BadRequest as e:
            return e.response(fmt.error_response)
        except ClientDisconnect:
            return Response(status_code=499)
        if route is None:
            route = name
        call = Call(request_id=request_id, route=route, model_key=model_key, role=role, segment=segment,
                    started=started, request=body, session_key=session_key, stream=bool(stream),
                    no_shadow=opted_out(headers.get("x-modelcanary-no-shadow")),
                    traceparent=headers.get("traceparent"), stateful=stateful is not None, view=view,
                    headers={k: headers[k] for k in FORWARDED_REQUEST_HEADERS if k in headers} or None)
        call.client_retry = proxy.retries.is_retry(headers.get("x-stainless-retry-count"), fingerprint(client, raw))
        model = proxy.config.models[model_key]
        provider = proxy.providers[model.provider]
        asked = fmt.model_body(body, model)
        try:
            out = upstream_body(asked)
        except BadRequest as e:
            return e.response(fmt.error_response)
        if model.params or model.system_prompt is not None:
            view = fmt.view(asked)  # the answer is judged against what the model was asked
        call.asked = view  # a stream left before its first event bills this input
        up_headers = proxy.upstream_headers(call, model, provider, headers, FORWARDED_REQUEST_HEADERS)

        proxy._start(call)
        sent = await proxy.forward(call, provider, fmt.path, out, up_headers,
                                   deadline_s=proxy.config.providers[model.provider].timeout_s, error=fmt.error_response,
                                   on_leave=partial(on_leave_in_scope, request.scope))
        if isinstance(sent, Response):
            return sent
        if call.stream and sent.status == 200:
            relay = StreamRelay(call, sent, partial(self._classify_stream, call, view),
                                partial(self._tally_stream, call, view), proxy._done, proxy.cutting_streams,
                                is_over=self._is_over, has_output=fmt.has_output, error_event=fmt.stream_error)
            return relay.response(proxy._headers(call, sent) | SSE_HEADERS)
        try:
            answer = self._plain(call, sent, view)
        except Exception:
            answer = proxy.unjudged(call, fmt.error_response)
        return proxy.respond(partial(client_gone, request.receive), call, answer)

    async def owner(self, response_id: str) -> Owner | None:
        """Who stored a response, waited for while another replica's outcome may still name it."""
        return await self.owners.wait(response_id, self.owner_wait_s)

    def _pick(self, name: str, route: str | None, body: dict, session_key: str | None, stateful: str | None,
              segment: str, start: tuple[str, list], owner: Owner | None) -> tuple[str, Role]:
        """(model key, role): by the split (`start`: the client and the messages that place a request
        without a session), unless the request refers to state one model holds (`owner`: who stored
        the response a follow-up names)."""
        if route is None:
            return name, "stable"
        rc = self.proxy.config.routes[route]
        if stateful in (None, "background", "container", "mcp") or (stateful == "conversation" and rc.candidate is None):
            return pick(route, self.proxy.book.routing[route], session_key, segment, *start)
        if stateful == "conversation":
            return rc.stable, "stable"
        response_id = body["previous_response_id"]
        elsewhere = owner is not None and not owner.serves(route, rc)
        if (owner is None or elsewhere) and rc.candidate is None:  # one model: the one that stored what the route answered
            return pick(route, self.proxy.book.routing[route], session_key, segment, *start)
        if owner is None or elsewhere or owner.model not in self.proxy.config.models:
            known = (f"was answered on route '{owner.route}', not '{route}'" if elsewhere and owner is not None else
                     "was not stored (store: false) or not answered through this proxy lately, so which of route "
                     f"'{route}''s models stores it is unknown")
            raise BadRequest(409, f"previous_response_id '{response_id[:100]}' {known}; send the conversation in "
                             "'input' instead", param="previous_response_id", code="previous_response_unknown")
        return owner.model, "stable" if owner.model == rc.stable else "canary"

    def _plain(self, call: Call, reply: UpstreamReply, view: dict) -> Response:
        proxy, error = self.proxy, self.fmt.error_response
        headers = proxy._headers(call, reply)
        parsed = json_object(reply.body)
        if 200 <= reply.status < 300:
            if parsed is None:
                call.verdict = failed("bad_response", "malformed JSON from upstream")
                call.status = 502
                return error(502, "upstream returned a malformed response", code="bad_response", headers=headers)
            call.verdict = self._answered(call, parsed, view)
            if call.verdict.cause == "bad_response":
                call.status = 502
                return error(502, f"upstream answer is not a {self.fmt.name} response: {call.verdict.detail}",
                             code="bad_response", headers=headers)
            return Response(reply.body, status_code=reply.status, media_type="application/json", headers=headers)
        call.verdict = upstream_refused(self.fmt.error_cause(reply.status, parsed), call.client_credential)
        if call.verdict.blame == "proxy":
            return proxy.refused_credentials(call, error, headers)
        if parsed is not None:  # the upstream's own JSON error, whatever its shape
            return Response(reply.body, status_code=reply.status, media_type="application/json", headers=headers)
        return error(reply.status, unexplained(reply.status, reply.body), code=call.verdict.cause, headers=headers)

    def _answered(self, call: Call, response: dict, view: dict) -> Verdict:
        """Classify an answer and note its usage; a stored answer's id is remembered right away, before
        the client can refer to it (an unstored one's is of no use to any follow-up)."""
        fmt = self.fmt
        call.response = response
        call.usage = fmt.usage(view, response)
        response_id = fmt.response_id(response)
        if response_id is not None and _stored(call.request, response):
            call.response_id = response_id
            self._remember(call, response_id, view)
        if call.span is not None:
            call.chat = fmt.chat_view(response)
            call.finish_reasons = [c["finish_reason"] for c in (call.chat or {}).get("choices") or ()
                                   if c.get("finish_reason")]
        return fmt.classify(view, response, self.proxy._checks(call))

    def _remember(self, call: Call, response_id: str, view: dict) -> None:
        """Who stored the answer, and the conversation's length by then (also in its outcome, for the
        other replicas): the upstream's count of its input holds the turns before (an estimate from the
        text does not)."""
        tokens, turns = self.owners.conversation((call.request or {}).get("previous_response_id"))
        usage = call.usage
        if usage is not None:
            tokens = (tokens if usage.estimated else 0) + usage.total_input + usage.output
        call.conversation = Conversation.model_construct(tokens=tokens, user_turns=turns + user_turns(view["messages"]))
        self.owners.remember(response_id, call.route, call.model_key, tokens, call.conversation.user_turns)

    def _is_over(self, events: bytes) -> bool:
        """Whether events hold the stream's terminal event: the answer is whole, whatever follows."""
        return any(m in events for m in self.fmt.end_of_stream)

    def _classify_stream(self, call: Call, view: dict, raw: bytes, clipped: bool) -> Verdict:
        result = self.fmt.reassemble(raw)
        if result.response is not None and result.ended:
            return self._answered(call, result.response, view)
        if clipped and result.response is not None and not result.broken:  # longer than we keep, no error in it
            return COMPLETED
        return failed(result.cause, result.problem)

    def _tally_stream(self, call: Call, view: dict, raw: bytes) -> Verdict | None:
        """A stream that stopped before its end: its answer as far as it went, so that its tokens count.
        Input as the upstream counted it when it said so (Messages, at the start), output at least what
        the text seen holds (a count told at the start is not the final one). Returns the failure its
        events hold, if any (an error event the client was sent before it left)."""
        result = self.fmt.reassemble(raw)
        seen = failed(result.cause, result.problem) if result.broken else None
        if result.response is None:
            return seen
        call.response = result.response
        chat = self.fmt.chat_view(result.response)
        told = self.fmt.usage(view, result.response)
        call.usage = replace(told, output=max(told.output, untold_usage(view, result.response, chat).output))
        if call.span is not None:
            call.chat = chat
        return seen


def _stored(request: dict | None, response: dict) -> bool:
    """Whether the upstream keeps an answer for follow-ups: as the answer says (`store`), else as asked."""
    said = response.get("store")
    return said if isinstance(said, bool) else (request or {}).get("store") is not False
