"""Two linked replicas (the whole service: worker 0, its signals process, the peer link, the
elector's thread) on an in-memory Lease API: Envoy's health check on each ext_proc port follows
the acting leader; the standby holds the leader's in-flight counts; a handover takes
milliseconds; a leader whose signals process dies stops; a leader cut off from its standby but
renewing keeps acting alone; a leader rides an API outage through. Real processes, a real API
server and the real Envoy: tests/apiserver/test_picker_leader_election.py and
tests/e2e/test_e2e_failover.py."""
import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import extproc_client as c
from helpers import FakeVllm, free_ports, start_app, until
from picker import peer_link
from picker.leader import LeaseElector
from test_leader import FakeLeases

SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LEASE = ["--leader-election", "--leader-election-lease-duration", "2",
         "--leader-election-renew-deadline", "1.5", "--leader-election-retry-period", "0.25"]


@pytest.fixture
def leases(monkeypatch):
    """Every App's elector on one in-memory Lease API, in its own thread as the real one."""
    api = FakeLeases()

    def start_elector(settings, on_change, stop, candidate=True):
        elector = LeaseElector(api, settings, on_change, candidate=candidate)
        thread = threading.Thread(target=elector.run, args=(stop,), daemon=True)
        thread.start()
        return elector, thread
    monkeypatch.setattr("picker.leader.start_elector", start_elector)
    return api


async def pair(monkeypatch, vllm, server="python"):
    ports = free_ports(2)
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)
    apps = []
    for name, port in zip("ab", ports):
        monkeypatch.setenv("POD_NAME", name)
        apps.append(await start_app([*LEASE, "--peers", peers, "--peer-port", str(port),
                                     "--drain-seconds", "0.3", "--ext-proc-server", server],
                                    [vllm.address]))
    return apps


async def envoy_sees(app) -> bool:
    """What Envoy's health check of this replica's ext_proc port answers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.servers.grpc_port}") as ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
        except grpc.aio.AioRpcError:
            return False
    return r.status == SERVING


async def acting(apps) -> list[str]:
    return [a.identity for a in apps if await envoy_sees(a)]


async def stop(app, task):
    app.request_stop()
    await task
    await app.stop()


async def test_one_acts_the_standby_follows_and_a_handover_takes_milliseconds(leases, monkeypatch):
    vllm = await FakeVllm().start()
    (a, _, ta), (b, _, tb) = await pair(monkeypatch, vllm)
    try:
        await until(lambda: acting([a, b]), timeout=20)
        leader, standby = (a, b) if await envoy_sees(a) else (b, a)
        assert await acting([a, b]) == [leader.identity]
        await until(lambda: all(p.status == "live" for p in standby.peer_states), timeout=10)
        # a decision on the leader reaches the standby's prefix index over the link
        assert standby.router.prefix.size(vllm.address) == 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{leader.servers.grpc_port}") as ch:
            await c.send_full_duplex(c.ep_stub(ch), c.post_headers(),
                                     b'{"model": "qwq", "prompt": "' + b"hello " * 200 + b'"}')
        await until(lambda: standby.router.prefix.size(vllm.address) > 0, timeout=5)
        assert standby.router.prefix.size(vllm.address) == leader.router.prefix.size(vllm.address)
        # SIGTERM's path: the leader leaves; the standby acts within milliseconds
        task = ta if leader is a else tb
        leader.request_stop()
        await task
        stopping = asyncio.ensure_future(leader.stop())
        started = time.monotonic()
        await until(lambda: envoy_sees(standby), timeout=5, every=0.005)
        took = time.monotonic() - started
        await stopping
        print(f"\nhandover: the standby answers SERVING {took * 1000:.0f} ms after the leader left")
        assert took < 0.5
        assert standby.failover.takeovers["handover"] == 1
        await until(lambda: leases.lease("reasoning-pool-picker", "default").holder_identity == standby.identity, timeout=5)
    finally:
        for app, task in ((a, ta), (b, tb)):
            if not app._stopped.is_set():
                await stop(app, task)
        await vllm.stop()


async def test_a_leader_whose_signals_process_dies_stops_and_the_standby_takes_over(
        leases, monkeypatch):
    vllm = await FakeVllm().start()
    (a, _, ta), (b, _, tb) = await pair(monkeypatch, vllm)
    try:
        await until(lambda: acting([a, b]), timeout=20)
        leader, standby = (a, b) if await envoy_sees(a) else (b, a)
        await until(lambda: any(p.identity == leader.identity and p.status == "live"
                                for p in standby.peer_states), timeout=10)   # the link up first
        os.kill(leader.signals_proc.pid, signal.SIGKILL)
        await until(lambda: envoy_sees(standby), timeout=5, every=0.005)
        # it saw the link close (leader_gone), or, on a busy machine, the Lease the stopping
        # leader released first
        assert (standby.failover.takeovers["leader_gone"] == 1
                or standby.elector.transitions["acquired"] == 1), standby.failover
        await asyncio.wait_for(ta if leader is a else tb, timeout=10)   # it stops by itself
        assert leader.failed
    finally:
        for app, task in ((a, ta), (b, tb)):
            if not task.done():
                await stop(app, task)
            else:
                await app.stop()
        await vllm.stop()


async def test_a_leader_cut_off_from_its_standby_but_renewing_acts_alone(leases, monkeypatch):
    monkeypatch.setattr(peer_link, "SILENCE", 0.2)
    vllm = await FakeVllm().start()
    (a, _, ta), (b, _, tb) = await pair(monkeypatch, vllm)
    try:
        await until(lambda: acting([a, b]), timeout=20)
        leader, standby = (a, b) if await envoy_sees(a) else (b, a)
        # the link up first: a leader stopped before its connection to the standby opened is
        # unknown to the standby, not silent
        await until(lambda: any(p.identity == leader.identity and p.status == "live"
                                for p in standby.peer_states), timeout=10)
        os.kill(leader.signals_proc.pid, signal.SIGSTOP)   # its heartbeats stop, it renews
        try:
            await until(lambda: any(p.status == "silent" for p in standby.peer_states), timeout=5)
            await asyncio.sleep(1.5)                       # > 2 retry periods of renewals
            assert await acting([a, b]) == [leader.identity]
        finally:
            os.kill(leader.signals_proc.pid, signal.SIGCONT)
    finally:
        for app, task in ((a, ta), (b, tb)):
            await stop(app, task)
        await vllm.stop()


async def test_a_leader_rides_an_api_outage_through(leases, monkeypatch):
    vllm = await FakeVllm().start()
    (a, _, ta), (b, _, tb) = await pair(monkeypatch, vllm)
    try:
        await until(lambda: acting([a, b]), timeout=20)
        leader = a if await envoy_sees(a) else b
        leases.down = True
        await asyncio.sleep(3.5)          # past the renew deadline (1.5 s) and the lease (2 s)
        assert await acting([a, b]) == [leader.identity]
        assert leader.failover.role.reason == "api unreachable"
        leases.down = False
        await until(lambda: leader.elector.is_leader(), timeout=5)
        assert await acting([a, b]) == [leader.identity]
        assert leases.lease("reasoning-pool-picker", "default").holder_identity == leader.identity
    finally:
        for app, task in ((a, ta), (b, tb)):
            await stop(app, task)
        await vllm.stop()
