"""--leader-election: the flags, the Lease elector's rules (on an in-memory Lease API with
resourceVersion conflicts and an injected clock), and readiness following the leadership.
The real API server: tests/apiserver/test_picker_leader_election.py."""
import asyncio
import copy
import threading
import urllib.request
from datetime import datetime, timezone

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
import grpc
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from picker import app as app_module
from picker.app import App
from picker.config import lease_settings, parse_args
from picker.failover import LeaseView
from picker.leader import LeaseElector, LeaseSettings

from helpers import FakeClock, FakeVllm, free_ports, until

STATIC = ["--discovery", "static", "--endpoints", "127.0.0.1:8101"]


# --- flags

def test_leader_election_is_off_by_default():
    assert lease_settings(parse_args(STATIC)) is None


def test_lease_defaults_follow_the_pool(monkeypatch):
    monkeypatch.setenv("POD_NAME", "picker-abc")
    s = lease_settings(parse_args(["--discovery", "kubernetes", "--pool-name", "p",
                                   "--pool-namespace", "llm", "--leader-election"]))
    assert (s.name, s.namespace, s.identity) == ("p-picker", "llm", "picker-abc")
    assert (s.lease_duration, s.renew_deadline, s.retry_period) == (4, 3.0, 0.5)


def test_lease_flags_override(monkeypatch):
    monkeypatch.delenv("POD_NAME", raising=False)
    s = lease_settings(parse_args([*STATIC, "--leader-election", "--leader-election-lease-name",
                                   "l", "--leader-election-namespace", "ns",
                                   "--leader-election-lease-duration", "10",
                                   "--leader-election-renew-deadline", "8",
                                   "--leader-election-retry-period", "2"]))
    assert (s.name, s.namespace, s.lease_duration, s.renew_deadline, s.retry_period) == \
        ("l", "ns", 10, 8.0, 2.0)
    assert s.identity  # the host name without POD_NAME


@pytest.mark.parametrize("flags", [
    ["--leader-election-renew-deadline", "4"],          # not below the lease duration
    ["--leader-election-retry-period", "2.6"],          # x 1.2 not below the renew deadline
    ["--leader-election-lease-duration", "0"],
    ["--leader-election-retry-period", "0"],
])
def test_inconsistent_lease_timings_are_refused(flags):
    with pytest.raises(SystemExit):
        parse_args([*STATIC, "--leader-election", *flags])


# --- the elector on an in-memory Lease API

class FakeLeases:
    """read/create/replace of Leases with the API server's optimistic concurrency: a replace
    whose resourceVersion is not the stored one gets 409. `down` makes every call fail. Each call
    is atomic, as the API server's are: electors call it from their own threads, and without the
    lock two creates (or replaces) could both pass the check and both replicas lead."""

    def __init__(self):
        self.stored: dict[tuple[str, str], client.V1Lease] = {}
        self.version = 0
        self.down = False
        self.calls = 0
        self.lock = threading.Lock()

    def _check(self):
        self.calls += 1
        if self.down:
            raise ConnectionError("API server unreachable")

    def read_namespaced_lease(self, name, namespace, **_):
        with self.lock:
            self._check()
            if (namespace, name) not in self.stored:
                raise ApiException(status=404)
            return copy.deepcopy(self.stored[(namespace, name)])

    def create_namespaced_lease(self, namespace, body, **_):
        with self.lock:
            self._check()
            key = (namespace, body.metadata.name)
            if key in self.stored:
                raise ApiException(status=409)
            return self._store(key, body)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        with self.lock:
            self._check()
            key = (namespace, name)
            if key not in self.stored:
                raise ApiException(status=404)
            if body.metadata.resource_version != self.stored[key].metadata.resource_version:
                raise ApiException(status=409)
            return self._store(key, body)

    def _store(self, key, body):
        body = copy.deepcopy(body)
        self.version += 1
        body.metadata.resource_version = str(self.version)
        self.stored[key] = body
        return copy.deepcopy(body)

    def lease(self, name="l", namespace="ns"):
        return self.stored[(namespace, name)].spec


