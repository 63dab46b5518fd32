"""The gateway's side of Envoy's ext_proc exchange (envoy.service.ext_proc.v3).

One `ExtProcExchange` per HTTP request, on one `Process` stream, sending the messages Envoy sends
for the configured processing mode and applying the answers the way Envoy applies them:

- request body BUFFERED: request_headers -> one HeadersResponse; the whole body in one
  request_body(end_of_stream) -> one BodyResponse (header mutation, body mutation, route cache,
  dynamic metadata).
- request body FULL_DUPLEX_STREAMED: request_headers and every body chunk are sent without
  waiting; the processor answers with a HeadersResponse, then the body as streamed_response
  chunks up to end_of_stream.
- response: SKIP sends nothing (Envoy Gateway's processingMode without `response`); otherwise
  response_headers -> one HeadersResponse and the body per `response_body_mode`: NONE (not sent), STREAMED (one BodyResponse per chunk, Envoy forwards the mutated chunk) or
  FULL_DUPLEX_STREAMED (what the processor streams back is what the client gets).

An ImmediateResponse at any point ends processing. A clean close of the stream by the processor
means "continue without it". gRPC errors, timeouts and protocol violations raise ExtProcError;
the caller applies the failure mode (FailClose / FailOpen).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# Envoy's default mutation rules ignore changes to these (HeaderMutation docs).
PROTECTED_HEADERS = {":method", ":authority", ":scheme", "host", ":path"}
BUFFERED = "BUFFERED"
STREAMED = "STREAMED"
FULL_DUPLEX = "FULL_DUPLEX_STREAMED"
NONE = "NONE"
SKIP = "SKIP"  # no response processing at all (EG processingMode without `response`)
# Envoy recommends at most 64 KiB per streamed chunk; the gateway sends request bodies in these.
REQUEST_CHUNK_BYTES = 64 * 1024


_MODE_ENUM = {BUFFERED: processing_mode_pb2.ProcessingMode.BUFFERED,
              STREAMED: processing_mode_pb2.ProcessingMode.STREAMED,
              FULL_DUPLEX: processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
              NONE: processing_mode_pb2.ProcessingMode.NONE,
              SKIP: processing_mode_pb2.ProcessingMode.NONE}


class ExtProcError(Exception):
    """The processor failed: gRPC error, message timeout or a message Envoy would reject."""


class UpstreamBodyError(Exception):
    """The upstream response body failed while it was being streamed through the processor."""


class HeaderMap:
    """Ordered, lower-cased header list with Envoy's set/append/remove semantics."""

    def __init__(self, items: list[tuple[str, str]] | None = None):
        self.items = [(k.lower(), v) for k, v in (items or [])]

    def get(self, key: str) -> str | None:
        key = key.lower()
        for k, v in self.items:
            if k == key:
                return v
        return None

    def set(self, key: str, value: str) -> None:
        self.remove(key)
        self.items.append((key.lower(), value))

    def add(self, key: str, value: str) -> None:
        self.items.append((key.lower(), value))

    def remove(self, key: str) -> None:
        key = key.lower()
        self.items = [(k, v) for k, v in self.items if k != key]

    def regular(self) -> list[tuple[str, str]]:
        return [(k, v) for k, v in self.items if not k.startswith(":")]

    def to_proto(self) -> base_pb2.HeaderMap:
        return base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1", "replace")) for k, v in self.items]
        )


def header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("latin-1") if h.raw_value else h.value


def apply_header_mutation(headers: HeaderMap, mutation: pb.HeaderMutation, is_request: bool) -> None:
    """Apply like Envoy's ext_proc mutation_utils: `append` unset means overwrite."""
    for key in mutation.remove_headers:
        if not _protected(key, is_request):
            headers.remove(key)
    for option in mutation.set_headers:
        key = option.header.key.lower()
        if not key or _protected(key, is_request):
            continue
        value = header_value(option.header)
        exists = headers.get(key) is not None
        action = option.append_action
        if option.HasField("append"):
            (headers.add if option.append.value else headers.set)(key, value)
        elif action == base_pb2.HeaderValueOption.ADD_IF_ABSENT:
            if not exists:
                headers.add(key, value)
        elif action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS:
            if exists:
                headers.set(key, value)
        else:  # unset (0 counts as unset in Envoy's ext_proc) or OVERWRITE_IF_EXISTS_OR_ADD
            headers.set(key, value)


