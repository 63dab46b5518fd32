"""The real gRPC server driven by a real gRPC client exactly as Envoy would."""
import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.core import RouterSettings
from picker.discovery.objects import Objective, Rewrite, RewriteRule
from picker.observability.metrics import PickerMetrics
from picker.protocol.server import start_servers

from tests.helpers import extproc_client as c
from helpers import body, make_router, metrics_text

DEST = "x-gateway-destination-endpoint"


async def wait_for(pred, timeout=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.fixture(params=["tls", "plaintext"])
async def picker(request, ext_proc_server):
    metrics = PickerMetrics()
    router = make_router(
        n=3, metrics=metrics, settings=RouterSettings(max_body_bytes=2 * 1024 * 1024),
        objectives=[Objective("batch", -5)],
        rewrites=[Rewrite("canary", (RewriteRule(("qwq-alias",), (("qwq", 1.0),)),))])
    servers = await start_servers(router, 0, 0, secure=request.param == "tls", host="127.0.0.1",
                                  server=ext_proc_server)
    await servers.set_ready(True)
    ch = c.channel(servers.grpc_port, servers.certificate)
    yield router, c.ep_stub(ch), servers, metrics
    await ch.close()
    await servers.stop(0)


async def finish_response(call, usage_body: bytes):
    await call.write(c.response_headers())
    assert (await call.read()).HasField("response_headers")
    await call.write(c.response_body(usage_body, True))
    assert (await call.read()).HasField("response_body")
    await call.done_writing()


async def test_buffered_sets_destination_in_body_answer(picker):
    router, stub, _, metrics = picker
    call, (head, body_answer) = await c.send_buffered(
        stub, c.post_headers(**{DEST: "6.6.6.6:1", "x-gateway-destination-endpoint-subset": "x"}), body())
    # headers answer: strips the client's control headers, names no destination yet
    assert c.set_headers(head.request_headers.response) == {}
    removed = set(head.request_headers.response.header_mutation.remove_headers)
    assert {DEST, "x-gateway-destination-endpoint-subset"} <= removed
    common = body_answer.request_body.response
    dest = c.set_headers(common)[DEST]
    assert dest in router.endpoints and c.lb_destination(body_answer) == dest
    assert common.clear_route_cache
    assert not common.body_mutation.body  # body unchanged: no mutation
    assert sum(e.inflight for e in router.endpoints.values()) == 1
    await finish_response(call, b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}')
    await wait_for(lambda: not router.inflight)
    assert metrics.registry.get_sample_value("picker_usage_tokens_total", {"kind": "prompt_tokens"}) == 7


async def test_buffered_rewrite_sends_new_body_and_content_length(picker):
    _, stub, _, _ = picker
    _, (_, ans) = await c.send_buffered(stub, c.post_headers(), body(model="qwq-alias", prompt="hi"))
    common = ans.request_body.response
    new = common.body_mutation.body
    assert json.loads(new)["model"] == "qwq"
    assert c.set_headers(common)["content-length"] == str(len(new))


@pytest.mark.parametrize("prompt_bytes", [100, 1024 * 1024])
async def test_full_duplex_holds_headers_then_echoes_body_in_chunks(picker, prompt_bytes):
    router, stub, _, _ = picker
    raw = body(model="qwq-alias", prompt="z" * prompt_bytes)
    call, answers = await c.send_full_duplex(stub, c.post_headers(), raw)
    head = answers[0]
    assert head.HasField("request_headers")
    common = head.request_headers.response
    hdrs = c.set_headers(common)
    assert common.clear_route_cache and hdrs[DEST] in router.endpoints
    assert c.lb_destination(head) == hdrs[DEST]
    chunks = [a.request_body.response.body_mutation.streamed_response for a in answers[1:]]
    assert all(len(ch.body) <= 62_000 for ch in chunks)
    assert [ch.end_of_stream for ch in chunks] == [False] * (len(chunks) - 1) + [True]
    echoed = b"".join(ch.body for ch in chunks)
    assert json.loads(echoed)["model"] == "qwq" and len(json.loads(echoed)["prompt"]) == prompt_bytes
    assert hdrs["content-length"] == str(len(echoed))
    await call.done_writing()
    await wait_for(lambda: not router.inflight)  # stream closed without a response phase: done


async def test_full_duplex_response_body_is_echoed_and_sse_usage_recorded(picker):
    router, stub, _, metrics = picker
    call = stub.Process()
    await call.write(c.request_headers(c.post_headers(), mode=c.FULL_DUPLEX, response_mode=c.FULL_DUPLEX))
    await call.write(c.request_body(body(stream=True), True))
    assert (await call.read()).HasField("request_headers")
    assert (await call.read()).request_body.response.body_mutation.streamed_response.end_of_stream
    await call.write(c.response_headers("text/event-stream"))
    await call.read()
    sse = (b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":11,'
           b'"completion_tokens":2}}\n\ndata: [DONE]\n\n')
    for i, piece in enumerate([sse[:40], sse[40:70], sse[70:]]):
        await call.write(c.response_body(piece, i == 2))
        out = (await call.read()).response_body.response.body_mutation.streamed_response
        assert out.body == piece and out.end_of_stream == (i == 2)
    await wait_for(lambda: not router.inflight)  # the compiled server tells the loop just after
    assert metrics.registry.get_sample_value("picker_usage_tokens_total", {"kind": "completion_tokens"}) == 2
    await call.done_writing()


async def test_bodiless_get_is_routed_on_headers(picker):
    router, stub, _, _ = picker
    for mode in (c.BUFFERED, c.FULL_DUPLEX):
        call = stub.Process()
        await call.write(c.request_headers({":method": "GET", ":path": "/v1/models"}, eos=True, mode=mode))
        resp = await call.read()
        assert c.set_headers(resp.request_headers.response)[DEST] in router.endpoints
        await call.write(c.response_headers(eos=True))
        await call.read()
        await call.done_writing()
    await wait_for(lambda: not router.inflight)


async def test_subset_hint_from_metadata(picker):
    _, stub, _, _ = picker
    for subset in (["10.0.0.2:8000"], "10.0.0.2:8000"):
        _, answers = await c.send_full_duplex(stub, c.post_headers(), body(), subset=subset)
        assert c.set_headers(answers[0].request_headers.response)[DEST] == "10.0.0.2:8000"


async def assert_immediate(answers, status, code):
    imm = answers[-1].immediate_response
    assert imm.status.code == status
    err = json.loads(imm.body)["error"]
    assert err["code"] == code and err["message"]
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"] == b"application/json"


ERROR_CASES = [
    ("bad json", lambda r: None, b"{oops", {}, None, 400, "invalid_json"),
    ("no model", lambda r: None, b'{"prompt":"x"}', {}, None, 400, "missing_model"),
    ("wrong type", lambda r: None, b'{"model":["qwq"]}', {}, None, 400, "invalid_type"),
    ("too large", lambda r: None, body(prompt="x" * (2 * 1024 * 1024 + 10)), {}, None, 413, "body_too_large"),
    ("unknown model", lambda r: None, body(model="gpt-9"), {}, None, 404, "model_not_found"),
    ("no ready endpoint", lambda r: [r.on_scrape_failed(a) for a in r.endpoints], body(), {}, None, 503,
     "no_ready_endpoint"),
    ("empty subset", lambda r: None, body(), {}, [], 503, "no_endpoint_in_subset"),
    ("shed", lambda r: [r.on_scrape_ok(a, metrics_text(waiting=9)) for a in r.endpoints], body(),
     {"x-gateway-inference-objective": "batch"}, None, 429, "pool_saturated"),
]


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
@pytest.mark.parametrize("case", ERROR_CASES, ids=[e[0] for e in ERROR_CASES])
async def test_errors_are_immediate_openai_json(picker, mode, case):
    router, stub, servers, _ = picker
    _, prepare, raw, headers, subset, status, code = case
    prepare(router)
    send = c.send_buffered if mode == "buffered" else c.send_full_duplex
    call, answers = await send(stub, c.post_headers(**headers), raw, subset=subset)
    await assert_immediate(answers, status, code)
    assert await call.read() == grpc.aio.EOF  # the picker ends the stream after an immediate response
    assert not router.inflight


async def test_health_services(picker):
    _, _, servers, _ = picker
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await servers.set_ready(False)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_concurrent_streams_all_routed(picker):
    router, stub, _, _ = picker

    async def one(i):
        call, answers = await c.send_full_duplex(stub, c.post_headers(), body(prompt=f"p{i}"))
        await call.done_writing()
        return c.set_headers(answers[0].request_headers.response)[DEST]

    dests = await asyncio.gather(*(one(i) for i in range(30)))
    assert set(dests) <= set(router.endpoints) and len(set(dests)) == 3
    await wait_for(lambda: not router.inflight)


async def test_internal_error_is_a_500_answer_not_a_broken_stream(picker, monkeypatch):
    router, stub, _, _ = picker

    def broken(info):
        raise RuntimeError("bug")
    monkeypatch.setattr(router, "decide", broken)
    call, answers = await c.send_full_duplex(stub, c.post_headers(), body())
    imm = answers[-1].immediate_response
    assert imm.status.code == 500 and json.loads(imm.body)["error"]["code"] == "internal_error"


async def test_health_on_the_ext_proc_port_follows_readiness(picker):
    """Envoy's active health check asks the ext_proc port itself (over its TLS, when on)."""
    _, _, servers, _ = picker
    ch = c.channel(servers.grpc_port, servers.certificate)
    try:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status(name):
            return (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
        SERVING, NOT = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("envoy.service.ext_proc.v3.ExternalProcessor", "", "readiness", "liveness"):
            assert await status(name) == SERVING
        assert await status("warm") == NOT          # not set by this fixture
        await servers.set_ready(False)
        await servers.set_warm(True)
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == NOT
        assert await status("warm") == SERVING and await status("liveness") == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await ch.close()


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_end_answered_streams_ends_each_stream_once_answered(ext_proc_server, mode):
    """--end-answered-streams: the stream ends (OK) right after the answer, without waiting for
    Envoy to close it at the response's end; the in-flight count ends there."""
    router = make_router(profile="default", n=2, waiting=0, kv=0.1)
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1",
                                  server=ext_proc_server, end_answered=True)
    await servers.set_ready(True)
    ch = c.channel(servers.grpc_port, None)
    try:
        send = c.send_buffered if mode == "buffered" else c.send_full_duplex
        call, answers = await send(c.ep_stub(ch), c.post_headers(), body(prompt="hi"))
        assert {c.lb_destination(a) for a in answers} & set(router.endpoints)
        assert await asyncio.wait_for(call.code(), 2.0) == grpc.StatusCode.OK
        await wait_for(lambda: not router.inflight)
    finally:
        await ch.close()
        await servers.stop(0)
