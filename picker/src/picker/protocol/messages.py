"""Builders for ext_proc ProcessingResponse messages."""
from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from picker.protocol.answers import (CONTROL_HEADERS, DESTINATION_HEADER, LB_NAMESPACE,  # noqa: F401
                                     SERVED_HEADER, SUBSET_HEADER, SUBSET_NAMESPACE, ImmediateAnswer,
                                     RouteAnswer)

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


def _common(a: RouteAnswer) -> ep.CommonResponse:
    return ep.CommonResponse(
        clear_route_cache=a.clear_route_cache,
        header_mutation=ep.HeaderMutation(set_headers=[_set_header(k, v) for k, v in a.set_headers],
                                          remove_headers=a.remove_headers))


def _metadata(a: RouteAnswer) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    for namespace, values in a.metadata.items():  # string values field by field: a third of
        fields = md.fields[namespace].struct_value.fields  # Struct.update's cost (per decision)
        for key, value in values.items():
            if isinstance(value, str):
                fields[key].string_value = value
            else:
                fields[key].CopyFrom(_value(value))
    return md


def _value(value) -> struct_pb2.Value:
    s = struct_pb2.Struct()
    s.update({"v": value})
    return s.fields["v"]


def route_responses(a: RouteAnswer, bodiless: bool, full_duplex: bool) -> list[ep.ProcessingResponse]:
    """A RouteAnswer as ext_proc messages: bodiless: the headers answer; FULL_DUPLEX_STREAMED: the
    held headers answer, then the body streamed on; BUFFERED: the body answer."""
    if bodiless or full_duplex:
        head = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=_common(a)),
                                     dynamic_metadata=_metadata(a))
        return [head] if bodiless else [head, *streamed_body_responses(a.body or b"")]
    common = _common(a)
    if a.body is not None:
        common.body_mutation.body = a.body
    return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                  dynamic_metadata=_metadata(a))]


def immediate(a: ImmediateAnswer) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=a.status),
        headers=ep.HeaderMutation(set_headers=[_set_header(k, v) for k, v in a.headers]),
        body=a.body, details=a.details))


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


_STRIP_HEADERS = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=strip_control_headers()))