def _protected(key: str, is_request: bool) -> bool:
    key = key.lower()
    return key.startswith("x-envoy") or (is_request and key in PROTECTED_HEADERS)


@dataclass
class Immediate:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    details: str = ""


@dataclass
class RequestOutcome:
    headers: HeaderMap
    body: bytes
    immediate: Immediate | None = None
    metadata_destination: str | None = None
    processor_gone: bool = False  # the processor closed the stream: continue without it

    @property
    def destination(self) -> str | None:
        return self.headers.get(DESTINATION_HEADER)


@dataclass
class ResponseOutcome:
    status: int
    headers: HeaderMap
    body: AsyncIterator[bytes] | None = None
    immediate: Immediate | None = None
    body_mutated: bool = False


def _immediate(msg: pb.ImmediateResponse) -> Immediate:
    headers = HeaderMap()
    apply_header_mutation(headers, msg.headers, is_request=False)
    status = msg.status.code or 200
    return Immediate(status, headers.regular(), bytes(msg.body), msg.details)


@dataclass
class ExtProcConfig:
    request_body_mode: str = BUFFERED
    response_body_mode: str = SKIP
    message_timeout: float = 60.0


class ExtProcExchange:
    """One Process stream: the request phase, then the response phase, then close()."""

    def __init__(self, stub: pb_grpc.ExternalProcessorStub, config: ExtProcConfig):
        self._config = config
        self._call = stub.Process()
        self._gone = False
        self._writer: asyncio.Task | None = None
        self._writer_error: Exception | None = None
        self.metadata_destination: str | None = None

    # -- plumbing --------------------------------------------------------------------------

    async def _send(self, msg: pb.ProcessingRequest) -> None:
        try:
            await self._call.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise ExtProcError(f"ext_proc write failed: {_describe(e)}") from e

    async def _recv(self) -> pb.ProcessingResponse | None:
        """The next answer, or None when the processor closed the stream cleanly."""
        try:
            msg = await asyncio.wait_for(self._call.read(), self._config.message_timeout)
        except asyncio.TimeoutError as e:
            raise ExtProcError(f"ext_proc message timeout ({self._config.message_timeout}s)") from e
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if self._writer_error is not None:
                if isinstance(self._writer_error, ExtProcError):
                    raise self._writer_error from None
                raise UpstreamBodyError(repr(self._writer_error)) from self._writer_error
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ExtProcError(f"ext_proc stream failed: {_describe(e)}") from e
        if msg is grpc.aio.EOF:
            self._gone = True
            return None
        if msg.HasField("dynamic_metadata"):
            lb = msg.dynamic_metadata.fields.get(LB_NAMESPACE)
            if lb is not None and lb.HasField("struct_value"):
                value = lb.struct_value.fields.get(DESTINATION_HEADER)
                if value is not None:
                    self.metadata_destination = value.string_value
        return msg

    async def _expect(self, kind: str) -> pb.ProcessingResponse | None:
        msg = await self._recv()
        if msg is None or msg.HasField("immediate_response"):
            return msg
        got = msg.WhichOneof("response")
        if got != kind:
            raise ExtProcError(f"ext_proc protocol error: expected {kind}, got {got}")
        return msg

    def _spawn_writer(self, messages: AsyncIterator[pb.ProcessingRequest]) -> None:
        async def run():
            try:
                async for m in messages:
                    await self._send(m)
            except Exception as e:  # upstream body or gRPC write failed: wake the reader
                self._writer_error = e
                self._call.cancel()
                raise
        self._writer = asyncio.ensure_future(run())

    async def close(self) -> None:
        """Envoy ends the stream when the HTTP stream is done; the processor sees the request end."""
        if self._writer is not None:
            if not self._writer.done():
                self._writer.cancel()
            elif not self._writer.cancelled():
                self._writer.exception()  # retrieved here; the reader already reported it
        if not self._call.done():
            try:
                await self._call.done_writing()
            except Exception:  # noqa: BLE001 - the stream may already be broken; closing anyway
                pass
            self._call.cancel()

    # -- request phase ---------------------------------------------------------------------

    def _first_message(self, headers: HeaderMap, has_body: bool) -> pb.ProcessingRequest:
        """request_headers, with the protocol_config Envoy puts on a stream's first message."""
        return pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=headers.to_proto(), end_of_stream=not has_body),
            protocol_config=pb.ProtocolConfiguration(
                request_body_mode=_MODE_ENUM[self._config.request_body_mode],
                response_body_mode=_MODE_ENUM[self._config.response_body_mode]))

    async def request(self, headers: HeaderMap, body: bytes, has_body: bool) -> RequestOutcome:
        if self._config.request_body_mode == FULL_DUPLEX:
            return await self._request_full_duplex(headers, body, has_body)
        return await self._request_buffered(headers, body, has_body)

    def _outcome(self, headers, body, msg) -> RequestOutcome:
        out = RequestOutcome(headers, body, metadata_destination=self.metadata_destination)
        if msg is None:
            out.processor_gone = True
        elif msg.HasField("immediate_response"):
            out.immediate = _immediate(msg.immediate_response)
        return out

    async def _headers_answer(self, headers: HeaderMap, body: bytes,
                              has_body: bool) -> RequestOutcome | None:
        """Apply the answer to request_headers; an outcome if processing ends there, else None."""
        msg = await self._expect("request_headers")
        if msg is None or msg.HasField("immediate_response"):
            return self._outcome(headers, body, msg)
        apply_header_mutation(headers, msg.request_headers.response.header_mutation, is_request=True)
        return None if has_body else self._outcome(headers, body, msg)

    async def _request_buffered(self, headers: HeaderMap, body: bytes, has_body: bool) -> RequestOutcome:
        await self._send(self._first_message(headers, has_body))
        done = await self._headers_answer(headers, body, has_body)
        if done is not None:
            return done
        processor_length = headers.get("content-length")
        await self._send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        msg = await self._expect("request_body")
        if msg is None or msg.HasField("immediate_response"):
            return self._outcome(headers, body, msg)
        common = msg.request_body.response
        # A header mutation in answer to a body message is honoured in BUFFERED mode only.
        apply_header_mutation(headers, common.header_mutation, is_request=True)
        mutation = common.body_mutation
        if mutation.HasField("body") or (mutation.HasField("clear_body") and mutation.clear_body):
            body = bytes(mutation.body) if mutation.HasField("body") else b""
            declared = headers.get("content-length")
            # BUFFERED + header SEND: the processor must set content-length to the new length.
            if declared is not None and declared != processor_length and declared != str(len(body)):
                raise ExtProcError(
                    f"ext_proc body mutation rejected: content-length {declared} != body length {len(body)}")
        return self._outcome(headers, body, msg)

    async def _request_full_duplex(self, headers: HeaderMap, body: bytes, has_body: bool) -> RequestOutcome:
        async def messages():
            yield self._first_message(headers, has_body)
            if has_body:
                chunks = [body[i:i + REQUEST_CHUNK_BYTES] for i in range(0, len(body), REQUEST_CHUNK_BYTES)] or [b""]
                for i, chunk in enumerate(chunks):
                    yield pb.ProcessingRequest(
                        request_body=pb.HttpBody(body=chunk, end_of_stream=i == len(chunks) - 1))

        self._spawn_writer(messages())
        done = await self._headers_answer(headers, body, has_body)
        if done is not None:
            return done
        parts = []
        while True:
            msg = await self._expect("request_body")
            if msg is None or msg.HasField("immediate_response"):
                return self._outcome(headers, body, msg)
            mutation = msg.request_body.response.body_mutation
            if not mutation.HasField("streamed_response"):
                raise ExtProcError("ext_proc protocol error: FULL_DUPLEX_STREAMED body answer without streamed_response")
            parts.append(mutation.streamed_response.body)
            if mutation.streamed_response.end_of_stream:
                break
        await self._writer  # surfaces a write error, if any
        new_body = b"".join(parts)
        headers.remove("content-length")  # Envoy drops it in this mode; the sender recomputes it
        return self._outcome(headers, new_body, msg)

    # -- response phase --------------------------------------------------------------------

    async def response(self, status: int, headers: HeaderMap, body: AsyncIterator[bytes],
                       has_body: bool) -> ResponseOutcome:
        if self._gone or self._config.response_body_mode == SKIP:
            return ResponseOutcome(status, headers, body)
        headers.set(":status", str(status))
        mode = self._config.response_body_mode if has_body else NONE
        header_msg = pb.ProcessingRequest(
            response_headers=pb.HttpHeaders(headers=headers.to_proto(), end_of_stream=not has_body))
        if mode == NONE:
            await self._send(header_msg)
        else:
            self._sent_chunks: asyncio.Queue[bytes] = asyncio.Queue()
            self._spawn_writer(self._response_messages(header_msg, body))
        msg = await self._expect("response_headers")
        if msg is None:
            return ResponseOutcome(status, _without_status(headers), body)
        if msg.HasField("immediate_response"):
            return ResponseOutcome(status, headers, immediate=_immediate(msg.immediate_response))
        apply_header_mutation(headers, msg.response_headers.response.header_mutation, is_request=False)
        status = int(headers.get(":status") or status)
        headers = _without_status(headers)
        if mode == NONE:
            return ResponseOutcome(status, headers, body)
        if mode == FULL_DUPLEX:
            return ResponseOutcome(status, headers, self._full_duplex_body(), body_mutated=True)
        return ResponseOutcome(status, headers, self._streamed_body(), body_mutated=True)

    async def _response_messages(self, header_msg, body: AsyncIterator[bytes]):
        yield header_msg
        async for chunk in body:
            self._sent_chunks.put_nowait(chunk)
            yield pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=False))
        self._sent_chunks.put_nowait(b"")
        yield pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True))

    async def _response_body_answer(self):
        """The picker's next answer to a response_body message (None: it closed the stream)."""
        msg = await self._expect("response_body")
        if msg is not None and msg.HasField("immediate_response"):
            raise ExtProcError("ext_proc immediate response after response headers were sent")
        return msg

    async def _full_duplex_body(self) -> AsyncIterator[bytes]:
        while True:
            msg = await self._response_body_answer()
            if msg is None:
                return
            mutation = msg.response_body.response.body_mutation
            if not mutation.HasField("streamed_response"):
                raise ExtProcError("ext_proc protocol error: FULL_DUPLEX_STREAMED body answer without streamed_response")
            if mutation.streamed_response.body:
                yield mutation.streamed_response.body
            if mutation.streamed_response.end_of_stream:
                return

    async def _streamed_body(self) -> AsyncIterator[bytes]:
        while True:
            msg = await self._response_body_answer()
            if msg is None:
                return
            original = await self._sent_chunks.get()
            mutation = msg.response_body.response.body_mutation
            if mutation.HasField("body"):
                chunk = mutation.body
            elif mutation.HasField("clear_body") and mutation.clear_body:
                chunk = b""
            else:
                chunk = original
            if chunk:
                yield chunk
            if original == b"":  # the empty end_of_stream message was answered
                return


def _without_status(headers: HeaderMap) -> HeaderMap:
    headers.remove(":status")
    return headers


def _describe(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return repr(e)
