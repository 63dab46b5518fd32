"""The gRPC servers: ext_proc (TLS by default) and gRPC health, on its own port (the kubelet's
probes, plaintext) and on the ext_proc port too (Envoy's active health check, over the same TLS
as the streams: it checks the very server it sends streams to).

Two ext_proc servers answer alike (the same protocol tests run against both): `native`, the
compiled transport (native.py, picker/native/), and `python`, grpc.aio (extproc.py), kept as
the fallback (`--ext-proc-server python`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker import defaults
from picker.core import Router
from picker.flowcontrol.controller import FlowControl
from picker.protocol.extproc import ExtProcServicer
from picker.protocol.limits import Budget, ServerLimits
from picker.protocol.tls import key_and_cert, server_credentials

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
# SERVING once the replica could serve (discovery synced, endpoints scraped), whether or not it is
# the one that does: a standby's state, for launchers and startup probes
WARM_SERVICE = "warm"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Servers:
    grpc_server: Any               # grpc.aio.Server, or native.NativeExtProc (same stop(grace))
    health_server: grpc.aio.Server
    health: health.aio.HealthServicer
    grpc_port: int
    health_port: int
    certificate: bytes | None  # PEM, when TLS is on
    budget: Budget | None = None  # the ext_proc streams' live stream and body-byte counts
    servicer: Any = None          # ExtProcServicer or NativeExtProc: close_answered_streams()
    kind: str = "python"          # which ext_proc server: native | python

    async def set_ready(self, ready: bool) -> None:
        for name in READY_SERVICES:
            await self._set(name, SERVING if ready else NOT_SERVING)

    async def set_warm(self, warm: bool) -> None:
        await self._set(WARM_SERVICE, SERVING if warm else NOT_SERVING)

    async def _set(self, name: str, status: int) -> None:
        await self.health.set(name, status)    # both ports of the Python server
        if self.kind == "native":               # the compiled server's ext_proc port
            self.servicer.set_health(name, status)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop taking streams and end the open ones without failing their requests: held
        requests are sent now (FlowControl.release_all: they cannot wait for room within the
        grace), and streams whose request is answered end cleanly at once (Envoy keeps them open
        until the response ends, and answers 503 to a request whose stream the server cuts while
        it waits for its response). Only streams still receiving a request body use the grace."""
        await self.health.enter_graceful_shutdown()
        if self.servicer is not None:
            self.servicer.close_answered_streams()
        await self.grpc_server.stop(grace)
        await self.health_server.stop(grace)


async def start_servers(router: Router, grpc_port: int, health_port: int, secure: bool = True,
                        cert_path: str | None = None, default_body_mode: str = "full-duplex",
                        host: str = "[::]", limits: ServerLimits | None = None,
                        flow: FlowControl | None = None,
                        server: str = defaults.EXT_PROC_SERVER, end_answered: bool = False
                        ) -> Servers:
    """Start both servers (port 0 = any free port) with health NOT_SERVING until set_ready;
    `server`: the compiled ext_proc transport (`native`) or grpc.aio (`python`); `end_answered`:
    end each stream as soon as its request is answered (extproc.ExtProcServicer)."""
    limits = limits or ServerLimits(max_body_bytes=router.settings.max_body_bytes)
    cert = None
    if server == "native":
        from picker.protocol.native import NativeExtProc
        tls = key_and_cert(cert_path) if secure else None
        cert = tls[1] if tls else None
        native = NativeExtProc(router, limits, default_body_mode, flow, host, grpc_port, tls,
                               end_answered=end_answered)
        ext_server, port, servicer, budget = native, native.port, native, native.budget
    elif server == "python":
        ext_server = grpc.aio.server(options=limits.grpc_options(),
                                     maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
        servicer = ExtProcServicer(router, default_body_mode, limits.max_body_bytes, limits, flow,
                                   end_answered)
        ep_grpc.add_ExternalProcessorServicer_to_server(servicer, ext_server)
        if secure:
            creds, cert = server_credentials(cert_path)
            port = ext_server.add_secure_port(f"{host}:{grpc_port}", creds)
        else:
            port = ext_server.add_insecure_port(f"{host}:{grpc_port}")
        budget = servicer.budget
    else:
        raise ValueError(f"unknown ext_proc server {server!r} (native or python)")
    hs = health.aio.HealthServicer()
    health_server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(hs, health_server)
    if server == "python":
        health_pb2_grpc.add_HealthServicer_to_server(hs, ext_server)
    hport = health_server.add_insecure_port(f"{host}:{health_port}")
    servers = Servers(ext_server, health_server, hs, port, hport, cert, budget, servicer, server)
    await servers._set("liveness", SERVING)
    for name in (*READY_SERVICES, WARM_SERVICE):
        await servers._set(name, NOT_SERVING)
    if server == "native":
        ext_server.start()
    else:
        await ext_server.start()
    await health_server.start()
    return servers
