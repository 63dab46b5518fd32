"""What the picker answers for one request, whatever transport carries it.

Both ext_proc servers (the compiled one, native.py, and the pure-Python one, extproc.py) turn a
decision into a RouteAnswer and an error into an ImmediateAnswer here, and only then into
messages: the compiled transport writes exactly these headers, metadata and body, the Python one
renders them with messages.py. A new header or metadata key added here reaches Envoy on both.
"""
from __future__ import annotations

from dataclasses import dataclass

from picker.core import Decision, RequestInfo
from picker.errors import PickerError

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
ROUTED_REMOVES = CONTROL_HEADERS[1:]   # the destination header itself is set, not removed
ERROR_DETAILS_CHARS = 200


@dataclass(slots=True)
class RouteAnswer:
    set_headers: list[tuple[str, str]]
    remove_headers: tuple[str, ...]
    metadata: dict            # dynamic metadata: namespace -> {key: value}
    body: bytes | None        # full duplex: the body to stream on; buffered: a changed body, else None
    clear_route_cache: bool = True


@dataclass(slots=True)
class ImmediateAnswer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    details: str


def route_answer(d: Decision, info: RequestInfo, bodiless: bool, full_duplex: bool) -> RouteAnswer:
    """The destination as header and `envoy.lb` metadata, what the outcome brings back in
    PICKER_NAMESPACE (request id, routed model, features); content-length with the body sent on."""
    sets = [(DESTINATION_HEADER, d.endpoint)]
    metadata = {LB_NAMESPACE: {DESTINATION_HEADER: d.endpoint},
                PICKER_NAMESPACE: {"request_id": d.request_id, "model": d.target_model,
                                   "features": d.features}}
    if bodiless:
        return RouteAnswer(sets, ROUTED_REMOVES, metadata, None)
    body = d.body
    if not full_duplex and (body is info.body or body == info.body):
        return RouteAnswer(sets, ROUTED_REMOVES, metadata, None)  # unchanged: nothing to send
    sets.append(("content-length", str(len(body))))
    return RouteAnswer(sets, ROUTED_REMOVES, metadata, body)


def error_answer(err: PickerError) -> ImmediateAnswer:
    """An OpenAI-style error body, with the code in `x-picker-error` for logs and clients."""
    return ImmediateAnswer(err.status, [("content-type", "application/json"), ("x-picker-error", err.code)],
                           err.openai_body(), err.message[:ERROR_DETAILS_CHARS])
