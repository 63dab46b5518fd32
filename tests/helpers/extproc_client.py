"""Drive the picker's gRPC server the way Envoy does (a real grpc.aio client)."""
from __future__ import annotations

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

FULL_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = pm.ProcessingMode.BUFFERED


def channel(port: int, certificate: bytes | None) -> grpc.aio.Channel:
    if certificate is None:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    creds = grpc.ssl_channel_credentials(root_certificates=certificate)
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds,
                                   options=[("grpc.ssl_target_name_override", "localhost")])


def request_headers(headers: dict[str, str], eos: bool = False, mode: int | None = None,
                    response_mode: int = pm.ProcessingMode.NONE,
                    subset: list[str] | str | None = None) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                     for k, v in headers.items()])
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=eos))
    if mode is not None:
        req.protocol_config.CopyFrom(ep.ProtocolConfiguration(request_body_mode=mode,
                                                              response_body_mode=response_mode))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return req


def request_body(chunk: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=chunk, end_of_stream=eos))


def response_headers(content_type: str = "application/json", eos: bool = False) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                                     base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())])
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm, end_of_stream=eos))


def response_body(chunk: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=eos))


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def lb_destination(resp: ep.ProcessingResponse) -> str | None:
    ns = resp.dynamic_metadata.fields.get("envoy.lb")
    if ns is None:
        return None
    return ns.struct_value.fields["x-gateway-destination-endpoint"].string_value


def post_headers(path="/v1/completions", **extra) -> dict[str, str]:
    return {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json",
            **extra}


async def send_buffered(stub, headers, body: bytes, **kw):
    """BUFFERED: headers -> answer; whole body -> answer. Returns (call, [answers])."""
    call = stub.Process()
    await call.write(request_headers(headers, mode=BUFFERED, **kw))
    first = await call.read()
    if first.HasField("immediate_response"):
        return call, [first]
    await call.write(request_body(body, True))
    return call, [first, await call.read()]


async def send_full_duplex(stub, headers, body: bytes, chunk: int = 50_000, **kw):
    """FULL_DUPLEX_STREAMED: headers and body chunks without waiting; then read the answers."""
    call = stub.Process()
    await call.write(request_headers(headers, mode=FULL_DUPLEX, **kw))
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    for i, piece in enumerate(pieces):
        await call.write(request_body(piece, i == len(pieces) - 1))
    first = await call.read()
    if first.HasField("immediate_response"):
        return call, [first]
    answers = [first]
    while True:
        resp = await call.read()
        answers.append(resp)
        if resp.request_body.response.body_mutation.streamed_response.end_of_stream:
            return call, answers


def ep_stub(ch):
    return ep_grpc.ExternalProcessorStub(ch)
