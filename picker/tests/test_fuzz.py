"""Fuzz the request path: whatever the body, the answer is a decision or a 4xx, never a crash,
and the gRPC server keeps serving."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from picker.core import PickerError, RequestInfo, RouterSettings
from picker.protocol.server import start_servers

from tests.helpers import extproc_client as c
from helpers import body, make_router

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30)
request_objects = st.fixed_dictionaries(
    {}, optional={"model": json_values | st.just("qwq"), "prompt": json_values,
                  "messages": json_values, "max_tokens": json_values, "stream": json_values})
bodies = st.one_of(
    st.binary(max_size=300),
    request_objects.map(lambda o: json.dumps(o).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 3000).map(lambda n: b'{"model":"qwq","prompt":' + b"[" * n + b"]" * n + b"}"),
    st.text(max_size=200).map(lambda t: json.dumps({"model": "qwq", "prompt": t}).encode("utf-8", "surrogatepass")),
    st.binary(max_size=50).map(lambda b: b'{"model":"qwq","prompt":"' + b + b'"}'),
    st.integers(1, 60_000).map(lambda n: b'{"model":"qwq","prompt":[' + b"7," * n + b'7]}'),  # huge
    st.integers(1, 5000).map(lambda n: b'{"model":"qwq","max_tokens":1' + b"0" * n + b"}"),  # huge int
)

ROUTER = make_router(n=3, settings=RouterSettings(max_body_bytes=100_000))


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=bodies, headers=st.dictionaries(st.sampled_from(
    ["x-gateway-inference-objective", "x-request-id", "x-gateway-destination-endpoint"]),
    st.text(max_size=20), max_size=3))
def test_router_answers_decision_or_4xx(raw, headers):
    try:
        d = ROUTER.decide(RequestInfo("/v1/completions", headers, raw))
    except PickerError as err:
        assert 400 <= err.status < 500 and json.loads(err.openai_body())["error"]["code"] == err.code
    else:
        assert d.endpoint in ROUTER.endpoints
        ROUTER.on_request_done(d.request_id)


async def test_grpc_stream_always_ends_with_4xx_or_route_and_server_stays_healthy(ext_proc_server):
    router = make_router(n=3, settings=RouterSettings(max_body_bytes=100_000))
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", server=ext_proc_server)
    ch = c.channel(servers.grpc_port, None)
    stub = c.ep_stub(ch)
    results = []

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(raw=bodies, full_duplex=st.booleans())
    def collect(raw, full_duplex):
        results.append((raw, full_duplex))

    collect()
    try:
        for raw, full_duplex in results:
            send = c.send_full_duplex if full_duplex else c.send_buffered
            call, answers = await send(stub, c.post_headers(), raw)
            last = answers[-1]
            if last.HasField("immediate_response"):
                assert 400 <= last.immediate_response.status.code < 500
            else:
                assert last.HasField("request_body")
            call.cancel()
        _, answers = await c.send_full_duplex(stub, c.post_headers(), body())
        assert answers[0].HasField("request_headers")  # still routing normally
    finally:
        await ch.close()
        await servers.stop(0)
