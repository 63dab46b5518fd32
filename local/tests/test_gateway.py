"""Unit tests of the local gateway against in-test fakes (upstreams and an ext_proc server)."""

from __future__ import annotations

import asyncio
import datetime
import json
import random

import aiohttp
import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from local.gateway import Gateway, GatewayConfig
from local.gateway.__main__ import config_from_args, parse_args
from local.gateway.balancer import Endpoint, LeastRequest, Route
from local.gateway.extproc import HeaderMap, apply_header_mutation
from local.gateway.server import first_endpoint
from local.tests.gateway_fakes import Decision, FakePicker, FakeUpstream, free_port

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import wrappers_pb2

MODES = ["BUFFERED", "FULL_DUPLEX_STREAMED"]


# -- balancing ---------------------------------------------------------------------------------

class ScriptedRng(random.Random):
    def __init__(self, picks):
        super().__init__(0)
        self._picks = list(picks)

    def choice(self, seq):
        return seq[self._picks.pop(0)]


def test_least_request_keeps_the_less_loaded_of_two_draws():
    eps = [Endpoint("a:1", 3), Endpoint("b:1", 1), Endpoint("c:1", 2)]
    lr = LeastRequest(eps, ScriptedRng([0, 1, 2, 0, 2, 2]))
    assert lr.pick().address == "b:1"   # a(3) vs b(1)
    assert lr.pick().address == "c:1"   # c(2) vs a(3)
    assert lr.pick().address == "c:1"   # same host drawn twice


def test_least_request_never_picks_the_busiest_of_three_more_than_both_draws_allow():
    eps = [Endpoint("a:1", 0), Endpoint("b:1", 1), Endpoint("c:1", 5)]
    lr = LeastRequest(eps, random.Random(1))
    picks = [lr.pick().address for _ in range(9000)]
    # c wins only when drawn twice: p = 1/9 -> 1000 expected, sd ~30.
    assert 850 < picks.count("c:1") < 1150
    assert picks.count("a:1") > picks.count("b:1") > picks.count("c:1")


def test_weighted_groups_split_by_weight():
    route = Route.build([("stable", 90, ["a:1", "b:1"]), ("canary", 10, ["c:1"])], seed=3)
    picks = [route.pick().address for _ in range(10000)]
    # binomial(10000, 0.1): sd 30
    assert 850 < picks.count("c:1") < 1150


def test_route_rejects_bad_weights():
    with pytest.raises(ValueError):
        Route.build([("a", 0, ["a:1"])])


def test_cli_groups_and_defaults():
    args = parse_args(["--group", "stable:90=127.0.0.1:1,127.0.0.1:2", "--group", "canary:10=127.0.0.1:3",
                       "--body-mode", "full-duplex"])
    config = config_from_args(args)
    assert config.route == [("stable", 90, ["127.0.0.1:1", "127.0.0.1:2"]), ("canary", 10, ["127.0.0.1:3"])]
    assert config.request_body_mode == config.response_body_mode == "FULL_DUPLEX_STREAMED"
    assert config_from_args(parse_args(["--endpoints", "127.0.0.1:1"])).response_body_mode == "SKIP"
    with pytest.raises(SystemExit):
        parse_args(["--group", "stable=127.0.0.1:1"])


def test_first_endpoint_of_a_list():
    assert first_endpoint("10.0.0.1:8000,10.0.0.2:8000") == "10.0.0.1:8000"
    assert first_endpoint("bogus, 10.0.0.2:8000") == "10.0.0.2:8000"
    assert first_endpoint("") is None


