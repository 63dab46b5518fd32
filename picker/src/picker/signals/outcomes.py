"""Observed outcomes: what became of each request the gateway served, read from Envoy's access log
entries (its gRPC access log service, ALS; accesslog.py serves it in the signals process).

One entry per completed request on the picker's route carries what the picker needs to learn:
the upstream host that served it, the response status and timings (common_properties), the token
counts the gateway's token accounting read from the response's `usage` and the time of its first
token (dynamic metadata `llm-serving.tokens`, base/gateway's token-accounting.lua), and what the
picker itself wrote into the request when it decided (dynamic metadata `llm-serving.picker`: its
request id, the model it routed for, the predictor's features).

The signals process parses entries here into compact tuples (`Outcome` fields in order) and sends
them to every worker, which rebuilds the Outcome and calls Router.on_outcome.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # the Router (and the routing lab) import Outcome without Envoy's protobufs
    from envoy.data.accesslog.v3 import accesslog_pb2 as al

PICKER_NAMESPACE = "llm-serving.picker"  # written by the picker's ext_proc answer
TOKENS_NAMESPACE = "llm-serving.tokens"  # written by the gateway's token accounting (Lua)
CLIENT_HEADER = "x-client-id"            # set by the gateway's API-key filter
# Keys in those namespaces (the Lua script and protocol/answers.py write them).
REQUEST_ID_KEY, MODEL_KEY, FEATURES_KEY = "request_id", "model", "features"
PROMPT_KEY, COMPLETION_KEY, FIRST_TOKEN_KEY = "prompt_tokens", "completion_tokens", "first_token_us"
MAX_TEXT = 256  # longer request ids, models or client ids are cut (they only label and match)
MAX_FEATURES = 4096


@dataclass(slots=True, frozen=True)
class Outcome:
    request_id: str               # the picker's id for the request ("" if the entry has none)
    endpoint: str                 # "ip:port" of the upstream host that served it ("" if none)
    status: int                   # HTTP status sent to the client (0: none, the stream was reset)
    prompt_tokens: int | None     # from the response's usage
    completion_tokens: int | None
    ttft: float | None            # seconds from the request's start at the gateway to its first
    #                               token (streamed responses; None when not streamed)
    duration: float               # seconds from the request's start to the response's last byte
    client: str                   # x-client-id ("" if none)
    model: str                    # the model the request was routed for ("" if unknown)
    features: str                 # what the picker wrote when it decided ("" if none)
    finished_at: float            # time.monotonic() of the picker when the entry was received
    lag: float = 0.0              # seconds from the response's last byte at the gateway to its
    #                               receipt here (wall clocks of two hosts: approximate)


def _seconds(d) -> float:
    return d.seconds + d.nanos * 1e-9


def _text(fields, key: str, limit: int = MAX_TEXT) -> str:
    v = fields.get(key)
    return v.string_value[:limit] if v is not None and v.WhichOneof("kind") == "string_value" else ""


def _count(fields, key: str) -> int | None:
    """A non-negative whole number (Struct numbers are doubles), else None."""
    v = fields.get(key)
    if v is None or v.WhichOneof("kind") != "number_value":
        return None
    n = v.number_value
    return int(n) if 0 <= n < 2 ** 53 and n == int(n) else None


def _address(addr) -> str:
    sock = addr.socket_address
    if not sock.address:
        return ""
    host = f"[{sock.address}]" if ":" in sock.address else sock.address
    return f"{host}:{sock.port_value}"


def parse_entry(entry: al.HTTPAccessLogEntry, received_at: float, wall_now: float) -> tuple:
    """One HTTP access log entry as the fields of an Outcome, in order (a tuple: cheap to send to
    the workers). received_at: time.monotonic() at receipt; wall_now: time.time() then."""
    c = entry.common_properties
    md = c.metadata.filter_metadata
    picker = md[PICKER_NAMESPACE].fields if PICKER_NAMESPACE in md else {}
    tokens = md[TOKENS_NAMESPACE].fields if TOKENS_NAMESPACE in md else {}
    start = _seconds(c.start_time)
    # time_to_last_downstream_tx_byte: the response's last byte sent to the client (absent when
    # the client went away first: then the last byte received from the upstream, or the log time)
    if c.HasField("time_to_last_downstream_tx_byte"):
        duration = _seconds(c.time_to_last_downstream_tx_byte)
    elif c.HasField("time_to_last_upstream_rx_byte"):
        duration = _seconds(c.time_to_last_upstream_rx_byte)
    else:
        duration = _seconds(c.duration)
    first_us = _count(tokens, FIRST_TOKEN_KEY)
    ttft = first_us * 1e-6 - start if first_us is not None and start > 0 else None
    if ttft is not None and not 0 <= ttft <= duration + 1e-3:
        ttft = None  # a stamp from another clock or another request: not this one's
    headers = entry.request.request_headers
    return (_text(picker, REQUEST_ID_KEY), _address(c.upstream_remote_address),
            entry.response.response_code.value, _count(tokens, PROMPT_KEY),
            _count(tokens, COMPLETION_KEY), ttft, duration,
            headers.get(CLIENT_HEADER, "")[:MAX_TEXT], _text(picker, MODEL_KEY),
            _text(picker, FEATURES_KEY, MAX_FEATURES), received_at,
            max(0.0, wall_now - start - duration) if start > 0 else 0.0)


def parse_entries(entries: Iterable[al.HTTPAccessLogEntry], received_at: float | None = None,
                  wall_now: float | None = None) -> list[tuple]:
    received_at = time.monotonic() if received_at is None else received_at
    wall_now = time.time() if wall_now is None else wall_now
    return [parse_entry(e, received_at, wall_now) for e in entries]
