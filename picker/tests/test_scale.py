"""Large pools and several processes: the candidate prefilter, readiness under slow scrapes,
in-flight counts and prefix additions shared among peers, the signals process, --workers."""
import asyncio
import random
from argparse import Namespace
from pathlib import Path

import pytest

from picker import defaults
from picker.core import RequestInfo, RouterSettings
from picker.scheduling.prefilter import LeastLoaded, PrefilterSettings, prefilter
from picker.scheduling.profile import load_profile, profile_from_dict
from picker.signals.state import EndpointState
from picker.signals.metrics import parse_vllm_metrics

from helpers import FakeVllm, body, free_ports, make_router, metrics_text, until

OBJECTIVES_FILE = Path(__file__).resolve().parents[2] / "base/inference/inferenceobjectives.yaml"

PROMPT = "tenant seven system prompt: be brief and exact. " * 40


def req(b):
    return RequestInfo("/v1/completions", {}, b)


def test_prefilter_scores_prefix_owners_least_loaded_and_a_sample_only_above_the_threshold():
    eps = [EndpointState(f"10.0.0.{i}:8000") for i in range(100)]
    by_addr = {e.address: e for e in eps}
    s = PrefilterSettings(above=32, sample=5, least=2, owners=3)
    match = {eps[i].address: blocks for i, blocks in [(7, 9), (8, 9), (9, 5), (10, 1), (11, 1)]}
    least = [eps[50], eps[51]]
    chosen = prefilter(eps, by_addr, match, least, random.Random(1), s)
    addrs = {e.address for e in chosen}
    assert {eps[7].address, eps[8].address, eps[9].address} <= addrs   # the 3 longest matches
    assert eps[10].address not in addrs or eps[11].address not in addrs  # not every holder
    assert {eps[50].address, eps[51].address} <= addrs
    assert 3 + 2 <= len(chosen) <= 3 + 2 + 5
    assert prefilter(eps[:32], by_addr, match, least, random.Random(1), s) == eps[:32]


def test_least_loaded_follows_scrapes_without_scanning_the_pool():
    ll = LeastLoaded(2)
    eps = [EndpointState(f"e{i}") for i in range(5)]
    for e, waiting in zip(eps, [5, 3, 9, 0, 7]):
        e.metrics = parse_vllm_metrics(metrics_text(waiting=waiting))
        ll.observe(e)
    assert {e.address for e in ll.members()} == {"e1", "e3"}
    eps[3].metrics = parse_vllm_metrics(metrics_text(waiting=8))  # e3 got busy
    ll.observe(eps[3])
    eps[0].metrics = parse_vllm_metrics(metrics_text(waiting=1))
    ll.observe(eps[0])
    assert {e.address for e in ll.members()} == {"e0", "e1"}
    ll.forget("e0")
    assert [e.address for e in ll.members()] == ["e1"]


def test_a_large_pool_routes_to_the_prefix_owner_and_spreads_load_like_full_scoring():
    n = 256
    r = make_router(profile="default", n=n, waiting=1, running=4, kv=0.3)
    assert len(r.endpoints) > r.profile.prefilter.above
    first = r.decide(req(body(prompt=PROMPT + "question one")))
    again = r.decide(req(body(prompt=PROMPT + "question two")))
    assert again.endpoint == first.endpoint and again.cached_tokens > 0  # found among 256
    idle = "10.0.0.200:8000"
    for a in r.endpoints:
        if a != idle:
            r.on_scrape_ok(a, metrics_text(waiting=6, running=20, kv=0.7))
    r.on_scrape_ok(idle, metrics_text(waiting=0, running=0, kv=0.0))
    assert r.decide(req(body(prompt="unrelated " * 300))).endpoint == idle  # the least loaded


def test_prefilter_settings_come_from_the_profile_and_bad_ones_are_named():
    assert load_profile("default").prefilter == PrefilterSettings()
    doc = {"name": "p", "scorers": ["queue"], "prefilter": {"above": 8, "sample": 2}}
    assert profile_from_dict(doc).prefilter.above == 8
    with pytest.raises(ValueError, match="prefilter: unknown keys"):
        profile_from_dict({**doc, "prefilter": {"abov": 8}})
    with pytest.raises(ValueError, match="'above' must be >= 1"):
        profile_from_dict({**doc, "prefilter": {"above": 0}})


