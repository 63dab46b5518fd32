"""The two listeners, the proxying, the picker connection, stats and access logs."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web
from cryptography import x509
from cryptography.x509.oid import ExtensionOID, NameOID
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from .balancer import Endpoint, Route
from .extproc import (BUFFERED, DESTINATION_HEADER, FULL_DUPLEX, ExtProcConfig, ExtProcError,
                      ExtProcExchange, HeaderMap, Immediate, UpstreamBodyError)

access_log = logging.getLogger("local.gateway.access")
log = logging.getLogger("local.gateway")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy recomputes.
SKIP_REQUEST = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                "upgrade", "host", "content-length", "expect"}
SKIP_RESPONSE = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                 "upgrade", "content-length", "date", "server"}
SERVED_BY_HEADER = "x-gateway-served-by"


@dataclass
class GatewayConfig:
    route: list[tuple[str, int, list[str]]]  # (group name, weight, endpoints) as the 8080 HTTPRoute
    # The 8081 HTTPRoute's backendRefs; None = one cluster over every endpoint of `route`.
    llm_route: list[tuple[str, int, list[str]]] | None = None
    host: str = "127.0.0.1"
    http_port: int = 8080
    llm_port: int = 8081
    admin_port: int = 9901
    picker: str = "127.0.0.1:9002"
    picker_tls: bool = False
    request_body_mode: str = BUFFERED
    response_body_mode: str = "SKIP"
    message_timeout: float = 60.0
    fail_open: bool = False
    status_on_error: int = 503
    connect_timeout: float = 10.0
    request_timeout: float = 3600.0
    stream_idle_timeout: float = 300.0
    buffer_limit: int = 20 * 1024 * 1024
    served_by_header: bool = True
    seed: int | None = None


@dataclass
class ListenerStats:
    requests: int = 0
    status: Counter = field(default_factory=Counter)
    served: Counter = field(default_factory=Counter)
    picked: Counter = field(default_factory=Counter)
    immediate: Counter = field(default_factory=Counter)
    fallback: int = 0
    picker_errors: int = 0
    metadata_mismatch: int = 0

    def as_dict(self, route: Route | None) -> dict:
        out = {"requests": self.requests, "status": dict(self.status), "served": dict(self.served)}
        if route is not None:
            out["in_flight"] = {a: e.in_flight for a, e in route.by_address.items()}
        if self.picked or self.picker_errors or self.immediate or self.fallback:
            out.update(picked=dict(self.picked), immediate=dict(self.immediate), fallback=self.fallback,
                       picker_errors=self.picker_errors, metadata_mismatch=self.metadata_mismatch)
        return out


class PickerChannel:
    """One gRPC channel to the picker. TLS without verification, like EG's Backend
    `tls.insecureSkipVerify`: grpc cannot skip verification, so the picker's own certificate
    is fetched and trusted, and re-fetched after a failure (a restarted picker makes a new one)."""

    def __init__(self, target: str, tls: bool):
        self._target = target
        self._tls = tls
        self._channel: grpc.aio.Channel | None = None
        self._stub = None

    async def stub(self) -> pb_grpc.ExternalProcessorStub:
        if self._stub is None:
            self._channel = await self._open()
            self._stub = pb_grpc.ExternalProcessorStub(self._channel)
        return self._stub

    async def _open(self) -> grpc.aio.Channel:
        if not self._tls:
            return grpc.aio.insecure_channel(self._target)
        host, port = self._target.rsplit(":", 1)
        try:
            pem = await asyncio.get_running_loop().run_in_executor(
                None, lambda: ssl.get_server_certificate((host, int(port)), timeout=5))
        except OSError as e:
            raise ExtProcError(f"picker TLS handshake failed: {e!r}") from e
        name = _certificate_name(pem.encode())
        creds = grpc.ssl_channel_credentials(root_certificates=pem.encode())
        return grpc.aio.secure_channel(self._target, creds, options=[("grpc.ssl_target_name_override", name)])

    async def reset(self) -> None:
        if self._tls and self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


def _certificate_name(pem: bytes) -> str:
    cert = x509.load_pem_x509_certificate(pem)
    try:
        names = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
        dns = names.get_values_for_type(x509.DNSName)
        if dns:
            return dns[0]
    except x509.ExtensionNotFound:
        pass
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return cn[0].value if cn else "localhost"


def first_endpoint(value: str | None) -> str | None:
    """The first entry of `ip:port[,ip:port...]` (spec: the first valid one is used)."""
    if not value:
        return None
    for item in value.split(","):
        item = item.strip()
        host, _, port = item.rpartition(":")
        if host and port.isdigit():
            return item
    return None


class Gateway:
    """Both listeners share one upstream connection pool and the per-endpoint in-flight counts."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.endpoints: dict[str, Endpoint] = {}
        self.route = Route.build(config.route, seed=config.seed, registry=self.endpoints)
        # 8081's route. With several weighted backendRefs Envoy draws the cluster first and the
        # endpoint override only works inside it; an override outside falls back to least request.
        pool = [a for _, _, addresses in config.route for a in addresses]
        llm_groups = config.llm_route or [("pool", 1, list(dict.fromkeys(pool)))]
        self.llm_route = Route.build(llm_groups, seed=None if config.seed is None else config.seed + 1,
                                     registry=self.endpoints)
        self.stats = {"http": ListenerStats(), "llm-gw": ListenerStats()}
        self.extproc_config = ExtProcConfig(config.request_body_mode, config.response_body_mode,
                                            config.message_timeout)
        self.picker = PickerChannel(config.picker, config.picker_tls)
        self.session: aiohttp.ClientSession | None = None
        self._runners: list[web.AppRunner] = []

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=c.request_timeout, connect=c.connect_timeout,
                                          sock_read=c.stream_idle_timeout),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        http_app = web.Application(client_max_size=1 << 40)
        http_app.router.add_route("*", "/{tail:.*}", self.handle_http)
        llm_app = web.Application(client_max_size=1 << 40)
        llm_app.router.add_route("*", "/{tail:.*}", self.handle_llm)
        admin = web.Application()
        admin.router.add_get("/gateway/stats", self.handle_stats)
        admin.router.add_get("/health", self.handle_health)
        for app, port in ((http_app, c.http_port), (llm_app, c.llm_port), (admin, c.admin_port)):
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, c.host, port, backlog=1024).start()
            self._runners.append(runner)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        if self.session is not None:
            await self.session.close()
        await self.picker.close()

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def handle_stats(self, request: web.Request) -> web.Response:
        body = {"http": self.stats["http"].as_dict(self.route),
                "llm-gw": self.stats["llm-gw"].as_dict(self.llm_route)}
        return web.json_response(body)

    # -- 8080: least request ---------------------------------------------------------------

    async def handle_http(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        stats = self.stats["http"]
        headers = request_headers(request)
        body = await request.read()
        endpoint = self.route.pick()
        record = {"listener": "http", "method": request.method, "path": request.path,
                  "request_id": headers.get("x-request-id")}
        return await self._forward(request, endpoint, headers, body, None, stats, record, started)

    # -- 8081: ext_proc, then the endpoint the picker named --------------------------------

    async def handle_llm(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        stats = self.stats["llm-gw"]
        headers = request_headers(request)
        record = {"listener": "llm-gw", "method": request.method, "path": request.path,
                  "request_id": headers.get("x-request-id")}
        if request.content_length is not None and request.content_length > self.config.buffer_limit \
                and self.config.request_body_mode == BUFFERED:
            return self._local_reply(request, 413, "Payload Too Large", stats, record, started)
        body = await request.read()
        if len(body) > self.config.buffer_limit and self.config.request_body_mode == BUFFERED:
            return self._local_reply(request, 413, "Payload Too Large", stats, record, started)
        has_body = request.body_exists and bool(body)
        exchange: ExtProcExchange | None = None
        try:
            exchange = ExtProcExchange(await self.picker.stub(), self.extproc_config)
            outcome = await exchange.request(headers, body, has_body)
        except ExtProcError as e:
            stats.picker_errors += 1
            record["picker_error"] = str(e)
            await self._close_exchange(exchange, failed=True)
            exchange = None
            if not self.config.fail_open:
                return self._local_reply(request, self.config.status_on_error,
                                         "ext_proc error: picker unavailable", stats, record, started)
            outcome = None
        if outcome is not None and outcome.immediate is not None:
            await self._close_exchange(exchange)
            return self._immediate_reply(request, outcome.immediate, stats, record, started)
        if outcome is not None:
            headers, body = outcome.headers, outcome.body
            if outcome.processor_gone:
                await self._close_exchange(exchange)
                exchange = None
        picked = first_endpoint(headers.get(DESTINATION_HEADER))
        record["picked"] = picked
        if picked is not None:
            stats.picked[picked] += 1
        if outcome is not None and outcome.metadata_destination is not None \
                and first_endpoint(outcome.metadata_destination) != picked:
            stats.metadata_mismatch += 1
        group = self.llm_route.pick_group()
        endpoint = group.lookup(picked) if picked else None
        if endpoint is None:
            # endpointOverride: no usable override host in the cluster -> its LB policy decides.
            stats.fallback += 1
            record["fallback"] = True
            endpoint = group.balancer.pick()
        try:
            return await self._forward(request, endpoint, headers, body, exchange, stats, record, started)
        finally:
            await self._close_exchange(exchange)

    async def _close_exchange(self, exchange: ExtProcExchange | None, failed: bool = False) -> None:
        if exchange is not None:
            await exchange.close()
        if failed:
            await self.picker.reset()

    # -- proxying --------------------------------------------------------------------------

    async def _forward(self, request, endpoint: Endpoint, headers: HeaderMap, body: bytes,
                       exchange: ExtProcExchange | None, stats: ListenerStats, record: dict,
                       started: float) -> web.StreamResponse:
        upstream_headers = [(k, v) for k, v in headers.regular() if k not in SKIP_REQUEST]
        url = f"http://{endpoint.address}{request.raw_path}"
        record["endpoint"] = endpoint.address
        endpoint.in_flight += 1
        response: web.StreamResponse | None = None
        try:
            try:
                upstream = await self.session.request(request.method, url, headers=upstream_headers,
                                                      data=body if body else None, allow_redirects=False)
            except asyncio.TimeoutError:
                return self._local_reply(request, 504, "upstream request timeout", stats, record, started)
            except aiohttp.ClientError as e:
                record["error"] = repr(e)
                return self._local_reply(
                    request, 503, "upstream connect error or disconnect/reset before headers. "
                    "reset reason: connection failure", stats, record, started)
            try:
                response = await self._relay(request, upstream, endpoint, exchange, stats, record)
            finally:
                upstream.release()
            return response
        finally:
            endpoint.in_flight -= 1
            record["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
            if response is not None:
                self._log(record)

    async def _relay(self, request, upstream: aiohttp.ClientResponse, endpoint: Endpoint,
                     exchange: ExtProcExchange | None, stats: ListenerStats, record: dict):
        status = upstream.status
        headers = HeaderMap(list(upstream.headers.items()))
        has_body = upstream.content_length != 0 and request.method != "HEAD"
        chunks = upstream.content.iter_any()
        body_mutated = False
        if exchange is not None:
            try:
                outcome = await exchange.response(status, headers, chunks, has_body)
            except ExtProcError as e:
                stats.picker_errors += 1
                record["picker_error"] = str(e)
                if not self.config.fail_open:
                    return self._local_reply(request, self.config.status_on_error,
                                             "ext_proc error: picker unavailable", stats, record, 0)
                outcome = None
            if outcome is not None:
                if outcome.immediate is not None:
                    return self._immediate_reply(request, outcome.immediate, stats, record, 0)
                status, headers, chunks, body_mutated = (outcome.status, outcome.headers,
                                                         outcome.body, outcome.body_mutated)
        response = web.StreamResponse(status=status)
        for k, v in headers.items:
            if k not in SKIP_RESPONSE and not k.startswith(":"):
                response.headers.add(k, v)
        if upstream.content_length is not None and not body_mutated:
            response.content_length = upstream.content_length
        if self.config.served_by_header:
            response.headers[SERVED_BY_HEADER] = endpoint.address
        stats.requests += 1
        stats.status[status] += 1
        stats.served[endpoint.address] += 1
        record["status"] = status
        await response.prepare(request)
        sent = 0
        try:
            async for chunk in chunks:
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
        except (ExtProcError, UpstreamBodyError, aiohttp.ClientError, asyncio.TimeoutError) as e:
            # Headers are out: like Envoy, the only signal left is resetting the stream.
            record["error"] = repr(e)
            if request.transport is not None:
                request.transport.close()
        except ConnectionResetError:
            record["error"] = "client disconnected"
        record["bytes"] = sent
        return response

    def _local_reply(self, request, status: int, text: str, stats: ListenerStats, record: dict,
                     started: float) -> web.Response:
        stats.requests += 1
        stats.status[status] += 1
        record.update(status=status, local_reply=text)
        if started:
            record["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
            self._log(record)
        return web.Response(status=status, text=text)

    def _immediate_reply(self, request, immediate: Immediate, stats: ListenerStats, record: dict,
                         started: float) -> web.Response:
        stats.immediate[immediate.status] += 1
        stats.requests += 1
        stats.status[immediate.status] += 1
        record.update(status=immediate.status, immediate=immediate.details or True)
        if started:
            record["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
            self._log(record)
        response = web.Response(status=immediate.status, body=immediate.body)
        for k, v in immediate.headers:
            if k not in SKIP_RESPONSE:
                response.headers.add(k, v)
        return response

    @staticmethod
    def _log(record: dict) -> None:
        if access_log.isEnabledFor(logging.INFO):
            record["ts"] = round(time.time(), 3)
            access_log.info(json.dumps(record, separators=(",", ":")))


def request_headers(request: web.Request) -> HeaderMap:
    """Headers as Envoy's HCM hands them to filters: pseudo-headers first, lower-case keys,
    and the x-request-id / x-forwarded-proto the HCM adds."""
    items = [(":authority", request.host), (":path", request.raw_path), (":method", request.method),
             (":scheme", "http")]
    items.extend((k.lower(), v) for k, v in request.headers.items())
    headers = HeaderMap(items)
    if headers.get("x-request-id") is None:
        headers.add("x-request-id", str(uuid.uuid4()))
    headers.set("x-forwarded-proto", "http")
    return headers
