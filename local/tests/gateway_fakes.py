"""Test doubles for the gateway's unit tests: an upstream that records what reaches it, and an
ext_proc server that behaves like the picker in both body modes."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Callable

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeUpstream:
    """A vLLM-shaped server: /v1/completions answers JSON or SSE; /status/<code> answers that
    code; /gate streams one chunk, waits for `gate` to be set, then streams the second."""

    def __init__(self, name: str):
        self.name = name
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.requests: list[dict] = []
        self.gate = asyncio.Event()
        self.delay = 0.0
        self._runner: web.AppRunner | None = None

    async def start(self) -> "FakeUpstream":
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/status/{code}", self.status)
        app.router.add_get("/gate", self.gated)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _record(self, request: web.Request) -> bytes:
        body = await request.read()
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        return body

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await self._record(request))
        if self.delay:
            await asyncio.sleep(self.delay)
        n = int(body.get("max_tokens", 3))
        if not body.get("stream"):
            return web.json_response({"model": body["model"], "served_by": self.name, "tokens": n})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(n):
            await response.write(f'data: {{"i": {i}, "served_by": "{self.name}"}}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"data": [{"id": "qwq"}], "served_by": self.name})

    async def status(self, request: web.Request) -> web.Response:
        await self._record(request)
        code = int(request.match_info["code"])
        return web.json_response({"error": {"code": code}}, status=code)

    async def gated(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await self.gate.wait()
        await response.write(b"data: second\n\n")
        return response


@dataclass
class Decision:
    endpoint: str | None = None
    body: bytes | None = None  # replacement request body
    immediate: tuple[int, bytes] | None = None
    metadata_endpoint: str | None = None  # defaults to `endpoint`
    content_length: str | None = None  # BUFFERED: override the content-length it sets


@dataclass
class StreamRecord:
    kinds: list[str] = field(default_factory=list)
    protocol_config: list = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    closed: bool = False


class FakePicker(pb_grpc.ExternalProcessorServicer):
    """Answers like the picker: in BUFFERED mode it answers every message; in FULL_DUPLEX mode it
    holds the headers answer until the body ends, then streams the body back; response bodies are
    echoed in FULL_DUPLEX and acknowledged in STREAMED mode."""

    def __init__(self, mode: str, decide: Callable[[dict, bytes], Decision]):
        self.mode = mode
        self.decide = decide
        self.streams: list[StreamRecord] = []
        self.silent = False  # never answer (message timeout tests)
        self.port = free_port()
        self._server: grpc.aio.Server | None = None

    async def start(self, credentials: grpc.ServerCredentials | None = None) -> "FakePicker":
        self._server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self, self._server)
        if credentials is None:
            self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        else:
            self._server.add_secure_port(f"127.0.0.1:{self.port}", credentials)
        await self._server.start()
        return self

    async def stop(self) -> None:
        await self._server.stop(grace=None)

    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        record = StreamRecord()
        self.streams.append(record)
        response_mode = None
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            record.kinds.append(kind)
            if req.HasField("protocol_config"):
                record.protocol_config.append(req.protocol_config)
            if self.silent:
                continue
            if kind == "request_headers":
                record.headers = {h.key: h.raw_value.decode() for h in req.request_headers.headers.headers}
                if req.request_headers.end_of_stream:
                    for msg in self._decided(record, None):
                        yield msg
                elif self.mode == "BUFFERED":
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            elif kind == "request_body":
                record.body += req.request_body.body
                if req.request_body.end_of_stream:
                    for msg in self._decided(record, record.body):
                        yield msg
            elif kind == "response_headers":
                mutation = pb.HeaderMutation(set_headers=[_header("x-picker-saw-response", "1")])
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(header_mutation=mutation)))
            elif kind == "response_body":
                chunk = req.response_body
                if response_mode is None:
                    response_mode = "echo" if self.mode == "FULL_DUPLEX_STREAMED" else "ack"
                if response_mode == "echo":
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=chunk.body, end_of_stream=chunk.end_of_stream)))))
                else:
                    yield pb.ProcessingResponse(response_body=pb.BodyResponse())
        record.closed = True

    def _decided(self, record: StreamRecord, body: bytes | None):
        decision = self.decide(record.headers, body or b"")
        if decision.immediate is not None:
            status, text = decision.immediate
            yield pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
                status=http_status_pb2.HttpStatus(code=status), body=text, details="fake",
                headers=pb.HeaderMutation(set_headers=[_header("content-type", "application/json")])))
            return
        new_body = decision.body if decision.body is not None else body
        set_headers = []
        if decision.endpoint:
            set_headers.append(_header("x-gateway-destination-endpoint", decision.endpoint))
        if body is not None:
            set_headers.append(_header("content-length", decision.content_length or str(len(new_body))))
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=set_headers),
                                   clear_route_cache=True)
        metadata = struct_pb2.Struct()
        meta_endpoint = decision.metadata_endpoint or decision.endpoint
        if meta_endpoint:
            metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": meta_endpoint}})
        if body is None:  # bodiless request: the headers answer routes it
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                        dynamic_metadata=metadata)
        elif self.mode == "BUFFERED":
            if decision.body is not None:
                common.body_mutation.body = new_body
            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common),
                                        dynamic_metadata=metadata)
        else:
            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                        dynamic_metadata=metadata)
            chunks = [new_body[i:i + 62000] for i in range(0, len(new_body), 62000)] or [b""]
            for i, c in enumerate(chunks):
                yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=c, end_of_stream=i == len(chunks) - 1)))))


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))
