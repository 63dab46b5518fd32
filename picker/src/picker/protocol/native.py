"""The compiled ext_proc transport, driven from the worker's event loop.

`picker._extproc` (Rust: picker/native/, built by `make setup`) runs the gRPC server on threads of
its own: HTTP/2, TLS, protobuf, the ext_proc stream's rules (body modes, the replica's stream and
body-buffer budgets, the response phase, usage). For each HTTP request it hands this loop one
parsed request (headers, the whole body, the subset hint) through an eventfd, and writes back
what Python answers. Everything that decides stays here, in Python, on the loop that owns the
Router: `Request` (extproc.py) decides, holds in flow control, refuses and ends the in-flight
count exactly as for the pure-Python server, and answers.py says what an answer carries.
"""
from __future__ import annotations

import asyncio
import json
import logging

from picker.core import RequestInfo, Router
from picker.errors import PickerError, clip
from picker.flowcontrol.controller import FlowControl
from picker.flowcontrol.driver import FlowDriver
from picker.protocol import answers
from picker.protocol.answers import ImmediateAnswer, error_answer
from picker.protocol.extproc import BODY_MODES, Request
from picker.protocol.limits import MESSAGE_HEADROOM, ServerLimits, refusals

log = logging.getLogger("picker.extproc")
REQUEST, DONE, REFUSED = 0, 1, 2   # event kinds of _extproc.Server.take()
COUNTED_REFUSALS = ("too_many_streams", "body_buffer_full")  # picker_refused_requests_total


def load_extension():
    """The compiled module, or a clear error naming the fix."""
    try:
        from picker import _extproc
    except ImportError as exc:
        raise ValueError("the compiled ext_proc server (picker._extproc) is not built: run "
                         "`make setup` (needs cargo), or start with --ext-proc-server python "
                         f"({exc})") from exc
    return _extproc


class NativeBudget:
    """The transport's live stream and body-byte counts (protocol/limits.py's Budget, read-only)."""

    def __init__(self, server, limits: ServerLimits):
        self._server = server
        self.limits = limits

    @property
    def streams(self) -> int:
        return self._server.streams

    @property
    def buffered(self) -> int:
        return self._server.buffered

    @property
    def calls(self) -> int:
        """gRPC calls in progress, also those still waiting for their first message."""
        return self._server.calls


class NativeExtProc:
    """The compiled ext_proc server on `host:port` (0: any free port) and its event-loop side."""

    def __init__(self, router: Router, limits: ServerLimits, default_body_mode: str = "full-duplex",
                 flow: FlowControl | None = None, host: str = "[::]", port: int = 0,
                 tls: tuple[bytes, bytes] | None = None, threads: int = 1,
                 end_answered: bool = False):
        ext = load_extension()
        self.router = router
        self.flow = FlowDriver(flow) if flow is not None else None
        self.refusals = refusals(limits)
        answers_ = {code: _immediate_args(error_answer(err)) for code, err in self.refusals.items()}
        key, cert = tls if tls is not None else (None, None)
        self.server = ext.Server(
            host, port, refusals=answers_, default_body_mode=int(BODY_MODES[default_body_mode]),
            max_body_bytes=limits.max_body_bytes,
            max_message_bytes=limits.max_body_bytes + MESSAGE_HEADROOM,
            max_streams=limits.max_streams, max_buffered_bytes=limits.max_buffered_bytes,
            small_body_bytes=limits.small_body_bytes,
            max_concurrent_streams=dict(limits.grpc_options())["grpc.max_concurrent_streams"],
            max_concurrent_rpcs=limits.max_concurrent_rpcs, cert_pem=cert, key_pem=key,
            threads=threads, end_answered=end_answered)
        self.port = self.server.port
        self.budget = NativeBudget(self.server, limits)
        self.requests: dict[int, tuple[Request, object]] = {}  # handed, not yet ended
        self.closing = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.server.fileno(), self._drain)

    def _drain(self) -> None:
        for ev in self.server.take():
            kind = ev[0]
            try:
                if kind == REQUEST:
                    self._request(*ev[1:])
                elif kind == DONE:
                    self._done(ev[1], ev[2])
                else:
                    self._refused(ev[1], ev[2])
            except Exception:  # one request's bug must not stop the others' events
                log.exception("ext_proc event failed", extra={"kind": kind})

    def _request(self, rid: int, pending, headers: dict[str, str], body: bytes | None,
                 subset: list[str] | None, bodiless: bool, full_duplex: bool) -> None:
        req = Request(self.router, self.flow)
        req.headers, req.subset, req.full_duplex = headers, subset, full_duplex
        self.requests[rid] = (req, pending)
        info = RequestInfo(headers.get(":path", ""), headers, body, subset)
        try:
            answer = req.route(info, bodiless)
        except Exception:  # route() answers errors itself; this is a bug around it
            log.exception("routing failed", extra={"path": clip(info.path)})
            answer = error_answer(PickerError(500, "internal error in the endpoint picker", "internal_error"))
        if answer is None:  # held: answered when it leaves the queue
            req.waiting.add_done_callback(lambda _: self._resolved(rid))
            return
        _send(pending, answer)

    def _resolved(self, rid: int) -> None:
        entry = self.requests.get(rid)
        if entry is None or entry[0].waiting is None:  # its stream ended meanwhile (_done)
            return
        req, pending = entry
        _send(pending, req.resolve(req.waiting.result()))

    def _done(self, rid: int, usage_json: bytes | None) -> None:
        entry = self.requests.pop(rid, None)
        if entry is None:
            return
        req = entry[0]
        if req.waiting is not None and req.waiting.done():
            req.resolve(req.waiting.result())  # decided as its stream went: count it to end it
        req.cancel_hold()
        req.finish(_usage(usage_json))

    def _refused(self, code: str, path: str) -> None:
        err = self.refusals[code]
        if code in COUNTED_REFUSALS and self.router.metrics is not None:
            self.router.metrics.refusals.labels(code).inc()
        if code != "too_many_streams":  # as the Python server: a refused stream is not logged
            log.info("request refused", extra={"status": err.status, "code": err.code,
                                               "reason": clip(err.message, 512), "path": clip(path)})

    def set_health(self, service: str, status: int) -> None:
        """The grpc.health.v1 status of `service` on the ext_proc port (Envoy's health check)."""
        self.server.set_health(service, status)

    def close_answered_streams(self) -> None:
        """Shutting down: every held request is sent now, and every stream whose request is
        answered ends now, cleanly (and each one answered later, as soon as it is)."""
        if self.flow is not None:
            self.flow.flow.release_all()
        self.closing = True
        self.server.close_answered()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop taking streams; the open ones get `grace` seconds (this loop keeps answering
        them meanwhile), then what is left is cut."""
        await asyncio.to_thread(self.server.shutdown, grace)
        if self._loop is not None:
            self._loop.remove_reader(self.server.fileno())
            self._drain()  # the ends of the streams that were cut
            self._loop = None


def _immediate_args(a: ImmediateAnswer) -> tuple:
    return a.status, a.headers, a.body, a.details


def _send(pending, answer) -> None:
    if isinstance(answer, ImmediateAnswer):
        pending.immediate(answer.status, answer.headers, answer.body, answer.details)
    else:
        pending.route(answer.set_headers, list(answer.remove_headers), answer.metadata, answer.body,
                      answer.clear_route_cache)


def _usage(usage_json: bytes | None) -> dict | None:
    if not usage_json:
        return None
    try:
        usage = json.loads(usage_json).get("usage")
    except (ValueError, RecursionError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


__all__ = ["NativeExtProc", "load_extension", "answers"]
