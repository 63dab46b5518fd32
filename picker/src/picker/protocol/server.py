"""The gRPC servers: ext_proc (TLS by default) and gRPC health on its own port (the kubelet's
probes, plaintext) and on the ext_proc port too (Envoy's active health check, over the same TLS
as the streams: it sees the very server it sends streams to)."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from picker.core import Router
from picker.flowcontrol.controller import FlowControl
from picker.protocol.extproc import ExtProcServicer
from picker.protocol.limits import Budget, ServerLimits
from picker.protocol.tls import server_credentials

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
# SERVING once the replica could serve (discovery synced, endpoints scraped), whether or not it is
# the one that does: a standby's state, for launchers and startup probes
WARM_SERVICE = "warm"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Servers:
    grpc_server: grpc.aio.Server
    health_server: grpc.aio.Server
    health: health.aio.HealthServicer
    grpc_port: int
    health_port: int
    certificate: bytes | None  # PEM, when TLS is on
    budget: Budget | None = None  # the ext_proc streams' live stream and body-byte counts
    servicer: ExtProcServicer | None = None

    async def set_ready(self, ready: bool) -> None:
        for name in READY_SERVICES:
            await self.health.set(name, SERVING if ready else NOT_SERVING)

    async def set_warm(self, warm: bool) -> None:
        await self.health.set(WARM_SERVICE, SERVING if warm else NOT_SERVING)

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
                        flow: FlowControl | None = None, end_answered: bool = False) -> Servers:
    """Start both servers (port 0 = any free port) with health NOT_SERVING until set_ready."""
    limits = limits or ServerLimits(max_body_bytes=router.settings.max_body_bytes)
    server = grpc.aio.server(options=limits.grpc_options(),
                             maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
    servicer = ExtProcServicer(router, default_body_mode, limits.max_body_bytes, limits, flow,
                               end_answered)
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    cert = None
    if secure:
        creds, cert = server_credentials(cert_path)
        port = server.add_secure_port(f"{host}:{grpc_port}", creds)
    else:
        port = server.add_insecure_port(f"{host}:{grpc_port}")
    hs = health.aio.HealthServicer()
    health_server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(hs, health_server)
    hport = health_server.add_insecure_port(f"{host}:{health_port}")
    await hs.set("liveness", SERVING)
    for name in (*READY_SERVICES, WARM_SERVICE):
        await hs.set(name, NOT_SERVING)
    await server.start()
    await health_server.start()
    return Servers(server, health_server, hs, port, hport, cert, servicer.budget, servicer)