def test_a_slow_scrape_is_not_a_dead_endpoint():
    r = make_router(n=2, settings=RouterSettings(timeouts_to_unready=3))
    a = "10.0.0.1:8000"
    r.on_scrape_failed(a, timed_out=True)
    r.on_scrape_failed(a, timed_out=True)
    assert r.endpoints[a].ready
    assert {r.decide(req(body())).endpoint for _ in range(20)} == set(r.endpoints)
    r.on_scrape_failed(a, timed_out=True)
    assert not r.endpoints[a].ready
    assert {r.decide(req(body())).endpoint for _ in range(20)} == {"10.0.0.2:8000"}
    r.on_scrape_ok(a, metrics_text())
    assert r.endpoints[a].ready and r.endpoints[a].failures_in_a_row == 0
    r.on_scrape_failed(a)  # refused / error status: out at once
    assert not r.endpoints[a].ready


def test_peers_in_flight_counts_add_to_ours_and_only_ours_are_reported():
    r = make_router(n=2)
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"
    d = r.decide(req(body(prompt="x" * 400)))
    mine = r.own_loads()
    assert list(mine) == [d.endpoint] and mine[d.endpoint][0] == 1
    r.set_peer_loads({a: (5, 500, 2, 200)})
    assert r.endpoints[a].inflight == 5 + (d.endpoint == a)
    assert r.own_loads() == mine  # the peers' share is not ours to report
    r.on_scrape_ok(a, metrics_text())
    assert r.endpoints[a].since_scrape == 2  # a scrape resets our share, not the peers'
    r.set_peer_loads({})
    assert r.endpoints[a].inflight == (d.endpoint == a) and r.endpoints[b].peer_inflight == 0
    r.on_request_done(d.request_id)
    assert r.own_loads() == {}


def test_peer_prefix_additions_give_the_same_affinity():
    one, two = make_router(profile="default", n=4), make_router(profile="default", n=4, seed=9)
    one.share_with_peers()
    d = one.decide(req(body(prompt=PROMPT + "q1")))
    two.add_peer_prefixes(one.take_prefix_additions())
    assert one.take_prefix_additions() == []  # taken once
    assert two.decide(req(body(prompt=PROMPT + "q2"))).endpoint == d.endpoint


def test_scrape_interval_grows_with_the_pool_but_never_to_staleness():
    assert defaults.scrape_interval_for(16) == defaults.SCRAPE_INTERVAL
    assert defaults.scrape_interval_for(1024) == pytest.approx(0.5)  # capped at staleness / 2
    assert defaults.scrape_interval_for(1024, staleness=4.0) == pytest.approx(1024 / defaults.SCRAPE_RATE_BUDGET)


async def test_the_signals_process_scrapes_for_the_workers():
    from picker.workers import SignalsLink, start_signals_process
    vllm = await FakeVllm().start()
    r0, r1 = make_router(scrape=False), make_router(scrape=False)
    proc, conns = start_signals_process(Namespace(scrape_interval=0.02, staleness=1.0,
                                                  log_level="warning"), 2)
    got = []
    l0 = SignalsLink(r0, conns[0], peers=True)
    l1 = SignalsLink(r1, conns[1], peers=True, on_objects=lambda e, o, w: (got.append(e), r1.set_endpoints(e)))
    l0.start()
    l1.start()
    try:
        r0.set_endpoints([vllm.address])
        l0.send_objects([vllm.address], [], [])
        await until(lambda: r0.ready and r1.ready, timeout=20)
        assert got == [[vllm.address]] and r1.endpoints[vllm.address].metrics.waiting == 2
        d = r0.decide(req(body(prompt=PROMPT)))
        await until(lambda: r1.endpoints[vllm.address].peer_inflight == 1)  # relayed
        assert r1.prefix.size(vllm.address) > 0
        r0.on_request_done(d.request_id)
        await until(lambda: r1.endpoints[vllm.address].inflight == 0)
        vllm.status = 500
        await until(lambda: not r0.ready and not r1.ready)
    finally:
        await l1.close()
        await l0.close()
        await asyncio.to_thread(proc.join, 10)
        await vllm.stop()
    assert proc.exitcode == 0


