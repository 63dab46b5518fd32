"""Builders for ext_proc ProcessingResponse messages."""
from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SERVED_HEADER = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
# The picker's own namespace: Envoy keeps it for the request's access log entry, which brings it
# back with the outcome (signals/outcomes.py reads these keys).
PICKER_NAMESPACE = "llm-serving.picker"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# Client-sent copies of these are removed: a client must never choose its own backend.
CONTROL_HEADERS = (DESTINATION_HEADER, SUBSET_HEADER, SERVED_HEADER)
BODY_CHUNK_BYTES = 62_000  # the reference EPP's per-message limit for streamed bodies
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# Answers that never vary are built once (below) and shared by every stream: never mutate them.


def _set_header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def strip_control_headers() -> ep.CommonResponse:
    """BUFFERED headers answer: drop every client-sent control header (the body answer sets ours)."""
    return ep.CommonResponse(header_mutation=ep.HeaderMutation(remove_headers=CONTROL_HEADERS))


def strip_headers_response() -> ep.ProcessingResponse:
    """The BUFFERED headers answer (shared, built once)."""
    return _STRIP_HEADERS


def routing_common(endpoint: str, content_length: int | None) -> ep.CommonResponse:
    sets = [_set_header(DESTINATION_HEADER, endpoint)]
    if content_length is not None:
        sets.append(_set_header("content-length", str(content_length)))
    return ep.CommonResponse(
        clear_route_cache=True,
        header_mutation=ep.HeaderMutation(set_headers=sets, remove_headers=CONTROL_HEADERS[1:]))


def lb_metadata(endpoint: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return md


def routing_metadata(endpoint: str, request_id: str = "", model: str = "",
                     features: str = "") -> struct_pb2.Struct:
    """The decision's dynamic metadata: the destination for Envoy's load balancer (envoy.lb) and
    what the outcome must bring back (PICKER_NAMESPACE: request id, routed model, features)."""
    md = struct_pb2.Struct()  # field by field: a third of Struct.update's cost (per decision)
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoint
    picker = md.fields[PICKER_NAMESPACE].struct_value.fields
    picker["request_id"].string_value = request_id
    picker["model"].string_value = model
    picker["features"].string_value = features
    return md


def headers_response(common: ep.CommonResponse | None = None,
                     metadata: struct_pb2.Struct | None = None) -> ep.ProcessingResponse:
    resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common or ep.CommonResponse()))
    if metadata is not None:
        resp.dynamic_metadata.CopyFrom(metadata)
    return resp


def buffered_body_response(endpoint: str, body: bytes | None,
                           metadata: struct_pb2.Struct | None = None) -> ep.ProcessingResponse:
    """BUFFERED: destination (+ content-length, + new body if rewritten) in the body answer, with
    the decision's metadata (default: the destination only)."""
    common = routing_common(endpoint, len(body) if body is not None else None)
    if body is not None:
        common.body_mutation.body = body
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                 dynamic_metadata=metadata or lb_metadata(endpoint))


def streamed_body_responses(body: bytes) -> list[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: the body echoed in order, chunks of at most BODY_CHUNK_BYTES."""
    chunks = [body[i:i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=i == len(chunks) - 1)))
        out.append(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common)))
    return out


_EMPTY_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse(response=ep.CommonResponse()))
_EMPTY_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse()))


def empty_body_response(response_phase: bool = False) -> ep.ProcessingResponse:
    return _EMPTY_RESPONSE_BODY if response_phase else _EMPTY_REQUEST_BODY


def echo_response_body(chunk: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    common = ep.CommonResponse(body_mutation=ep.BodyMutation(
        streamed_response=ep.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)))
    return ep.ProcessingResponse(response_body=ep.BodyResponse(response=common))


_RESPONSE_HEADERS = ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=ep.CommonResponse()))
_REQUEST_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
_RESPONSE_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def response_headers_response() -> ep.ProcessingResponse:
    return _RESPONSE_HEADERS


def trailers_response(response_phase: bool) -> ep.ProcessingResponse:
    return _RESPONSE_TRAILERS if response_phase else _REQUEST_TRAILERS


def immediate_response(status: int, body: bytes, code: str, details: str) -> ep.ProcessingResponse:
    headers = ep.HeaderMutation(set_headers=[
        _set_header("content-type", "application/json"),
        _set_header("x-picker-error", code)])
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers, body=body,
        details=details[:200]))


_STRIP_HEADERS = headers_response(strip_control_headers())
