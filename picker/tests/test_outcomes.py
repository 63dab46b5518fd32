"""The outcome path inside the picker: access log entries parsed into Outcomes (real entries
captured from Envoy 1.39 by capture_als.py, and hand-made ones for what a capture cannot show),
the access log server, the relay to the workers, the Router's metrics, and what the picker writes
into its answer for the outcome to bring back."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from google.protobuf import json_format

from picker.accesslog import start_server
from picker.observability.metrics import PickerMetrics
from picker.protocol import messages as msg
from picker.protocol.answers import RouteAnswer
from picker.protocol.server import start_servers
from picker.runtime import build_router
from picker.config import parse_args
from picker.signals.outcomes import Outcome, parse_entries, parse_entry

from tests.helpers import extproc_client as c
from helpers import body, make_router

DATA = Path(__file__).parent / "data" / "als-envoy-1.39.jsonl"
START = 1_800_000_000.0  # wall-clock start of the hand-made entries


def captured() -> list[dict]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert len(rows) >= 10, f"{DATA}: the captured entries are missing (picker/tests/capture_als.py)"
    return rows


def entry_of(d: dict) -> al.HTTPAccessLogEntry:
    return json_format.ParseDict(d, al.HTTPAccessLogEntry())


def outcome_of(entry, received_at=5.0, wall_now=None) -> Outcome:
    return Outcome(*parse_entry(entry, received_at, START + 100 if wall_now is None else wall_now))


def entry(picker=None, tokens=None, status=200, address="10.1.2.3", port=8000, duration=2.5,
          client="team-a") -> al.HTTPAccessLogEntry:
    e = al.HTTPAccessLogEntry()
    cp = e.common_properties
    cp.start_time.FromNanoseconds(int(START * 1e9))
    cp.time_to_last_downstream_tx_byte.FromNanoseconds(int(duration * 1e9))
    cp.upstream_remote_address.socket_address.address = address
    cp.upstream_remote_address.socket_address.port_value = port
    if picker is not None:
        cp.metadata.filter_metadata["llm-serving.picker"].update(picker)
    if tokens is not None:
        cp.metadata.filter_metadata["llm-serving.tokens"].update(tokens)
    if client:
        e.request.request_headers["x-client-id"] = client
    e.response.response_code.value = status
    return e


# ---- the real entries ------------------------------------------------------------------------

@pytest.mark.parametrize("row", captured(), ids=lambda r: f"{r['body_mode']}-{r['name']}")
def test_captured_entries_become_the_outcome_the_client_saw(row):
    """One entry per request, from real Envoy 1.39 in both body modes; what the client saw (status,
    usage, its own first-token time) is what the outcome says."""
    assert len(row["entries"]) == 1
    o = outcome_of(entry_of(row["entries"][0]), wall_now=0.0)
    seen = row["client"]
    assert o.status == seen["status"]
    assert o.endpoint.startswith("127.0.0.1:") and int(o.endpoint.rsplit(":", 1)[1]) > 0
    assert o.request_id and o.model == "qwq" and o.client == "loadtest" and o.features == ""
    assert 0 < o.duration <= seen["client_duration_s"]
    if seen["status"] == 200 and seen["usage"]:
        assert (o.prompt_tokens, o.completion_tokens) == (seen["usage"]["prompt_tokens"],
                                                          seen["usage"]["completion_tokens"])
    else:
        assert o.prompt_tokens is None and o.completion_tokens is None
    if seen["client_ttft_s"] is not None:  # streamed: the gateway saw the first token first
        assert 0 < o.ttft <= seen["client_ttft_s"] and o.ttft <= o.duration
    else:
        assert o.ttft is None


def test_captured_streams_send_headers_before_the_first_token():
    """Why the first token's time comes from the Lua stamp: the upstream's first byte (its
    headers) arrives long before its first token (prefill), so time_to_first_upstream_rx_byte is
    not a TTFT."""
    for row in captured():
        if row["client"]["client_ttft_s"] is None:
            continue
        e = entry_of(row["entries"][0])
        first_byte = e.common_properties.time_to_first_upstream_rx_byte.ToTimedelta().total_seconds()
        ttft = outcome_of(e).ttft
        assert first_byte < ttft / 2, (row["name"], first_byte, ttft)


def test_captured_request_ids_are_distinct():
    ids = [outcome_of(entry_of(r["entries"][0])).request_id for r in captured()]
    assert len(set(ids)) == len(ids)


# ---- hand-made entries -------------------------------------------------------------------------

def test_every_field():
    e = entry(picker={"request_id": "ab12.0.7", "model": "qwq", "features": "c=1"},
              tokens={"prompt_tokens": 120, "completion_tokens": 37, "first_token_us": (START + 0.4) * 1e6})
    o = outcome_of(e, received_at=42.0, wall_now=START + 3.0)
    assert o == Outcome("ab12.0.7", "10.1.2.3:8000", 200, 120, 37, pytest.approx(0.4, abs=1e-6), 2.5,
                        "team-a", "qwq", "c=1", 42.0, pytest.approx(0.5))


def test_an_entry_without_metadata_has_no_id_tokens_or_ttft():
    o = outcome_of(entry(client="", address="", port=0, status=503))
    assert (o.request_id, o.endpoint, o.status, o.client, o.model, o.features) == ("", "", 503, "", "", "")
    assert (o.prompt_tokens, o.completion_tokens, o.ttft) == (None, None, None)


@pytest.mark.parametrize("bad", [-1, 1.5, "12", 2 ** 60, True])
def test_token_counts_that_are_not_counts_are_none(bad):
    o = outcome_of(entry(tokens={"prompt_tokens": bad, "completion_tokens": 4}))
    assert o.prompt_tokens is None and o.completion_tokens == 4


@pytest.mark.parametrize("stamp", [START - 1, START + 9, 12345])
def test_a_first_token_outside_the_request_is_no_ttft(stamp):
    assert outcome_of(entry(tokens={"first_token_us": stamp * 1e6})).ttft is None


def test_ipv6_upstream_and_long_strings():
    o = outcome_of(entry(address="fd00::5", picker={"request_id": "x" * 5000, "features": "f" * 9000},
                         client="c" * 900))
    assert o.endpoint == "[fd00::5]:8000"
    assert (len(o.request_id), len(o.features), len(o.client)) == (256, 4096, 256)


def test_duration_without_a_downstream_last_byte():
    """A client that went away: the upstream's last byte, else the entry's duration."""
    e = entry()
    e.common_properties.ClearField("time_to_last_downstream_tx_byte")
    e.common_properties.time_to_last_upstream_rx_byte.FromMilliseconds(1500)
    assert outcome_of(e).duration == 1.5
    e.common_properties.ClearField("time_to_last_upstream_rx_byte")
    e.common_properties.duration.FromMilliseconds(700)
    assert outcome_of(e).duration == pytest.approx(0.7)


# ---- the access log server ---------------------------------------------------------------------

async def send_logs(port: int, batches: list[list[al.HTTPAccessLogEntry]], certificate=None):
    ch = c.channel(port, certificate)
    stub = als_pb2_grpc.AccessLogServiceStub(ch)

    def messages():
        for i, batch in enumerate(batches):
            m = als_pb2.StreamAccessLogsMessage()
            if i == 0:
                m.identifier.log_name = "picker-outcomes"
                m.identifier.node.id = "envoy-1"
            m.http_logs.log_entry.extend(batch)
            yield m

    await stub.StreamAccessLogs(messages())
    await ch.close()


@pytest.mark.parametrize("secure", [False, True])
async def test_the_server_hands_each_batch_to_the_sink(secure):
    got = []
    server, port, receiver = await start_server(got.append, 0, "127.0.0.1", secure=secure)
    try:
        certificate = None
        if secure:  # the self-signed certificate the server made: trust it for this client
            certificate = await asyncio.to_thread(_server_certificate, port)
        e1 = entry(picker={"request_id": "r1"})
        await send_logs(port, [[e1], [entry(picker={"request_id": "r2"}), entry(status=500)]], certificate)
        assert [[Outcome(*f).request_id for f in batch] for batch in got] == [["r1"], ["r2", ""]]
        assert receiver.entries == 3 and receiver.streams == 0
    finally:
        await server.stop(0)


def _server_certificate(port: int) -> bytes:
    import ssl
    return ssl.get_server_certificate(("127.0.0.1", port)).encode()


async def test_a_batch_the_parser_cannot_read_is_counted_and_the_stream_goes_on(monkeypatch):
    import picker.accesslog as accesslog
    got = []
    calls = iter([ValueError("bad"), None])

    def flaky(entries, *a):
        err = next(calls)
        if err:
            raise err
        return parse_entries(entries, *a)

    monkeypatch.setattr(accesslog, "parse_entries", flaky)
    server, port, receiver = await start_server(got.append, 0, "127.0.0.1", secure=False)
    try:
        await send_logs(port, [[entry(), entry()], [entry(picker={"request_id": "ok"})]])
        assert receiver.bad_entries == 2 and [Outcome(*f).request_id for b in got for f in b] == ["ok"]
    finally:
        await server.stop(0)


# ---- what the picker writes, what the Router counts -----------------------------------------

def test_request_ids_are_unique_across_workers_and_replicas():
    args = parse_args(["--discovery", "static", "--endpoints", "10.0.0.1:8000", "--no-precise-prefix"])
    first, second = build_router(args, 0), build_router(args, 1)
    other_replica = build_router(parse_args(["--discovery", "static", "--endpoints", "10.0.0.1:8000",
                                             "--no-precise-prefix"]), 0)
    prefixes = {first.id_prefix, second.id_prefix, other_replica.id_prefix}
    assert len(prefixes) == 3 and first.id_prefix.split(".")[0] == second.id_prefix.split(".")[0]
    assert first.count_outcomes and not second.count_outcomes  # one worker per replica counts
    assert first._matched(second.id_prefix + "9") == "replica"
    assert first._matched(other_replica.id_prefix + "9") == "other" and first._matched("") == "none"


def sample(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_on_outcome_records_operator_metrics():
    metrics = PickerMetrics()
    router = make_router(metrics=metrics)
    router.id_prefix, router.replica_prefix = "abcd.0.", "abcd."
    qwq = dict(endpoint="10.0.0.1:8000", prompt_tokens=10, client="a", model="qwq", features="",
               finished_at=1.0)
    router.on_outcome(Outcome("abcd.1.5", status=200, completion_tokens=300, ttft=0.3, duration=2.0,
                              lag=0.8, **qwq))
    router.on_outcome(Outcome("zzzz.0.1", status=200, completion_tokens=40, ttft=None, duration=1.0, **qwq))
    router.on_outcome(Outcome("", "", 429, None, None, None, 0.01, "a", "someone-else's-model", "", 1.0))
    assert sample(metrics, "picker_outcomes_total", model="qwq", status="200", decision="replica") == 1
    assert sample(metrics, "picker_outcomes_total", model="qwq", status="200", decision="other") == 1
    # a name no endpoint serves is `unknown`: clients cannot create series
    assert sample(metrics, "picker_outcomes_total", model="unknown", status="429", decision="none") == 1
    assert sample(metrics, "picker_outcome_completion_tokens_count", model="qwq") == 2
    assert sample(metrics, "picker_outcome_completion_tokens_sum", model="qwq") == 340
    assert sample(metrics, "picker_outcome_completion_tokens_bucket", model="qwq", le="64.0") == 1
    assert sample(metrics, "picker_outcome_ttft_seconds_count", model="qwq") == 1
    assert sample(metrics, "picker_outcome_ttft_seconds_sum", model="qwq") == pytest.approx(0.3)
    assert sample(metrics, "picker_outcome_lag_seconds_count") == 3
    assert sample(metrics, "picker_outcome_lag_seconds_sum") == pytest.approx(0.8)


def test_only_the_counting_worker_records():
    metrics = PickerMetrics()
    router = make_router(metrics=metrics)
    router.count_outcomes = False
    router.on_outcome(Outcome("x", "", 200, None, 5, None, 1.0, "", "qwq", "", 1.0))
    assert sample(metrics, "picker_outcomes_total", model="qwq", status="200", decision="other") == 0


def test_the_worker_link_hands_outcomes_to_the_router():
    from picker.workers import SignalsLink

    router = make_router()
    seen = []
    router.on_outcome = seen.append
    link = SignalsLink(router, conn=None, peers=False)
    fields = parse_entries([entry(picker={"request_id": "r9", "model": "qwq"})], 3.0, START + 4)
    link._handle(("outcomes", fields))
    assert seen == [Outcome("r9", "10.1.2.3:8000", 200, None, None, None, 2.5, "team-a", "qwq", "", 3.0,
                            pytest.approx(1.5))]


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_the_answer_carries_the_request_id_model_and_features(mode, ext_proc_server):
    router = make_router(n=2)
    router.id_prefix = "ab.0."
    decide = router.decide

    def with_features(info):
        d = decide(info)
        d.features = "client=a;prompt=12"
        return d

    router.decide = with_features
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", server=ext_proc_server)
    ch = c.channel(servers.grpc_port, None)
    try:
        send = c.send_buffered if mode == "buffered" else c.send_full_duplex
        _, answers = await send(c.ep_stub(ch), c.post_headers(), body())
        routed = answers[-1] if mode == "buffered" else answers[0]
        md = json_format.MessageToDict(routed.dynamic_metadata)
        assert md["llm-serving.picker"] == {"request_id": "ab.0.1", "model": "qwq",
                                            "features": "client=a;prompt=12"}
        assert md["envoy.lb"]["x-gateway-destination-endpoint"] in router.endpoints
    finally:
        await ch.close()
        await servers.stop(0)


def test_the_python_transport_renders_the_metadata_as_the_answer_has_it():
    answer = RouteAnswer([], (), {"envoy.lb": {"x-gateway-destination-endpoint": "1.2.3.4:8000"},
                                  "llm-serving.picker": {"request_id": "r", "model": "m", "features": "f"},
                                  "other": {"n": 3, "flag": True}}, None)
    (head,) = msg.route_responses(answer, bodiless=True, full_duplex=False)
    assert json_format.MessageToDict(head.dynamic_metadata) == answer.metadata


# ---- the whole replica: Envoy's stream -> signals process -> worker -> /metrics -------------

async def test_outcomes_reach_the_metrics_of_a_running_picker(tmp_path):
    from helpers import FakeVllm, free_ports, start_app, until
    import urllib.request

    vllm = await FakeVllm().start()
    outcomes_port, = free_ports(1)
    app, metrics_port, maintain = await start_app(["--outcomes-port", str(outcomes_port), "--workers", "1"],
                                                  [vllm.address])
    try:
        await until(lambda: app.router.ready)
        mine = app.router.id_prefix + "1"
        batch = [entry(picker={"request_id": mine, "model": "qwq"}, tokens={"completion_tokens": 77}),
                 entry(status=404)]
        for _ in range(50):  # the signals process serves the port a moment after start
            try:
                await send_logs(outcomes_port, [batch])
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.1)

        def page():
            return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()

        await until(lambda: "picker_outcome_completion_tokens_sum" in page(), timeout=10)
        text = page()
        assert 'picker_outcomes_total{decision="replica",model="qwq",status="200"} 1.0' in text
        assert 'picker_outcomes_total{decision="none",model="",status="404"} 1.0' in text
        assert 'picker_outcome_completion_tokens_sum{model="qwq"} 77.0' in text
    finally:
        app.request_stop()
        await maintain
        await app.stop()
        await vllm.stop()
