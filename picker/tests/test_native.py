"""The compiled ext_proc transport's own tests (the protocol suites, test_protocol.py,
test_limits.py, test_flowcontrol.py and test_fuzz.py, run against it and the pure-Python server
alike; the protocol logic also has Rust unit tests: `cargo test` in picker/). Here: its
hand-written messages against Envoy's descriptors, its constants against the Python server's,
the transport-neutral answer reaching Envoy whole, the ports shared by workers, start errors."""
import asyncio
import sys

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401 (registers the types)
from grpc_health.v1 import health_pb2  # noqa: F401 (registers the health messages)
from google.protobuf import descriptor_pool

from picker.protocol import answers, extproc, messages
from picker.protocol.limits import ServerLimits
from picker.protocol.native import NativeExtProc, load_extension
from picker.protocol.server import start_servers

from tests.helpers import extproc_client as c
from helpers import body, make_router

ext = load_extension()


def test_hand_written_messages_match_envoys_field_numbers():
    pool = descriptor_pool.Default()
    for message, field, number in ext.FIELDS:
        d = pool.FindMessageTypeByName(message)
        assert d.fields_by_name[field].number == number, (message, field)
    assert ext.OVERWRITE_IF_EXISTS_OR_ADD == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert ext.FULL_DUPLEX == extproc.FULL_DUPLEX


def test_protocol_constants_are_the_python_servers():
    assert tuple(ext.CONTROL_HEADERS) == answers.CONTROL_HEADERS
    assert (ext.SUBSET_NAMESPACE, ext.SUBSET_HEADER) == (answers.SUBSET_NAMESPACE, answers.SUBSET_HEADER)
    assert ext.BODY_CHUNK_BYTES == messages.BODY_CHUNK_BYTES


@pytest.mark.parametrize("mode", ["buffered", "full-duplex"])
async def test_metadata_and_headers_added_in_python_reach_envoy_on_both_servers(
        monkeypatch, ext_proc_server, mode):
    """What answers.py writes is what Envoy gets, whatever the server: a new header and dynamic
    metadata of every JSON type, with no change to the compiled code."""
    base = extproc.route_answer

    def richer(d, info, bodiless, full_duplex):
        a = base(d, info, bodiless, full_duplex)
        a.set_headers.append(("x-picker-outcome", "test"))
        a.metadata["picker.outcome"] = {"tokens": 42, "ratio": 0.5, "cached": True, "none": None,
                                        "tags": ["a", 1], "nested": {"k": "v"}}
        return a
    monkeypatch.setattr(extproc, "route_answer", richer)
    router = make_router(n=2)
    servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", server=ext_proc_server)
    ch = c.channel(servers.grpc_port, None)
    try:
        send = c.send_buffered if mode == "buffered" else c.send_full_duplex
        _, answers_ = await send(c.ep_stub(ch), c.post_headers(), body())
        routed = answers_[-1] if mode == "buffered" else answers_[0]
        common = routed.request_body.response if mode == "buffered" else routed.request_headers.response
        assert c.set_headers(common)["x-picker-outcome"] == "test"
        md = routed.dynamic_metadata.fields["picker.outcome"].struct_value
        assert md.fields["tokens"].number_value == 42 and md.fields["cached"].bool_value
        assert md.fields["none"].WhichOneof("kind") == "null_value"
        assert [v.WhichOneof("kind") for v in md.fields["tags"].list_value.values] == \
            ["string_value", "number_value"]
        assert md.fields["nested"].struct_value.fields["k"].string_value == "v"
        assert c.lb_destination(routed) in router.endpoints
    finally:
        await ch.close()
        await servers.stop(0)


async def test_workers_share_one_port_and_each_routes():
    routers = [make_router(n=2), make_router(n=2)]
    first = NativeExtProc(routers[0], ServerLimits(), host="127.0.0.1")
    second = NativeExtProc(routers[1], ServerLimits(), host="127.0.0.1", port=first.port)
    for s in (first, second):
        s.start()
    try:
        assert second.port == first.port
        for _ in range(8):  # a new connection each time: the kernel spreads them
            ch = c.channel(first.port, None)
            _, answers_ = await c.send_buffered(c.ep_stub(ch), c.post_headers(), body())
            assert c.lb_destination(answers_[-1])
            await ch.close()
    finally:
        await asyncio.gather(first.stop(0), second.stop(0))


async def test_a_bad_certificate_fails_at_start_with_the_reason(tmp_path):
    (tmp_path / "tls.crt").write_bytes(b"not a certificate")
    (tmp_path / "tls.key").write_bytes(b"not a key")
    with pytest.raises(ValueError, match="TLS"):
        await start_servers(make_router(n=1), 0, 0, secure=True, cert_path=str(tmp_path),
                            host="127.0.0.1", server="native")


def test_a_missing_build_names_the_fix(monkeypatch):
    import picker
    monkeypatch.setitem(sys.modules, "picker._extproc", None)  # import fails
    monkeypatch.delattr(picker, "_extproc", raising=False)
    with pytest.raises(ValueError, match="make setup.*--ext-proc-server python"):
        load_extension()
