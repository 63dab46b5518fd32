"""peer_link.py over real TCP on loopback: replicas find each other (and skip themselves) from
one --peers list, exchange heartbeats and in-flight counts, and see a peer leave, fall silent,
or die (a process killed with SIGKILL is GONE at once, not after a timeout)."""
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from picker import peer_link
from picker.failover import GONE, LEFT, LIVE, SILENT
from picker.peer_link import PeerLink, parse_peers

from helpers import free_ports, until

SRC = Path(__file__).resolve().parents[1] / "src"


def test_peers_are_host_port_lists():
    assert parse_peers("a.b.svc:9005, 10.0.0.1:9005,[::1]:9") == [
        ("a.b.svc", 9005), ("10.0.0.1", 9005), ("::1", 9)]
    with pytest.raises(ValueError):
        parse_peers("no-port")


class Replica:
    """A PeerLink with what it reported: peer states, remote loads, relayed outcomes."""

    def __init__(self, identity, port, peers, pool="ns/pool"):
        self.states, self.remote, self.outcomes = [], [], []
        self.link = PeerLink(identity, pool, ("127.0.0.1", port), peers,
                             on_remote=lambda loads, adds: self.remote.append((loads, adds)),
                             on_peers=self.states.append, on_outcomes=self.outcomes.extend)

    def status(self, identity):
        for s in reversed(self.states):
            for p in s:
                if p.identity == identity:
                    return p
        return None


async def pair():
    pa, pb = free_ports(2)
    peers = [("127.0.0.1", pa), ("127.0.0.1", pb)]     # each lists itself too, as DNS would
    a, b = Replica("a", pa, peers), Replica("b", pb, peers)
    await a.link.start()
    await b.link.start()
    return a, b


async def test_two_replicas_link_up_skip_themselves_and_share_heartbeats_and_counts():
    a, b = await pair()
    try:
        b.link.send_role(True, True, False)
        await until(lambda: a.status("b") is not None and a.status("b").acting, timeout=5)
        assert a.status("b").status == LIVE and a.status("b").leased
        assert a.status("a") is None and "a" not in a.link.peers     # found itself, skipped
        await until(lambda: len(a.link._self_addresses) == 1, timeout=5)
        b.link.publish_changes({"10.0.0.1:8000": (2, 300, 1, 150)}, [("h1", "10.0.0.1:8000")])
        await until(lambda: a.remote, timeout=5)
        loads, adds = a.remote[-1]
        assert loads == {"10.0.0.1:8000": (2, 300, 1, 150)} and adds == [("h1", "10.0.0.1:8000")]
        b.link.publish_table({})                                     # b's requests ended
        await until(lambda: a.link.remote_loads() == {}, timeout=5)
    finally:
        await a.link.close()
        await b.link.close()


async def test_a_replica_that_says_it_leaves_is_left_even_after_it_disconnects():
    a, b = await pair()
    try:
        b.link.send_role(True, True, False)
        await until(lambda: a.status("b") is not None and a.status("b").acting, timeout=5)
        b.link.send_role(False, False, True)
        await until(lambda: a.status("b").status == LEFT, timeout=5)
        await b.link.close()
        await asyncio.sleep(0.3)
        assert a.status("b").status == LEFT
    finally:
        await a.link.close()


async def test_a_replica_without_heartbeats_is_silent_and_live_again_when_they_resume(monkeypatch):
    monkeypatch.setattr(peer_link, "SILENCE", 0.2)
    a, b = await pair()
    try:
        b.link.send_role(True, True, False)
        await until(lambda: a.status("b") is not None and a.status("b").status == LIVE,
                    timeout=5)
        started = time.monotonic()
        await until(lambda: a.status("b").status == SILENT, timeout=5)
        assert time.monotonic() - started >= 0.15
        b.link.send_role(True, True, False)
        await until(lambda: a.status("b").status == LIVE, timeout=5)
    finally:
        await a.link.close()
        await b.link.close()


CHILD = """
import asyncio, sys
sys.path.insert(0, {src!r})
from picker.peer_link import PeerLink
async def main():
    link = PeerLink("b", "ns/pool", ("127.0.0.1", {pb}), [("127.0.0.1", {pa})])
    await link.start()
    while True:
        link.send_role(True, True, False){table}
        await asyncio.sleep(0.05)
asyncio.run(main())
"""


async def test_a_killed_replica_is_gone_at_once():
    pa, pb = free_ports(2)
    a = Replica("a", pa, [("127.0.0.1", pb)])
    await a.link.start()
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(src=str(SRC), pa=pa, pb=pb, table="")])
    try:
        await until(lambda: a.status("b") is not None and a.status("b").acting, timeout=20)
        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        await until(lambda: a.status("b").status == GONE, timeout=5, every=0.002)
        # the kernel closed the dead process's sockets: seen long before the silence bound
        assert time.monotonic() - killed < peer_link.SILENCE
        assert not a.status("b").acting
    finally:
        child.kill()
        child.wait()
        await a.link.close()