def test_header_mutation_follows_envoy_rules():
    h = HeaderMap([(":authority", "x"), ("a", "1"), ("b", "2")])
    option = base_pb2.HeaderValueOption
    apply_header_mutation(h, pb.HeaderMutation(
        set_headers=[option(header=base_pb2.HeaderValue(key="a", raw_value=b"9")),
                     option(header=base_pb2.HeaderValue(key="c", raw_value=b"3"),
                            append=wrappers_pb2.BoolValue(value=True)),
                     option(header=base_pb2.HeaderValue(key="c", raw_value=b"4"),
                            append=wrappers_pb2.BoolValue(value=True)),
                     option(header=base_pb2.HeaderValue(key=":authority", raw_value=b"evil")),
                     option(header=base_pb2.HeaderValue(key="x-envoy-foo", raw_value=b"1"))],
        remove_headers=["b"]), is_request=True)
    assert h.get("a") == "9" and h.get("b") is None and h.get(":authority") == "x"
    assert [v for k, v in h.items if k == "c"] == ["3", "4"]
    assert h.get("x-envoy-foo") is None


# -- listeners ---------------------------------------------------------------------------------

@pytest.fixture
async def upstreams():
    ups = [await FakeUpstream(n).start() for n in ("u0", "u1", "u2")]
    yield ups
    for u in ups:
        await u.stop()


def by_model(headers, body):
    """The fake picker sends a request to the upstream named in the model ("to:127.0.0.1:port")
    and rewrites the model to "qwq"."""
    payload = json.loads(body) if body else {}
    target = payload.get("model", "")
    if target.startswith("shed"):
        return Decision(immediate=(429, b'{"error": {"message": "shed"}}'))
    endpoint = target[3:] if target.startswith("to:") else headers.get("x-test-endpoint")
    new = json.dumps(dict(payload, model="qwq-rewritten-" + "x" * 20)).encode() if payload else None
    return Decision(endpoint=endpoint, body=new)


async def start_gateway(upstreams, picker_port, **overrides) -> Gateway:
    config = GatewayConfig(route=[("default", 1, [u.address for u in upstreams])], http_port=free_port(),
                           llm_port=free_port(), admin_port=free_port(), picker=f"127.0.0.1:{picker_port}",
                           seed=1, **overrides)
    gateway = Gateway(config)
    await gateway.start()
    return gateway


@pytest.fixture
async def client():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("mode", MODES)
async def test_llm_listener_routes_to_the_picked_endpoint_with_mutations(mode, upstreams, client):
    picker = await FakePicker(mode, by_model).start()
    gw = await start_gateway(upstreams, picker.port, request_body_mode=mode,
                             response_body_mode="FULL_DUPLEX_STREAMED" if mode != "BUFFERED" else "NONE")
    try:
        for target in (upstreams[2], upstreams[0], upstreams[2]):
            async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions",
                                   json={"model": f"to:{target.address}", "prompt": "hi"}) as r:
                assert r.status == 200
                data = await r.json()
                assert r.headers["x-gateway-served-by"] == target.address
                assert r.headers["x-picker-saw-response"] == "1"
            assert data["served_by"] == target.name
            assert data["model"].startswith("qwq-rewritten-")
            seen = target.requests[-1]
            assert int(seen["headers"]["Content-Length"]) == len(seen["body"])
            assert seen["headers"]["x-gateway-destination-endpoint"] == target.address
        assert upstreams[1].requests == []
        stats = (await (await client.get(f"http://127.0.0.1:{gw.config.admin_port}/gateway/stats")).json())
        assert stats["llm-gw"]["served"] == {upstreams[2].address: 2, upstreams[0].address: 1}
        assert stats["llm-gw"]["picked"] == stats["llm-gw"]["served"]
        assert stats["llm-gw"]["fallback"] == 0 and stats["llm-gw"]["metadata_mismatch"] == 0
        # Envoy's sequence, per mode; the stream ends when the response is done.
        await asyncio.sleep(0)
        kinds = picker.streams[0].kinds
        if mode == "BUFFERED":
            assert kinds == ["request_headers", "request_body", "response_headers"]
        else:
            assert kinds[:2] == ["request_headers", "request_body"] and kinds[2] == "response_headers"
            assert set(kinds[3:]) == {"response_body"}
        assert picker.streams[0].headers[":path"] == "/v1/completions"
        config, = picker.streams[0].protocol_config  # on the first message only
        assert config.request_body_mode == (2 if mode == "BUFFERED" else 4)
        assert "x-request-id" in picker.streams[0].headers
        for _ in range(100):
            if all(s.closed for s in picker.streams):
                break
            await asyncio.sleep(0.01)
        assert all(s.closed for s in picker.streams)
    finally:
        await gw.stop()
        await picker.stop()


