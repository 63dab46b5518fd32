"""The whole service with precise prefix routing: `python -m picker` with the tiny model's
tokenizer, endpoints that name their publishers in /kv_event_sources, stand-ins for vLLM's
publishers over ZMQ on loopback; the signals process subscribes, the worker routes on it."""
from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.request

import pytest
from aiohttp import web

from tests.helpers import extproc_client as c
from helpers import FakeVllm, free_ports, metrics_text, start_app, until
from kvpublisher import StandInPublisher
from kvsamples import map_payload, stored
from local.tinymodel.tokenizer import write_tokenizer
from picker.app import App
from picker.config import parse_args
from picker.tokenizer import ModelTokenizer

BS = 16


class VllmWithEvents(FakeVllm):
    """/metrics, /v1/models and /kv_event_sources naming a stand-in publisher (wildcard host,
    as vLLM answers)."""

    def __init__(self, publisher: StandInPublisher | None):
        super().__init__(text=metrics_text(block_size=BS, num_blocks=4000, kv=0.5))
        self.publisher = publisher

    async def sources(self, request):
        if self.publisher is None:
            return web.Response(status=404)
        return web.json_response({"0": {
            "publisher": "zmq", "topic": "kv",
            "endpoint": f"tcp://*:{self.publisher.port}",
            "replay_endpoint": f"tcp://*:{self.publisher.replay_port}"}})

    def routes(self, app: web.Application) -> None:
        super().routes(app)
        app.router.add_get("/kv_event_sources", self.sources)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tiny-model"))