def wall():
    return datetime(2026, 1, 1, tzinfo=timezone.utc)


def elector(api, clock, identity, changes=None):
    s = LeaseSettings("l", "ns", identity, lease_duration=4, renew_deadline=3.0,
                      retry_period=0.5)
    return LeaseElector(api, s, on_change=(changes.append if changes is not None
                                           else lambda leading: None),
                        clock=clock, wall=wall)


def test_first_candidate_leads_the_other_waits():
    api, clock = FakeLeases(), FakeClock()
    changes = []
    a, b = elector(api, clock, "a", changes), elector(api, clock, "b")
    a.step()
    b.step()
    assert a.is_leader() and not b.is_leader()
    assert changes == [True]
    assert api.lease().holder_identity == "a" and api.lease().lease_transitions == 0
    for _ in range(20):  # renewing every retry period for 10 s: b never takes it
        clock.t += 0.5
        a.step()
        b.step()
    assert a.is_leader() and not b.is_leader()
    assert a.transitions == {"acquired": 1, "lost": 0, "released": 0}


def test_a_leader_that_stops_renewing_is_replaced_after_the_lease_duration():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    a.step()
    b.step()           # b sees the Lease now; a renews no more (killed)
    clock.t += 4.0
    b.step()
    assert not b.is_leader()  # exactly the duration: not yet
    clock.t += 0.5
    b.step()
    assert b.is_leader()
    assert api.lease().holder_identity == "b" and api.lease().lease_transitions == 1
    assert not a.is_leader()  # its own clock says its last renew is 4.5 s old


def test_a_released_lease_is_taken_at_once():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    a.step()
    b.step()
    assert a.release()
    assert not a.is_leader() and a.transitions["released"] == 1
    assert api.lease().holder_identity == ""
    b.step()           # no waiting for the lease duration
    assert b.is_leader()


def test_a_leader_that_cannot_renew_turns_not_leader_within_the_renew_deadline():
    api, clock = FakeLeases(), FakeClock()
    changes = []
    a = elector(api, clock, "a", changes)
    a.step()
    api.down = True
    clock.t += 2.9
    a.step()
    assert a.is_leader()
    clock.t += 0.2
    # is_leader() is false past the deadline even before the (hanging) step returns
    assert not a.is_leader()
    a.step()
    assert changes == [True, False] and a.transitions["lost"] == 1
    api.down = False   # back: the Lease is still its own, it leads again
    clock.t += 0.5
    a.step()
    assert a.is_leader() and changes == [True, False, True]


def test_of_two_candidates_racing_for_a_free_lease_one_wins():
    api, clock = FakeLeases(), FakeClock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    a.step()
    a.release()
    b._read()          # both read the released Lease...
    a._read()
    a._write(a._lease)  # ...a writes first; b's write carries a stale resourceVersion
    with pytest.raises(ApiException):
        b._write(b._lease)
    assert a.is_leader() and not b.is_leader()


def test_a_lease_taken_by_another_ends_the_leadership():
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    a.step()
    spec = api.stored[("ns", "l")]
    spec.spec.holder_identity = "intruder"
    spec.metadata.resource_version = "99"
    a.step()           # the fast-path renew gets 409, the read shows the new holder
    assert not a.is_leader() and a.transitions["lost"] == 1


def test_run_releases_when_stopped():
    api = FakeLeases()
    a = elector(api, FakeClock(), "a")
    stop = threading.Event()
    t = threading.Thread(target=a.run, args=(stop,))
    t.start()
    try:
        for _ in range(200):
            if a.is_leader():
                break
            threading.Event().wait(0.01)
        assert a.is_leader()
    finally:
        stop.set()
        t.join(5)
    assert not t.is_alive()
    assert api.lease().holder_identity == ""