async def test_the_signals_process_relays_each_workers_arrivals_to_the_others():
    import time

    from picker.flowcontrol.activity import RecentArrivals
    from picker.workers import SignalsLink, start_signals_process
    routers = [make_router(scrape=False) for _ in range(3)]
    arrivals = [RecentArrivals(window=60.0) for _ in routers]
    proc, conns = start_signals_process(Namespace(scrape_interval=0.02, staleness=1.0,
                                                  log_level="warning"), 3)
    links = [SignalsLink(r, c, peers=True, arrivals=a) for r, c, a in zip(routers, conns, arrivals)]
    for link in links:
        link.start()
    try:
        arrivals[2].add(time.monotonic(), 0, "std")   # once the signals process runs
        await until(lambda: not arrivals[0].alone(time.monotonic(), 0, "heavy"), timeout=20)
        sent = time.monotonic()
        for _ in range(5):
            arrivals[0].add(sent, 0, "heavy")
        arrivals[1].add(sent, 10, "interactive")
        await until(lambda: arrivals[2].must_hold_back(time.monotonic(), 0, "std"), timeout=10,
                    every=0.0002)
        seen = time.monotonic() - sent
        await until(lambda: arrivals[0].must_hold_back(time.monotonic(), 0, "std"))
        assert arrivals[1].must_hold_back(time.monotonic(), 0, "heavy")
        everyone = {(0, "std"): 1, (0, "heavy"): 5, (10, "interactive"): 1}
        assert [a._counts for a in arrivals] == [everyone] * 3  # each once: no echo back
        assert len(arrivals[2]._events) == 3            # one event per worker's batch
        print(f"arrivals relayed to the other workers in {seen * 1000:.2f} ms")
    finally:
        for link in links:
            await link.close()
        await asyncio.to_thread(proc.join, 10)
    assert proc.exitcode == 0


def _sockets_on(pid: int, port: int, state: str = "01") -> int:
    """Sockets on local `port` held by process `pid` in TCP `state` (01 established, 0A
    listening), from /proc."""
    import os
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == state and cols[9] in inodes:
                    count += 1
    return count


@pytest.mark.server
async def test_workers_share_the_grpc_port_and_the_metrics(tmp_path):
    import subprocess
    import sys
    import urllib.request

    from tests.helpers import extproc_client as c
    vllm = await FakeVllm().start()
    port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "picker", "--discovery", "static", "--endpoints", vllm.address,
         "--grpc-port", str(port), "--health-port", str(health_port), "--metrics-port",
         str(metrics_port), "--outcomes-port", "0", "--bind", "127.0.0.1", "--workers", "2", "--scrape-interval", "0.05"],
        stderr=subprocess.PIPE, text=True)
    channels = []
    try:
        def page():
            return urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()

        async def routed(ch):
            _, answers = await c.send_full_duplex(c.ep_stub(ch), c.post_headers(), body())
            return c.set_headers(answers[0].request_headers.response)["x-gateway-destination-endpoint"]

        def listeners():
            kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
            return [p for p in [proc.pid, *map(int, kids)] if _sockets_on(p, port, "0A")]

        for _ in range(300):  # until both workers listen on the port
            await asyncio.sleep(0.1)
            workers = listeners()
            if len(workers) == 2:
                break
        assert len(workers) == 2, workers
        # TLS with one self-signed certificate shared by both workers: trust what worker 0 shows.
        import ssl
        pem = ssl.get_server_certificate(("127.0.0.1", port)).encode()
        for _ in range(16):  # one connection each: the kernel spreads them over the workers
            channels.append(c.channel(port, pem))
        routed_ok = 0  # every routed request counts, also in a round that had to be retried
        for _ in range(100):
            results = await asyncio.gather(*(routed(ch) for ch in channels), return_exceptions=True)
            routed_ok += sum(r == vllm.address for r in results)
            if results == [vllm.address] * 16:
                break
            await asyncio.sleep(0.1)  # workers still starting or endpoint not yet scraped
        assert results == [vllm.address] * 16
        holders = [p for p in workers if _sockets_on(p, port)]
        assert len(holders) == 2, holders  # both workers hold connections
        text = await asyncio.to_thread(page)
        assert f'picker_requests_total{{code="200",model="qwq",target_model="qwq"}} {routed_ok}.0' in text
    finally:
        for ch in channels:
            await ch.close()
        proc.terminate()
        _, err = await asyncio.to_thread(proc.communicate, None, 20)
        await vllm.stop()
    assert proc.returncode == 0, err[-2000:]
    assert "signals process gone" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.server
