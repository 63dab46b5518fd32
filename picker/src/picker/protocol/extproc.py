"""The ext_proc stream: Envoy's messages in, the picker's answers out, for one HTTP request.

BUFFERED: answer request_headers at once (stripping control headers); the single body message
gets the destination, content-length and rewritten body. FULL_DUPLEX_STREAMED: hold the headers
answer until the body is complete (end_of_stream or trailers), then send the headers answer
with the destination and the body echoed in <= 62,000-byte chunks. The body mode comes from
Envoy's protocol_config on the first message, else from the configured default.
Response phases pass through; the request counts as finished when the response ends or the
stream closes. Every stream and every buffered body byte counts against the replica's Budget
(protocol/limits.py): over it, the request gets a 503 with the reason.

`Request` is the picker's side of one request for both ext_proc servers (this grpc.aio one,
`RequestStream`, and the compiled one, native.py); the compiled transport applies the rules
above itself (picker/native/stream.rs) and calls into `Request` once per request.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from picker.core import Decision, PickerError, RequestInfo, Router
from picker.errors import clip
from picker.flowcontrol.controller import CLIENT_HEADER, FlowControl, Outcome
from picker.flowcontrol.driver import FlowDriver
from picker.flowcontrol.queue import Held
from picker.protocol import messages as msg
from picker.protocol.answers import ImmediateAnswer, RouteAnswer, error_answer, route_answer
from picker.protocol.limits import Budget, ServerLimits, body_too_large, protocol_error
from picker.protocol.usage import UsageTracker

log = logging.getLogger("picker.extproc")
FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED
NONE = pm.ProcessingMode.NONE
BODY_MODES = {"full-duplex": FULL_DUPLEX, "buffered": BUFFERED}
Answer = RouteAnswer | ImmediateAnswer


def _headers(hm: ep.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in hm.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _subset(req: ep.ProcessingRequest) -> list[str] | None:
    ns = req.metadata_context.filter_metadata.get(msg.SUBSET_NAMESPACE)
    if ns is None or msg.SUBSET_HEADER not in ns.fields:
        return None
    value = ns.fields[msg.SUBSET_HEADER]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return [i.strip() for i in items if i.strip()]


class Request:
    """The picker's side of one HTTP request, whatever transport carries it (this module's
    gRPC server or the compiled one, native.py): route it (decide, or hold it in flow control),
    answer a held one when it leaves the queue, end its in-flight count once. Answers are
    transport-neutral (answers.py)."""

    def __init__(self, router: Router, flow: FlowDriver | None = None):
        self.router = router
        self.flow = flow
        self.held: Held | None = None      # waiting in the flow-control queue
        self.waiting: asyncio.Future | None = None  # its outcome
        self._held_route: tuple[RequestInfo, bool] | None = None
        self.full_duplex = False
        self.headers: dict[str, str] | None = None  # set by the (one) request_headers message
        self.subset: list[str] | None = None
        self.decision: Decision | None = None
        self.done = False        # on_request_done was called

    def route(self, info: RequestInfo, bodiless: bool = False) -> Answer | None:
        """Decide now, or hold (None: `waiting` gets the outcome; then `resolve` it)."""
        try:
            if self.flow is not None and not bodiless:
                result = self.flow.flow.submit(info, self._flow_outcome)
                if isinstance(result, Held):  # answered when dispatched
                    self.held, self._held_route = result, (info, bodiless)
                    if self.waiting is None:
                        self.waiting = asyncio.get_running_loop().create_future()
                    self.flow.arm()
                    return None
                d = result
            else:
                d = self.router.decide(info)
        except PickerError as err:
            return self.refuse(err)
        except Exception:  # a bug must not leave Envoy without an answer: 500, logged in full
            log.exception("decision failed", extra={"path": clip(info.path)})
            return self.refuse(PickerError(500, "internal error in the endpoint picker",
                                           "internal_error"))
        return self.answer(d, info, bodiless)

    def _flow_outcome(self, outcome: Outcome) -> None:
        """Called by FlowControl when the held request leaves the queue (possibly at once)."""
        if self.waiting is None:
            self.waiting = asyncio.get_running_loop().create_future()
        if not self.waiting.done():
            self.waiting.set_result(outcome)

    def resolve(self, outcome: Outcome) -> Answer:
        """The answer for a request that was held: its decision, or the refusal."""
        info, bodiless = self._held_route
        self.held = self.waiting = self._held_route = None
        if isinstance(outcome, PickerError):
            return self.refuse(outcome)
        return self.answer(outcome, info, bodiless)

    def cancel_hold(self) -> None:
        """The stream ended while held (the client or Envoy went away): leave the queue now."""
        if self.held is not None:
            self.flow.flow.cancel(self.held)
            self.flow.flow.publish()
            self.held = None

    def _release_body(self) -> None:
        """The transport's buffered body may go (the Python server's budget: RequestStream)."""

    def answer(self, d: Decision, info: RequestInfo, bodiless: bool) -> RouteAnswer:
        self._release_body()
        self.decision = d
        if log.isEnabledFor(logging.DEBUG):
            # request_id: the one Envoy and the client know (x-request-id), for correlation
            log.debug("decision", extra={"request_id": d.client_request_id or d.request_id,
                                         "inflight_id": d.request_id,
                                         "model": clip(d.model),
                                         "target_model": d.target_model, "endpoint": d.endpoint,
                                         "objective": d.objective, "priority": d.priority,
                                         "client": clip(info.headers.get(CLIENT_HEADER, "")),
                                         "prompt_tokens": d.prompt_tokens,
                                         "cached_tokens": d.cached_tokens,
                                         **_forecast_fields(d)})
        return route_answer(d, info, bodiless, self.full_duplex)

    def refuse(self, err: PickerError, path: str | None = None) -> ImmediateAnswer:
        self._release_body()
        log.info("request refused", extra={"status": err.status, "code": err.code,
                                           "reason": clip(err.message, 512),
                                           "path": clip(path if path is not None else
                                                        (self.headers or {}).get(":path", ""))})
        return error_answer(err)

    def finish(self, usage: dict | None = None) -> None:
        """End the in-flight count once: response complete or stream gone."""
        if self.done or self.decision is None:
            return
        self.done = True
        self.router.on_request_done(self.decision.request_id, usage)


class RequestStream(Request):
    """One ext_proc stream of the pure-Python server: Envoy's messages in, answers out.
    Every buffered body byte beyond the stream's first SMALL_BODY_BYTES counts against the
    replica's Budget."""

    def __init__(self, router: Router, default_body_mode: int, max_body_bytes: int,
                 budget: Budget, flow: FlowDriver | None = None):
        super().__init__(router, flow)
        self._after_hold: list[ep.ProcessingResponse] = []
        self.body_mode = default_body_mode
        self.response_body_mode = NONE
        self.max_body_bytes = max_body_bytes
        self.budget = budget
        self.chunks: list[bytes] = []  # request body messages (joined once, at the end)
        self.body_bytes = 0
        self.reserved = 0              # of those, held in the shared budget (above the small part)
        self.routed = False      # the request phase is answered
        self.finished = False    # an immediate response ended the stream
        self.usage: UsageTracker | None = None

    # Each handler returns the answers to send, in order.
    def handle(self, req: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if req.HasField("protocol_config"):
            cfg = req.protocol_config
            self.body_mode = cfg.request_body_mode or self.body_mode
            self.response_body_mode = cfg.response_body_mode
        if self.subset is None and req.HasField("metadata_context"):
            self.subset = _subset(req)
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(req.request_headers)
        if kind == "request_body":
            return self._request_body(req.request_body)
        if kind == "request_trailers":
            out = self._route() if not self.routed else []
            if self.held is not None:  # the trailers answer follows the held headers answer
                self._after_hold.append(msg.trailers_response(False))
                return out
            return out if self.finished else out + [msg.trailers_response(False)]
        if kind == "response_headers":
            self.usage = UsageTracker(_headers(req.response_headers).get("content-type", ""))
            if req.response_headers.end_of_stream:
                self.finish()
            return [msg.response_headers_response()]
        if kind == "response_body":
            return self._response_body(req.response_body)
        if kind == "response_trailers":
            self.finish()
            return [msg.trailers_response(True)]
        return []

    def _request_headers(self, h: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        if self.headers is not None:  # one HTTP request per stream: never route (count) twice
            return self._error(protocol_error())
        self.headers = _headers(h)
        if h.end_of_stream:  # bodiless: the only chance to route
            return self._route(bodiless=True)
        if self.body_mode == FULL_DUPLEX:
            return []  # held until the body is complete
        return [msg.strip_headers_response()]

    def _request_body(self, b: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.routed:
            return []
        need = self.body_bytes + len(b.body) - self.budget.limits.small_body_bytes - self.reserved
        if need > 0:
            refused = self.budget.reserve(need)
            if refused is not None:
                if self.router.metrics is not None:
                    self.router.metrics.refusals.labels(refused.code).inc()
                return self._error(refused)
            self.reserved += need
        self.chunks.append(b.body)
        self.body_bytes += len(b.body)
        if self.body_bytes > self.max_body_bytes:
            return self._error(body_too_large(self.max_body_bytes))
        if b.end_of_stream or b.end_of_stream_without_message:
            return self._route()
        if self.body_mode == FULL_DUPLEX:
            return []
        return [msg.empty_body_response()]  # STREAMED/partial: one answer per message

    def _release_body(self) -> None:
        self.chunks = []
        self.budget.release(self.reserved)
        self.body_bytes = self.reserved = 0

    def _route(self, bodiless: bool = False) -> list[ep.ProcessingResponse]:
        self.routed = True
        self.full_duplex = self.body_mode == FULL_DUPLEX
        headers = self.headers or {}
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []  # `body` lives on in `info` (held) or this call's answers; its bytes
        #                   count against the budget until then (_release_body)
        info = RequestInfo(headers.get(":path", ""), headers, body or None, self.subset)
        answer = self.route(info, bodiless)
        return [] if answer is None else self._render(answer, bodiless)

    def resolve_messages(self, outcome: Outcome) -> list[ep.ProcessingResponse]:
        """The messages for a request that was held, and those that waited behind it."""
        bodiless = self._held_route[1]
        out = self._render(self.resolve(outcome), bodiless)
        after, self._after_hold = self._after_hold, []
        return out if self.finished else out + after

    def _render(self, answer: Answer, bodiless: bool) -> list[ep.ProcessingResponse]:
        if isinstance(answer, ImmediateAnswer):
            self.routed = self.finished = True
            return [msg.immediate(answer)]
        return msg.route_responses(answer, bodiless, self.full_duplex)

    def _error(self, err: PickerError) -> list[ep.ProcessingResponse]:
        return self._render(self.refuse(err), False)

    def _response_body(self, b: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if self.usage is not None:
            self.usage.feed(b.body)
        eos = b.end_of_stream or b.end_of_stream_without_message
        if eos:
            self.finish()
        if self.response_body_mode == FULL_DUPLEX:
            return [msg.echo_response_body(b.body, eos)]
        return [msg.empty_body_response(response_phase=True)]

    def finish(self, usage: dict | None = None) -> None:
        """End the in-flight count once: response complete or stream gone."""
        if self.body_bytes:
            self._release_body()
        if self.done or self.decision is None:
            return
        super().finish(self.usage.finish() if self.usage is not None else None)


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    def __init__(self, router: Router, default_body_mode: str = "full-duplex",
                 max_body_bytes: int | None = None, limits: ServerLimits | None = None,
                 flow: FlowControl | None = None, end_answered: bool = False):
        self.router = router
        # End each stream (OK) as soon as its request is answered, instead of when Envoy closes
        # it at the response's end: Envoy then finishes the request alone, and the request no
        # longer depends on this replica staying up (a crash fails the streams it has open).
        # Costs the response phase (usage), which the deployed policy does not send anyway.
        self.end_answered = end_answered
        self.flow = FlowDriver(flow) if flow is not None else None
        self.default_body_mode = BODY_MODES[default_body_mode]
        self.max_body_bytes = max_body_bytes or router.settings.max_body_bytes
        self.budget = Budget(limits or ServerLimits(max_body_bytes=self.max_body_bytes))
        self.closing = False   # close_answered_streams ran
        self._answered: set[asyncio.Future] = set()   # their pending reads

    def _count_refusal(self, err: PickerError) -> None:
        if self.router.metrics is not None:
            self.router.metrics.refusals.labels(err.code).inc()

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest], context
                      ) -> AsyncIterator[ep.ProcessingResponse]:
        refused = self.budget.open_stream()
        if refused is not None:  # answer the first message with the reason, hold nothing
            self._count_refusal(refused)
            async for _ in request_iterator:
                yield msg.immediate(error_answer(refused))
                return
            return
        stream = RequestStream(self.router, self.default_body_mode, self.max_body_bytes,
                               self.budget, self.flow)
        messages = request_iterator.__aiter__()
        try:
            while True:
                if stream.routed and self.end_answered:
                    return
                if stream.routed:
                    req = await self._next_unless_closing(messages)
                else:
                    req = await anext(messages, None)
                if req is None:
                    return
                for resp in stream.handle(req):
                    yield resp
                if stream.waiting is not None:
                    # held: Envoy waits for this answer; a reset stream cancels this task
                    for resp in stream.resolve_messages(await stream.waiting):
                        yield resp
                if stream.finished:
                    return
        finally:
            stream.cancel_hold()
            self.budget.close_stream()
            stream.finish()

    async def _next_unless_closing(self, messages) -> ep.ProcessingRequest | None:
        """The next message of an answered stream (a response phase, or the stream's end), or
        None once the replica closes: Envoy keeps the stream open for the whole HTTP request,
        and a stream the server cancels fails a request still waiting for its response (503,
        statusOnError), whereas one it ends cleanly leaves Envoy to finish the request alone.
        (A task per answered stream, which close_answered_streams cancels: ~4 us.)"""
        if self.closing:
            return None
        following = asyncio.ensure_future(anext(messages, None))
        self._answered.add(following)
        try:
            return await following
        except asyncio.CancelledError:
            if self.closing and following.cancelled():
                return None
            raise
        finally:
            self._answered.discard(following)

    def close_answered_streams(self) -> None:
        """Shutting down: every held request is sent now, and every stream whose request is
        answered ends now, cleanly (and each one answered later, as soon as it is)."""
        if self.flow is not None:
            self.flow.flow.release_all()
        self.closing = True
        for following in list(self._answered):
            following.cancel()


def _forecast_fields(d: Decision) -> dict:
    """The decision's forecast answer length, for its log line (none with the predictor off)."""
    f = d.forecast
    if f is None:
        return {}
    return {"forecast_median": round(f.median), "forecast_p90": round(f.high),
            "forecast_family": f.family}
