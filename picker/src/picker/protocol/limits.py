"""What one picker replica holds at most, and the gRPC server options that match it.

Two budgets shared by every ext_proc stream: concurrent streams (one per HTTP request, open
until its response ends) and request body bytes buffered until the body is complete. The first
SMALL_BODY_BYTES of each body are the stream's own (bounded by the stream limit), so a few
clients sending huge bodies cannot starve ordinary prompts; only the bytes above them draw on
the shared budget. A request over either budget gets a 503 with a reason instead of growing
memory; the gRPC core's own limits are
set explicitly above them, so requests reach the picker's refusal instead of being cancelled by
the core (its default 1,000 pending calls) or rejected without a reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from picker import defaults
from picker.errors import PickerError

DEFAULT_MAX_STREAMS = defaults.MAX_STREAMS
DEFAULT_MAX_BUFFERED_BYTES = defaults.MAX_BUFFERED_BYTES
MESSAGE_HEADROOM = 1024 * 1024  # protobuf framing and headers above the body limit
SMALL_BODY_BYTES = 64 * 1024    # ~16k tokens of prompt; 2048 streams x 64 KiB = 128 MiB at most


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_streams: int = DEFAULT_MAX_STREAMS                # ext_proc streams handled at once
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES  # request body bytes held, all streams
    max_body_bytes: int = 8 * 1024 * 1024                 # one request's body
    small_body_bytes: int = SMALL_BODY_BYTES              # per stream, outside the shared budget
    grpc_max_concurrent_streams: int | None = None        # per HTTP/2 connection; None: 2x streams
    grpc_max_pending_requests: int | None = None          # accepted, not yet handled; None: 2x
    grpc_max_concurrent_rpcs: int | None = None           # hard ceiling; None: 2x streams

    def __post_init__(self):
        for name in ("max_streams", "max_buffered_bytes", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    def _or_twice(self, value: int | None) -> int:
        return value if value else 2 * self.max_streams

    @property
    def max_concurrent_rpcs(self) -> int:
        return self._or_twice(self.grpc_max_concurrent_rpcs)

    def grpc_options(self) -> list[tuple[str, int]]:
        message = self.max_body_bytes + MESSAGE_HEADROOM
        pending = self._or_twice(self.grpc_max_pending_requests)
        return [("grpc.max_receive_message_length", message),
                ("grpc.max_send_message_length", message),
                ("grpc.max_concurrent_streams", self._or_twice(self.grpc_max_concurrent_streams)),
                ("grpc.server.max_pending_requests", pending),
                ("grpc.server.max_pending_requests_hard_limit", 2 * pending)]


def too_many_streams(max_streams: int) -> PickerError:
    return PickerError(503, f"the endpoint picker is handling its limit of {max_streams} "
                            f"concurrent requests; retry later", "too_many_streams")


def body_buffer_full(max_buffered_bytes: int) -> PickerError:
    return PickerError(503, f"the endpoint picker's request buffer ({max_buffered_bytes} bytes) "
                            f"is full; retry later", "body_buffer_full")


def body_too_large(max_body_bytes: int) -> PickerError:
    return PickerError(413, f"request body exceeds the limit of {max_body_bytes} bytes",
                       "body_too_large")


def protocol_error() -> PickerError:
    return PickerError(400, "request_headers sent twice in one ext_proc stream", "protocol_error")


def refusals(limits: ServerLimits) -> dict[str, PickerError]:
    """Every refusal a transport makes on its own (before any decision), by code."""
    return {e.code: e for e in (too_many_streams(limits.max_streams),
                                body_buffer_full(limits.max_buffered_bytes),
                                body_too_large(limits.max_body_bytes), protocol_error())}


class Budget:
    """The live counts against ServerLimits (one event loop: no locking)."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.streams = 0
        self.buffered = 0

    def open_stream(self) -> PickerError | None:
        if self.streams >= self.limits.max_streams:
            return too_many_streams(self.limits.max_streams)
        self.streams += 1
        return None

    def close_stream(self) -> None:
        self.streams -= 1

    def reserve(self, n: int) -> PickerError | None:
        if self.buffered + n > self.limits.max_buffered_bytes:
            return body_buffer_full(self.limits.max_buffered_bytes)
        self.buffered += n
        return None

    def release(self, n: int) -> None:
        self.buffered -= n