async def test_flow_control_workers_hold_back_for_a_band_only_the_other_worker_saw():
    """Two workers with flow control, 16 connections spread over them: one interactive request
    reaches one worker; the standard requests on every connection must all leave the band's
    reserve (held until the age bound), also on the worker that never saw the interactive one.
    (A client over its share is held only while the pool is saturated, and this pool has room:
    the band rule holds at any load, so it is what shows the relay between the workers.)"""
    import subprocess
    import sys

    from tests.helpers import extproc_client as c
    vllm = await FakeVllm(metrics_text(waiting=0, kv=0.75)).start()  # room, not beyond the reserve
    port, health_port, metrics_port = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "picker", "--discovery", "static", "--endpoints", vllm.address,
         "--grpc-port", str(port), "--health-port", str(health_port), "--metrics-port",
         str(metrics_port), "--outcomes-port", "0", "--bind", "127.0.0.1", "--workers", "2", "--scrape-interval", "0.05",
         "--no-secure-serving", "--flow-control", "--flow-max-wait", "1.5",
         "--flow-at-bound", "reject", "--objects", str(OBJECTIVES_FILE)],
        stderr=subprocess.PIPE, text=True)
    channels = []

    async def send(ch, client, objective=None):
        headers = c.post_headers(**{"x-client-id": client},
                                 **({"x-gateway-inference-objective": objective} if objective else {}))
        _, answers = await c.send_full_duplex(c.ep_stub(ch), headers, body(prompt=f"{client} asks"))
        first = answers[0]
        if first.HasField("immediate_response"):
            return first.immediate_response.status.code
        return c.set_headers(first.request_headers.response)["x-gateway-destination-endpoint"]

    try:
        kids = []
        for _ in range(300):  # until both workers listen on the port
            await asyncio.sleep(0.1)
            kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
            workers = [p for p in [proc.pid, *map(int, kids)] if _sockets_on(p, port, "0A")]
            if len(workers) == 2:
                break
        channels = [grpc_insecure(port) for _ in range(16)]
        for _ in range(100):  # both workers up and the endpoint scraped: a lone client goes
            try:
                if await asyncio.gather(*(send(ch, "warmup") for ch in channels)) == [vllm.address] * 16:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.1)
        assert len([p for p in workers if _sockets_on(p, port)]) == 2  # both hold connections
        assert await send(channels[0], "light", "interactive") == vllm.address  # one worker sees it
        await asyncio.sleep(0.2)   # the other worker learns of it (relayed in about 1 ms)
        outcomes = await asyncio.gather(*(send(ch, "warmup") for ch in channels))
        assert outcomes == [503] * 16, outcomes  # held by both workers, refused at the bound
    finally:
        for ch in channels:
            await ch.close()
        proc.terminate()
        _, err = await asyncio.to_thread(proc.communicate, None, 20)
        await vllm.stop()
    assert proc.returncode == 0, err[-2000:]


def grpc_insecure(port: int):
    """A channel with a connection of its own (channels to one target share one by default)."""
    import grpc
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                     options=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture
async def redis_url(tmp_path):
    """A real redis-server on a free loopback port, stopped after the test."""
    import shutil
    import subprocess
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is missing: `make tools` installs it (Debian package redis-server)")
    port, = free_ports(1)
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis.asyncio as redis
    client = redis.from_url(f"redis://127.0.0.1:{port}/0")
    for _ in range(100):
        try:
            await client.ping()
            break
        except Exception:
            await asyncio.sleep(0.05)
    await client.aclose()
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.mark.server
async def test_replicas_share_in_flight_counts_and_prefixes_through_redis(redis_url):
    from picker.workers import SignalsLink, start_signals_process
    vllm = await FakeVllm().start()
    replicas = []
    for _ in range(2):
        router = make_router(profile="default", scrape=False)
        router.set_endpoints([vllm.address])
        proc, conns = start_signals_process(Namespace(
            scrape_interval=0.02, staleness=1.0, log_level="warning", peer_store=redis_url,
            pool_name="reasoning-pool", pool_namespace="test"), 1)
        link = SignalsLink(router, conns[0], peers=True)
        link.start()
        link.send_objects([vllm.address], [], [])
        replicas.append((router, proc, link))
    (a, _, _), (b, _, _) = replicas
    try:
        await until(lambda: a.ready and b.ready, timeout=20)
        d = a.decide(req(body(prompt=PROMPT + "from replica a")))
        await until(lambda: b.endpoints[vllm.address].peer_inflight == 1, timeout=10)
        await until(lambda: b.prefix.size(vllm.address) > 0, timeout=10)
        assert a.endpoints[vllm.address].peer_inflight == 0  # its own count is not a peer's
        a.on_request_done(d.request_id)
        await until(lambda: b.endpoints[vllm.address].inflight == 0, timeout=10)
    finally:
        for _, proc, link in replicas:
            await link.close()
            await asyncio.to_thread(proc.join, 10)
        await vllm.stop()
    assert [p.exitcode for _, p, _ in replicas] == [0, 0]


