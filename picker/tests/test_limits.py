"""The replica's budgets through the real gRPC server: buffered body bytes and concurrent streams
are capped with a 503 and a reason, in both body modes; one stream routes (counts) one request;
the gRPC core's ceiling sits above the picker's own limit."""
import json
import logging

import grpc
import pytest

from picker.config import parse_args, server_limits
from picker.core import RouterSettings
from picker.observability.logs import JsonFormatter
from picker.observability.metrics import PickerMetrics
from picker.protocol.limits import ServerLimits
from picker.protocol.server import start_servers

from tests.helpers import extproc_client as c
from helpers import body, make_router, until

MIB = 1024 * 1024


async def start(limits: ServerLimits, server: str):
    metrics = PickerMetrics()
    router = make_router(n=2, metrics=metrics,
                         settings=RouterSettings(max_body_bytes=limits.max_body_bytes))
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", limits=limits,
                                  server=server)
    await servers.set_ready(True)
    ch = c.channel(servers.grpc_port, None)
    return router, servers, ch, c.ep_stub(ch), metrics


@pytest.fixture
async def small_budget(ext_proc_server):
    router, servers, ch, stub, metrics = await start(
        ServerLimits(max_streams=6, max_buffered_bytes=2 * MIB, max_body_bytes=2 * MIB), ext_proc_server)
    yield router, servers, stub, metrics
    await ch.close()
    await servers.stop(0)


def error_of(resp):
    imm = resp.immediate_response
    return imm.status.code, json.loads(imm.body)["error"]