def chat_body(system: str, user: str) -> bytes:
    return json.dumps({"model": "qwq", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()


async def route(app: App, body: bytes) -> str:
    ch = c.channel(app.servers.grpc_port, app.servers.certificate)
    try:
        _, answers = await c.send_full_duplex(
            c.ep_stub(ch), c.post_headers("/v1/chat/completions"), body)
        return c.set_headers(answers[0].request_headers.response)["x-gateway-destination-endpoint"]
    finally:
        await ch.close()


def metrics_page(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


async def test_routes_on_the_engines_events_through_the_signals_process(tok_dir):
    tok = ModelTokenizer(tok_dir)
    pubs = [StandInPublisher(), StandInPublisher()]
    servers = [await VllmWithEvents(p).start() for p in pubs]
    a, b = (s.address for s in servers)
    app, metrics_port, maintain = await start_app(["--tokenizer", str(tok_dir)], [a, b])
    try:
        await until(lambda: app.router.ready, timeout=10)
        index = app.router.precise.index
        await until(lambda: index.in_sync(a) and index.in_sync(b), timeout=15)
        rng = random.Random(5)
        for system, pub in (("alpha " * 400, pubs[1]), ("beta " * 400, pubs[0])):
            tokens = tok.request_tokens("/v1/chat/completions", json.loads(chat_body(system, "q")))
            n = len(tokens) // BS
            pub.publish(map_payload([stored([rng.getrandbits(64) for _ in range(n)], None,
                                            tokens[:n * BS], BS)]))
        await until(lambda: index.size(a) > 0 and index.size(b) > 0, timeout=10)
        for _ in range(3):
            assert await route(app, chat_body("alpha " * 400, "another question")) == b
            assert await route(app, chat_body("beta " * 400, "another question")) == a
        await until(lambda: app.router.precise.status.get(b, (0, 0, 0, (0,)))[3][0] == 1,
                    timeout=5)  # the counters come every KV_STATUS_INTERVAL
        page = await asyncio.to_thread(metrics_page, metrics_port)
        assert 'picker_kv_tokenizer{state="loaded"} 1.0' in page
        assert f'picker_kv_endpoint_in_sync{{endpoint="{a}"}} 1.0' in page
        assert f'picker_kv_endpoint_in_sync{{endpoint="{b}"}} 1.0' in page
        assert f'picker_kv_event_batches_total{{endpoint="{b}"}} 1.0' in page
    finally:
        app.request_stop()
        await maintain
        await app.stop()
        for s in servers:
            await s.stop()
        for p in pubs:
            p.close()


async def test_endpoint_without_events_and_a_missing_tokenizer(tok_dir, tmp_path):
    pub = StandInPublisher()
    servers = [await VllmWithEvents(pub).start(), await VllmWithEvents(None).start()]
    a, b = (s.address for s in servers)
    # b has no /kv_event_sources: the fixed ports, where nothing listens -> falls back
    app, metrics_port, maintain = await start_app(
        ["--tokenizer", str(tok_dir), "--kv-events-port", str(free_ports(1)[0])], [a, b])
    try:
        index = app.router.precise.index
        await until(lambda: index.in_sync(a), timeout=15)
        await until(lambda: b in app.router.precise.status, timeout=5)
        assert not index.in_sync(b)
        page = await asyncio.to_thread(metrics_page, metrics_port)
        assert f'picker_kv_endpoint_in_sync{{endpoint="{b}"}} 0.0' in page
        assert re.search(r'picker_kv_endpoints_fallback\{reason="(syncing|no_events)"\} 1.0', page)
    finally:
        app.request_stop()
        await maintain
        await app.stop()
    app, metrics_port, maintain = await start_app(["--tokenizer", str(tmp_path / "none")], [a, b])
    try:
        assert app.router.precise.state == "missing"
        await until(lambda: app.router.ready, timeout=10)
        assert await route(app, chat_body("x " * 100, "q")) in (a, b)
        page = await asyncio.to_thread(metrics_page, metrics_port)
        assert 'picker_kv_tokenizer{state="missing"} 1.0' in page
        assert app.signals_proc is not None and pub.replay_requests == [0]  # no new subscriber
    finally:
        app.request_stop()
        await maintain
        await app.stop()
    app, metrics_port, maintain = await start_app(["--no-precise-prefix"], [a, b])
    try:
        assert app.router.precise is None
        page = await asyncio.to_thread(metrics_page, metrics_port)
        assert 'picker_kv_tokenizer{state="off"} 1.0' in page
    finally:
        app.request_stop()
        await maintain
        await app.stop()
        for s in servers:
            await s.stop()
        pub.close()


def test_cli_flags_of_precise_routing(tmp_path):
    base = ["--discovery", "static", "--endpoints", "127.0.0.1:8101"]
    a = parse_args(base)
    assert (a.precise_prefix, a.tokenizer, a.kv_events_port, a.kv_replay_port) == (True, None, 5557, 5558)
    a = parse_args(base + ["--no-precise-prefix", "--tokenizer", str(tmp_path),
                           "--kv-events-port", "6000", "--kv-replay-port", "0"])
    assert (a.precise_prefix, a.tokenizer, a.kv_events_port, a.kv_replay_port) == \
        (False, str(tmp_path), 6000, 0)
    for bad in (["--kv-events-port", "0"], ["--kv-events-port", "70000"], ["--kv-replay-port", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


def test_every_worker_applies_the_signals_process_deltas(tok_dir):
    """Workers 1..n-1 get the same ("kv", deltas, status) messages as worker 0 (workers.py)."""
    import multiprocessing as mp

    from helpers import make_router
    from picker.signals.kvstate import KVTracker
    from picker.workers import SignalsLink
    router = make_router("default", n=2)
    router.enable_precise(ModelTokenizer(tok_dir))
    ours, theirs = mp.Pipe()
    link = SignalsLink(router, ours, peers=True)
    tracker = KVTracker()
    addr = next(iter(router.endpoints))
    tracker.add(addr, 0.0, replay=False)
    tracker.on_message(addr, 0, map_payload([stored([1, 2], None, [3] * 32, BS)]), 0.0)
    link._handle(("kv", tracker.take_deltas(), tracker.status()))
    assert router.precise.index.in_sync(addr) and router.precise.index.size(addr) == 2
    assert router.precise.status[addr][2] == 2
    link._handle(("kv", [], None))            # no new status: the last one stays
    assert router.precise.status[addr][2] == 2
    theirs.close()


async def test_a_standby_follows_the_events_and_routes_on_them_the_moment_it_leads(tok_dir,
                                                                                 monkeypatch):
    """--leader-election: a standby (not ready) subscribes and keeps its precise index like a
    leader; taking over, its first decision already uses what the engines published before."""
    import threading
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import grpc

    class Standby:
        leader = False
        transitions = {"acquired": 0, "lost": 0, "released": 0}

        def is_leader(self):
            return self.leader

        def view(self):
            from picker.failover import LeaseView
            return LeaseView(self.leader, None, True, 0.0, 0.5)

        def poke(self):
            pass

    elector = Standby()

    def start_elector(settings, on_change, stop, candidate=True):
        thread = threading.Thread(target=stop.wait)
        thread.start()
        return elector, thread

    monkeypatch.setattr("picker.leader.start_elector", start_elector)
    tok = ModelTokenizer(tok_dir)
    pubs = [StandInPublisher(), StandInPublisher()]
    servers = [await VllmWithEvents(p).start() for p in pubs]
    a, b = (s.address for s in servers)
    app, metrics_port, maintain = await start_app(["--tokenizer", str(tok_dir), "--leader-election"],
                                                  [a, b])
    try:
        index = app.router.precise.index
        await until(lambda: index.in_sync(a) and index.in_sync(b), timeout=15)
        rng = random.Random(7)
        for system, pub in (("alpha " * 400, pubs[1]), ("beta " * 400, pubs[0])):
            tokens = tok.request_tokens("/v1/chat/completions", json.loads(chat_body(system, "q")))
            n = len(tokens) // BS
            pub.publish(map_payload([stored([rng.getrandbits(64) for _ in range(n)], None,
                                            tokens[:n * BS], BS)]))
        await until(lambda: index.size(a) > 0 and index.size(b) > 0, timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.servers.health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def ready():
                r = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
                return r.status == health_pb2.HealthCheckResponse.SERVING

            assert app.warm() and not await ready()
            elector.leader = True
            await until(ready, timeout=5)
        assert await route(app, chat_body("alpha " * 400, "first question after the takeover")) == b
        assert await route(app, chat_body("beta " * 400, "first question after the takeover")) == a
    finally:
        app.request_stop()
        await maintain
        await app.stop()
        for s in servers:
            await s.stop()
        for p in pubs:
            p.close()