# --- readiness follows the leadership

class Switch:
    """Stands in for the elector: leadership set by the test."""

    def __init__(self):
        self.leader = False
        self.transitions = {"acquired": 0, "lost": 0, "released": 0}

    def is_leader(self):
        return self.leader

    def view(self):
        return LeaseView(self.leader, None, True, 0.0, 0.5)

    def poke(self):
        pass


async def test_readiness_is_the_leaders_and_liveness_everyones(monkeypatch):
    vllm = await FakeVllm().start()
    switch = Switch()
    stopped = []

    def fake_start(settings, on_change, stop, candidate=True):
        switch.on_change = on_change
        switch.candidate = candidate
        t = threading.Thread(target=lambda: (stop.wait(), stopped.append(True)))
        t.start()
        return switch, t

    monkeypatch.setattr("picker.leader.start_elector", fake_start)
    metrics_port, = free_ports(1)
    args = parse_args(["--grpc-port", "0", "--health-port", "0", "--metrics-port",
                       str(metrics_port), "--outcomes-port", "0", "--bind", "127.0.0.1", "--no-secure-serving",
                       "--discovery", "static", "--endpoints", vllm.address,
                       "--scrape-interval", "0.05", "--leader-election"])
    app = App(args)
    await app.start()
    maintain = asyncio.create_task(app.maintain())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.servers.health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service):
                return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

            SERVING = health_pb2.HealthCheckResponse.SERVING

            async def ready():
                return await status("readiness") == SERVING

            async def not_ready():
                return not await ready()

            # A standby gets warm (scraped) but stays not ready; it competes once warm.
            assert switch.candidate is False
            await until(lambda: app.warm())
            await asyncio.sleep(3 * app_module.READINESS_EVERY)
            assert switch.candidate is True
            assert await status("readiness") != SERVING
            assert await status("liveness") == SERVING
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
            assert "picker_leader 0.0" in page
            assert f'picker_endpoint_queue{{endpoint="{vllm.address}"}} 2.0' in page
            # Leading: ready; every ready service name follows.
            switch.leader = True
            switch.on_change(True)
            await until(ready, timeout=2)
            assert await status("") == SERVING
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(
                f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode())
            assert "picker_leader 1.0" in page
            # Lost: not ready; liveness unchanged.
            switch.leader = False
            switch.on_change(False)
            await until(not_ready, timeout=2)
            assert await status("liveness") == SERVING
        switch.leader = True
        app.request_stop()
        await maintain
        await app.release_lease()   # what stop() does first: the elector is told to release
        assert stopped == [True]
    finally:
        app.request_stop()
        await app.stop()
        await vllm.stop()



def test_a_failing_request_is_logged_once_per_kind(caplog):
    api, clock = FakeLeases(), FakeClock()
    a = elector(api, clock, "a")
    api.down = True
    with caplog.at_level("INFO", logger="picker.leader"):
        for _ in range(10):
            a.step()
            clock.t += 0.5
        api.down = False
        a.step()
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("lease request failed") == 1
    assert messages.count("lease requests work again") == 1 and a.is_leader()


def test_a_cold_replica_does_not_compete_a_leader_keeps_renewing():
    api, clock = FakeLeases(), FakeClock()
    cold = LeaseElector(api, LeaseSettings("l", "ns", "cold"), clock=clock, wall=wall,
                        candidate=False)
    warm = elector(api, clock, "warm")
    cold.step()
    assert api.stored == {} and api.calls == 1       # a read (failover.py watches the
    #                                                  holder renew), never a write
    warm.step()
    warm.release()
    cold.step()                                      # released, but still cold
    assert api.lease().holder_identity == ""
    warm.step()
    assert warm.is_leader()
    warm.candidate = False                           # a leader that goes cold keeps the Lease
    clock.t += 0.5
    warm.step()
    assert warm.is_leader() and api.lease().holder_identity == "warm"