async def test_a_replica_of_another_pool_is_ignored():
    pa, pb = free_ports(2)
    a = Replica("a", pa, [("127.0.0.1", pb)], pool="ns/pool")
    other = Replica("x", pb, [("127.0.0.1", pa)], pool="ns/other")
    await a.link.start()
    await other.link.start()
    try:
        other.link.send_role(True, True, False)
        await asyncio.sleep(0.5)
        assert a.link.peers == {} and other.link.peers == {}
    finally:
        await a.link.close()
        await other.link.close()


async def test_outcomes_reach_the_other_replicas_as_sent():
    """What Envoy's access log told one replica reaches the others (signals_process.py restamps
    each outcome's receipt time with its own clock: FINISHED_AT is that field)."""
    import dataclasses

    from picker.signals.outcomes import Outcome
    from picker.signals_process import FINISHED_AT
    assert [f.name for f in dataclasses.fields(Outcome)][FINISHED_AT] == "finished_at"
    a, b = await pair()
    try:
        outcome = ("picker-1-7", "10.0.0.1:8000", 200, 40, 12, 0.25, 1.5, "loadtest", "qwq", "",
                   123.0, 0.01)
        b.link.send_role(True, True, False)
        await until(lambda: a.status("b") is not None, timeout=5)
        b.link.publish_outcomes([outcome])
        await until(lambda: a.outcomes, timeout=5)
        assert a.outcomes == [outcome] and Outcome(*a.outcomes[0]).model == "qwq"
    finally:
        await a.link.close()
        await b.link.close()


WATCHER = """
import asyncio, sys
sys.path.insert(0, {src!r})
from picker.peer_link import PeerLink
async def main():
    link = PeerLink("b", "ns/pool", ("127.0.0.1", {pb}), [])
    await link.start()
    while "a" not in link.peers:
        await asyncio.sleep(0.01)
    print("a", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def test_a_killed_peer_that_comes_back_hears_from_this_replica_again():
    """On uvloop (the signals process's loop) a write to a connection the peer just closed raises
    RuntimeError. The connector to that peer must survive it and reconnect: a replica restarted
    after a crash then hears this one again (its heartbeats and counts; without them it could
    neither see this one hang nor route as it does)."""
    import uvloop

    async def scenario():
        pa, pb = free_ports(2)
        a = Replica("a", pa, [("127.0.0.1", pb)])
        await a.link.start()

        async def flood():   # counts change all the time, as under load
            while True:
                a.link.publish_changes({"10.0.0.1:8000": (1, 0, 0)}, [])
                await asyncio.sleep(0.0005)
        flooding = asyncio.create_task(flood())
        try:
            for _ in range(4):
                b = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", WATCHER.format(src=str(SRC), pb=pb), stdout=subprocess.PIPE)
                try:
                    assert await asyncio.wait_for(b.stdout.readline(), 10) == b"a\n"
                    await asyncio.sleep(0.2)
                finally:
                    b.kill()
                    await b.wait()
        finally:
            flooding.cancel()
            await a.link.close()

    uvloop.run(scenario())


# the child also publishes its counts: 3 in flight (2 since its last scrape) on one endpoint
LOADED_CHILD = CHILD.replace("{table}", """
        link.publish_table({{"10.0.0.1:8000": (3, 300, 2, 200), "10.0.0.2:8000": (1, 50, 0, 0)}})""")


async def test_a_killed_replicas_recent_requests_count_until_the_next_scrape():
    """A crashed leader's in-flight counts go at once (Envoy retries what it was deciding on this
    replica, which counts it again); the requests it sent since its last scrape are on the engines
    and count here for gone_hold (two scrape intervals), until this replica's scrapes show them."""
    pa, pb = free_ports(2)
    a = Replica("a", pa, [("127.0.0.1", pb)])
    a.link.gone_hold = 0.5
    await a.link.start()
    child = subprocess.Popen([sys.executable, "-c", LOADED_CHILD.format(src=str(SRC), pa=pa, pb=pb)])
    try:
        await until(lambda: a.link.remote_loads().get("10.0.0.1:8000") == (3, 300, 2, 200), timeout=20)
        os.kill(child.pid, signal.SIGKILL)
        await until(lambda: a.status("b").status == GONE, timeout=5, every=0.002)
        gone = time.monotonic()
        assert a.link.remote_loads() == {"10.0.0.1:8000": (0, 0, 2, 200)}
        assert a.remote[-1][0].get("10.0.0.1:8000") == (0, 0, 2, 200)     # told the workers
        await until(lambda: a.remote[-1][0].get("10.0.0.1:8000") == (0, 0, 0, 0), timeout=5, every=0.01)
        assert 0.4 < time.monotonic() - gone < 1.0
        assert a.link.remote_loads() == {}
    finally:
        child.kill()
        child.wait()
        await a.link.close()