@pytest.mark.parametrize("mode", MODES)
async def test_streaming_passes_chunk_by_chunk(mode, upstreams, client):
    picker = await FakePicker(mode, lambda h, b: Decision(endpoint=upstreams[1].address)).start()
    gw = await start_gateway(upstreams, picker.port, request_body_mode=mode,
                             response_body_mode="FULL_DUPLEX_STREAMED" if mode != "BUFFERED" else "NONE")
    try:
        for port in (gw.config.http_port, gw.config.llm_port):
            upstreams[1].gate.clear()
            for u in upstreams:
                u.gate.clear()
            async with client.get(f"http://127.0.0.1:{port}/gate") as r:
                assert r.status == 200
                first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 10)
                assert first == b"data: first\n\n"  # arrived while the upstream still holds the rest
                for u in upstreams:
                    u.gate.set()
                assert await r.content.read() == b"data: second\n\n"
        # a long SSE stream arrives complete and in order
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions",
                               json={"model": "qwq", "stream": True, "max_tokens": 500}) as r:
            text = (await r.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert len(events) == 501 and events[-1] == "data: [DONE]"
        assert [json.loads(e[6:])["i"] for e in events[:-1]] == list(range(500))
    finally:
        await gw.stop()
        await picker.stop()


@pytest.mark.parametrize("mode", MODES)
async def test_immediate_response_and_bodiless_request(mode, upstreams, client):
    picker = await FakePicker(mode, by_model).start()
    gw = await start_gateway(upstreams, picker.port, request_body_mode=mode)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions",
                               json={"model": "shed-me"}) as r:
            assert r.status == 429
            assert r.headers["content-type"] == "application/json"
            assert (await r.json())["error"]["message"] == "shed"
        assert all(u.requests == [] for u in upstreams)
        async with client.get(f"http://127.0.0.1:{gw.config.llm_port}/v1/models",
                              headers={"x-test-endpoint": upstreams[1].address}) as r:
            assert r.status == 200 and (await r.json())["served_by"] == "u1"
        assert picker.streams[-1].kinds[0] == "request_headers" and "request_body" not in picker.streams[-1].kinds
    finally:
        await gw.stop()
        await picker.stop()


async def test_unknown_or_missing_destination_falls_back_to_least_request(upstreams, client):
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint="10.9.9.9:1")).start()
    gw = await start_gateway(upstreams, picker.port)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 200
        stats = gw.stats["llm-gw"]
        assert stats.fallback == 1 and sum(stats.served.values()) == 1
    finally:
        await gw.stop()
        await picker.stop()


async def test_statuses_pass_through_and_dead_upstream_is_503(upstreams, client):
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint=upstreams[0].address)).start()
    gw = await start_gateway(upstreams, picker.port)
    try:
        for port in (gw.config.http_port, gw.config.llm_port):
            async with client.get(f"http://127.0.0.1:{port}/status/418") as r:
                assert r.status == 418 and (await r.json())["error"]["code"] == 418
        await upstreams[0].stop()
        async with client.get(f"http://127.0.0.1:{gw.config.llm_port}/status/200") as r:
            assert r.status == 503
            assert "upstream connect error" in await r.text()
        await upstreams[0].start()
    finally:
        await gw.stop()
        await picker.stop()