def test_changed_loads_are_reported_once_and_partial_peer_loads_leave_the_rest():
    r = make_router(n=3)
    calls = []
    r.share_with_peers(on_change=lambda: calls.append(1))
    d1 = r.decide(req(body(prompt="x" * 400)))
    r.decide(req(body(prompt="y" * 400)))
    assert calls == [1]  # one callback per batch of changes
    loads = r.take_changed_loads()
    assert sum(v[0] for v in loads.values()) == 2 and r.take_changed_loads() == {}
    r.on_request_done(d1.request_id)
    assert r.take_changed_loads()[d1.endpoint][0] == sum(
        1 for e in r.inflight.values() if e.state.address == d1.endpoint) and calls == [1, 1]
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"
    r.set_peer_loads({a: (3, 0, 0, 0), b: (2, 0, 0, 0)})
    r.set_peer_loads({a: (1, 0, 0, 0)}, partial=True)
    assert (r.endpoints[a].peer_inflight, r.endpoints[b].peer_inflight) == (1, 2)


def test_the_scrape_timeout_follows_the_adapted_interval():
    from picker.scraper import Scraper
    s = Scraper(make_router(scrape=False), interval=0.1)
    assert s.timeout == defaults.scrape_timeout_for(0.1) == 0.5
    s.set_interval(0.5)
    assert s.timeout == 2.5
    assert Scraper(make_router(scrape=False), interval=0.1, timeout=0.2).timeout == 0.2
    fixed = Scraper(make_router(scrape=False), interval=0.1, timeout=0.2)
    fixed.set_interval(0.5)
    assert fixed.timeout == 0.2


def test_a_large_scrape_batch_arrives_whole_on_the_service_event_loop():
    """uvloop makes a watched fd non-blocking; a batch bigger than the pipe must still be read."""
    import multiprocessing as mp
    import os
    import threading

    import uvloop
    from picker.workers import SignalsLink
    n = 3000
    router = make_router(n=n, scrape=False)
    metrics = parse_vllm_metrics(metrics_text(waiting=1))
    batch = [(a, metrics, False, 1000.0) for a in router.endpoints]
    ours, theirs = mp.Pipe(duplex=True)

    async def main():
        link = SignalsLink(router, ours, peers=False)
        link.start()
        assert os.get_blocking(ours.fileno())
        sender = threading.Thread(target=theirs.send, args=(("scrapes", batch),))
        sender.start()
        for _ in range(500):
            if link.scrape_batches:
                break
            await asyncio.sleep(0.01)
        sender.join()
        await link.close()

    uvloop.run(main())
    assert sum(e.ready for e in router.endpoints.values()) == n


def test_loads_merge_per_endpoint_in_one_place():
    from picker.signals.state import ZERO_LOAD, merge_loads, subtract_load
    one = {"a": (1, 10, 1, 10), "b": (2, 0, 0, 0)}
    two = {"a": [3, 5, 0, 0]}                       # as a peer's JSON message carries it
    assert merge_loads([one, two]) == {"a": (4, 15, 1, 10), "b": (2, 0, 0, 0)}
    assert merge_loads([one, two], ["a", "c"]) == {"a": (4, 15, 1, 10), "c": ZERO_LOAD}
    assert merge_loads([]) == {}
    assert subtract_load((4, 15, 1, 10), one["a"]) == (3, 5, 0, 0)
