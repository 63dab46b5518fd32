"""The outcome port: Envoy's gRPC access log service (envoy.service.accesslog.v3), served in the
signals process (signals_process.py), off the decision path.

Envoy opens one long-lived stream per access logger (per worker thread of each Envoy replica) and
sends batches of HTTP access log entries on it, every buffer flush interval (Envoy's default 1 s)
or sooner when 16 KiB have accumulated. Each batch is parsed here (signals/outcomes.py) and handed
to `sink` as Outcome field tuples; the signals process relays them to every worker. Envoy never
waits for this server: a slow or absent one costs entries, not requests.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from picker.protocol.tls import server_credentials
from picker.signals.outcomes import parse_entries

log = logging.getLogger("picker.outcomes")
SERVICE = "envoy.service.accesslog.v3.AccessLogService"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # one batch; Envoy's own buffer is 16 KiB by default


class AccessLogReceiver(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, sink: Callable[[list[tuple]], None]):
        self.sink = sink
        self.streams = 0        # open now
        self.entries = 0        # received since start
        self.bad_entries = 0    # entries that could not be parsed

    async def StreamAccessLogs(self, request_iterator, context):
        self.streams += 1
        name = ""
        try:
            async for message in request_iterator:
                if message.HasField("identifier"):  # the first message of a stream says who sends
                    name = message.identifier.log_name
                    log.info("access log stream", extra={"log_name": name,
                                                         "node": message.identifier.node.id})
                entries = message.http_logs.log_entry
                if not entries:
                    continue
                self.entries += len(entries)
                try:
                    outcomes = parse_entries(entries, time.monotonic(), time.time())
                except Exception:  # a malformed entry must not end Envoy's stream: count it, go on
                    self.bad_entries += len(entries)
                    log.exception("access log entries not understood", extra={"log_name": name})
                    continue
                self.sink(outcomes)
        finally:
            self.streams -= 1
        return als_pb2.StreamAccessLogsResponse()


async def start_server(sink: Callable[[list[tuple]], None], port: int, host: str = "[::]",
                       secure: bool = True, cert_path: str | None = None
                       ) -> tuple[grpc.aio.Server, int, AccessLogReceiver]:
    """The access log server on port (0: any free port), TLS like the ext_proc port."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    receiver = AccessLogReceiver(sink)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(receiver, server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, server_credentials(cert_path)[0]) if secure
             else server.add_insecure_port(address))
    await server.start()
    return server, bound, receiver