@pytest.mark.parametrize("fail_open", [False, True])
async def test_picker_unreachable(fail_open, upstreams, client):
    gw = await start_gateway(upstreams, free_port(), fail_open=fail_open)  # nothing listens there
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == (200 if fail_open else 503)
        async with client.post(f"http://127.0.0.1:{gw.config.http_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 200
        assert gw.stats["llm-gw"].picker_errors == 1
    finally:
        await gw.stop()


async def test_message_timeout_fails_close(upstreams, client):
    picker = await FakePicker("BUFFERED", by_model).start()
    picker.silent = True
    gw = await start_gateway(upstreams, picker.port, message_timeout=0.3)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 503
        assert all(u.requests == [] for u in upstreams)
    finally:
        await gw.stop()
        await picker.stop()


async def test_wrong_content_length_from_processor_is_rejected(upstreams, client):
    def decide(h, b):
        return Decision(endpoint=upstreams[0].address, body=b'{"model": "longer-model-name"}', content_length="7")
    picker = await FakePicker("BUFFERED", decide).start()
    gw = await start_gateway(upstreams, picker.port)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 503
        assert upstreams[0].requests == []
    finally:
        await gw.stop()
        await picker.stop()


async def test_request_timeout_and_buffer_limit(upstreams, client):
    for u in upstreams:
        u.delay = 2.0
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint=upstreams[0].address)).start()
    gw = await start_gateway(upstreams, picker.port, request_timeout=0.3, buffer_limit=1000)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.http_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 504
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions",
                               json={"model": "q", "prompt": "x" * 2000}) as r:
            assert r.status == 413
    finally:
        await gw.stop()
        await picker.stop()


def self_signed() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "picker.local")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("picker.local")]), critical=False)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))


async def test_tls_to_the_picker_without_verification(upstreams, client):
    key, cert = self_signed()
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint=upstreams[2].address)).start(
        grpc.ssl_server_credentials([(key, cert)]))
    gw = await start_gateway(upstreams, picker.port, picker_tls=True)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
            assert r.status == 200 and r.headers["x-gateway-served-by"] == upstreams[2].address
    finally:
        await gw.stop()
        await picker.stop()


@pytest.mark.parametrize("response_mode,expected", [
    ("SKIP", ["request_headers", "request_body"]),
    ("STREAMED", ["request_headers", "request_body", "response_headers", "response_body"]),
])
async def test_response_processing_modes(response_mode, expected, upstreams, client):
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint=upstreams[0].address)).start()
    gw = await start_gateway(upstreams, picker.port, response_body_mode=response_mode)
    try:
        async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions",
                               json={"model": "q", "stream": True, "max_tokens": 50}) as r:
            text = await r.text()
        assert text.count("data: ") == 51 and text.endswith("data: [DONE]\n\n")
        for _ in range(100):  # the stream ends when the HTTP response is done
            if picker.streams[0].closed:
                break
            await asyncio.sleep(0.01)
        kinds = picker.streams[0].kinds
        assert picker.streams[0].closed
        assert list(dict.fromkeys(kinds)) == expected
    finally:
        await gw.stop()
        await picker.stop()


async def test_weighted_llm_route_overrides_only_inside_the_drawn_cluster(upstreams, client):
    """Envoy draws the weighted cluster before the endpoint override: an override naming a host of
    the other cluster falls back to least request inside the drawn one."""
    picker = await FakePicker("BUFFERED", lambda h, b: Decision(endpoint=upstreams[2].address)).start()
    gw = await start_gateway(
        upstreams, picker.port,
        llm_route=[("stable", 50, [upstreams[0].address, upstreams[1].address]), ("canary", 50, [upstreams[2].address])])
    try:
        served = []
        for _ in range(40):
            async with client.post(f"http://127.0.0.1:{gw.config.llm_port}/v1/completions", json={"model": "q"}) as r:
                served.append(r.headers["x-gateway-served-by"])
        on_canary = served.count(upstreams[2].address)
        assert 5 < on_canary < 35  # ~50 %, never all 40 although the picker always named the canary
        assert gw.stats["llm-gw"].fallback == 40 - on_canary
    finally:
        await gw.stop()
        await picker.stop()