class Held:
    """A FULL_DUPLEX request whose body has not ended: its bytes stay buffered in the picker."""

    def __init__(self, stub, size):
        self.call = stub.Process()
        self.body = body(prompt="x" * size)
        self.sent = len(self.body) - 10

    async def start(self):
        await self.call.write(c.request_headers(c.post_headers(), mode=c.FULL_DUPLEX))
        for i in range(0, self.sent, 64 * 1024):
            await self.call.write(c.request_body(self.body[i:min(i + 64 * 1024, self.sent)], False))
        return self

    async def end(self):
        await self.call.write(c.request_body(self.body[self.sent:], True))
        return await self.call.read()


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_body_budget_refuses_with_reason_then_recovers(small_budget, mode):
    router, servers, stub, metrics = small_budget
    held = await Held(stub, MIB + MIB // 2).start()
    # the picker has read the held body (all but its first 64 KiB count against the budget)
    await until(lambda: servers.budget.buffered == held.sent - 64 * 1024)
    prompt = body(prompt="y" * (MIB + MIB // 2))  # 1.5 MiB each: within the per-request limit
    if mode == "buffered":
        send = c.send_buffered
    else:  # one body message: no write can come after the refusal
        async def send(stub, headers, prompt):
            return await c.send_full_duplex(stub, headers, prompt, chunk=len(prompt))
    call, answers = await send(stub, c.post_headers(), prompt)
    status, err = error_of(answers[-1])
    assert (status, err["code"]) == (503, "body_buffer_full")
    assert "request buffer" in err["message"] and str(2 * MIB) in err["message"]
    assert metrics.registry.get_sample_value("picker_refused_requests_total",
                                             {"code": "body_buffer_full"}) == 1
    # the held request completes (its body is no longer buffered) and room is back
    first = await held.end()
    assert first.request_headers.response.header_mutation.set_headers
    await held.call.done_writing()
    call, answers = await send(stub, c.post_headers(), prompt)
    assert not answers[-1].HasField("immediate_response")
    await call.done_writing()


async def test_refused_and_finished_streams_release_their_bytes(small_budget):
    router, servers, stub, _ = small_budget
    budget = servers.budget
    held = await Held(stub, MIB).start()
    await until(lambda: budget.buffered == held.sent - 64 * 1024)  # the first 64 KiB: its own
    held.call.cancel()  # the stream goes away before its body ended
    await until(lambda: budget.buffered == 0 and budget.streams == 0)
    call, answers = await c.send_buffered(stub, c.post_headers(), body(prompt="z" * (2 * MIB + 9)))
    assert error_of(answers[-1])[1]["code"] == "body_too_large"
    await until(lambda: budget.buffered == 0 and budget.streams == 0)


async def test_stream_limit_refuses_with_reason_and_grpc_ceiling_is_above_it(ext_proc_server):
    limits = ServerLimits(max_streams=4, grpc_max_concurrent_rpcs=6)
    router, servers, ch, stub, metrics = await start(limits, ext_proc_server)
    try:
        open_calls = []
        for _ in range(4):  # headers sent, body pending: four requests in progress
            call = stub.Process()
            await call.write(c.request_headers(c.post_headers(), mode=c.FULL_DUPLEX))
            open_calls.append(call)
        await until(lambda: servers.budget.streams == 4)
        refused = []
        for _ in range(2):
            call, answers = await c.send_buffered(stub, c.post_headers(), body())
            refused.append(error_of(answers[0]))
        assert refused == [(503, refused[0][1])] * 2
        assert refused[0][1]["code"] == "too_many_streams" and "limit of 4" in refused[0][1]["message"]
        # over the gRPC ceiling (6 calls in progress, counting two silent ones that wait for
        # their first message) the core itself rejects the call, without a reason
        blockers = [stub.Process(), stub.Process()]
        for call in blockers:
            await call.wait_for_connection()
        await until(lambda: servers.budget.streams == 4)
        # the compiled server counts the calls itself (grpc.aio's core does so out of sight)
        await until(lambda: getattr(servers.budget, "calls", 6) == 6)
        extra = stub.Process()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await extra.wait_for_connection()
            await extra.read()  # refused on arrival: nothing to write
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in blockers:
            call.cancel()
        # a finished request frees its slot
        open_calls[0].cancel()
        await until(lambda: servers.budget.streams == 3)
        call, answers = await c.send_buffered(stub, c.post_headers(), body())
        assert not answers[-1].HasField("immediate_response")
        for call in open_calls[1:]:
            call.cancel()
    finally:
        await ch.close()
        await servers.stop(0)


@pytest.mark.parametrize("mode", [c.BUFFERED, c.FULL_DUPLEX])
async def test_repeated_request_headers_route_once(small_budget, mode):
    router, servers, stub, _ = small_budget
    headers = {":method": "GET", ":path": "/v1/models", ":authority": "gw"}
    call = stub.Process()
    await call.write(c.request_headers(headers, eos=True, mode=mode))
    first = await call.read()
    assert first.HasField("request_headers") and len(router.inflight) == 1
    await call.write(c.request_headers(headers, eos=True, mode=mode))
    status, err = error_of(await call.read())
    assert (status, err["code"]) == (400, "protocol_error")
    assert await call.read() == grpc.aio.EOF
    await until(lambda: not router.inflight)
    assert sum(e.inflight for e in router.endpoints.values()) == 0


def test_limit_flags():
    base = ["--discovery", "static", "--endpoints", "127.0.0.1:1"]
    limits = server_limits(parse_args(base + ["--max-streams", "100", "--max-buffered-bytes",
                                              str(64 * MIB), "--grpc-max-pending-requests", "300"]))
    opts = dict(limits.grpc_options())
    assert limits.max_streams == 100 and limits.max_concurrent_rpcs == 200
    assert opts["grpc.server.max_pending_requests"] == 300
    assert opts["grpc.server.max_pending_requests_hard_limit"] == 600
    assert opts["grpc.max_concurrent_streams"] == 200
    assert opts["grpc.max_receive_message_length"] == 8 * MIB + MIB
    for bad in (["--max-buffered-bytes", "1000"], ["--max-streams", "10", "--grpc-max-concurrent-rpcs", "5"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


def test_log_fields_are_clipped():
    record = logging.LogRecord("picker", logging.INFO, "", 0, "m" * 5000, None, None)
    record.model = "q" * (1024 * 1024)
    line = JsonFormatter().format(record)
    out = json.loads(line)
    assert len(line) < 2000
    assert out["model"].endswith(f"...({1024 * 1024} chars)") and out["msg"].endswith("(5000 chars)")


async def test_ordinary_prompts_pass_while_the_shared_buffer_is_full(small_budget):
    router, servers, stub, _ = small_budget
    held = [await Held(stub, 2 * MIB - 100).start()]
    await until(lambda: servers.budget.buffered > MIB + MIB // 2)
    call, answers = await c.send_buffered(stub, c.post_headers(), body(prompt="y" * (MIB // 2)))
    assert error_of(answers[-1])[1]["code"] == "body_buffer_full"
    call, answers = await c.send_buffered(stub, c.post_headers(), body(prompt="short " * 5000))
    assert answers[-1].request_body.response.header_mutation.set_headers  # 30 kB: routed
    for h in held:
        h.call.cancel()
