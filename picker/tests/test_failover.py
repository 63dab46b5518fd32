"""failover.py: which replica answers Envoy, from the Lease and the peers' states (pure, with an
injected clock). The processes and the real link: test_peer_link.py, tests/e2e/test_e2e_failover.py."""
from picker.failover import GONE, LEFT, LIVE, SILENT, Failover, LeaseView, PeerState

RETRY = 0.5


def lease(leader=False, holder="a", reads_ok=True, unchanged_for=0.1):
    return LeaseView(leader, holder, reads_ok, unchanged_for, RETRY)


def peer(identity="a", status=LIVE, acting=False, leased=False):
    return PeerState(identity, status, acting, leased)


def standby_of_a():
    """Replica b, warm, while a leads with the Lease."""
    f = Failover("b", clock=lambda: 0.0)
    role = f.update(True, False, lease(holder="a"), [peer("a", acting=True, leased=True)])
    assert not role.acting and not role.candidate and f.last_leader == "a"
    return f


def test_without_leader_election_a_warm_replica_serves_until_it_stops():
    f = Failover("a", clock=lambda: 0.0)
    assert not f.update(False, False, None, []).acting       # cold
    assert f.update(True, False, None, []).acting
    assert not f.update(True, True, None, []).acting         # stopping


def test_the_lease_holder_acts_and_a_standby_competes_only_while_nobody_acts():
    f = Failover("b", clock=lambda: 0.0)
    assert f.update(True, False, lease(leader=True, holder="b"), []).acting
    s = standby_of_a()
    assert s.update(True, False, lease(holder="a"), [peer("a")]).candidate  # a stopped acting
    cold = Failover("c", clock=lambda: 0.0)
    role = cold.update(False, False, lease(holder="a"), [])
    assert not role.acting and not role.candidate


def test_a_leader_that_says_goodbye_is_replaced_at_once():
    s = standby_of_a()
    role = s.update(True, False, lease(holder="a"), [peer("a", LEFT)])
    assert role.acting and role.candidate and role.reason == "handover" and role.without_lease
    assert s.takeovers["handover"] == 1 and s.took_over_from == "a"


def test_a_leader_whose_link_closes_without_goodbye_is_replaced_at_once():
    s = standby_of_a()
    role = s.update(True, False, lease(holder="a"), [peer("a", GONE)])
    assert role.acting and role.reason == "leader_gone" and s.takeovers["leader_gone"] == 1
    # it acts, without the Lease, until the Lease is its own
    for _ in range(3):
        assert s.update(True, False, lease(holder="a", unchanged_for=3.0),
                        [peer("a", GONE)]).acting
    role = s.update(True, False, lease(leader=True, holder="b"), [peer("a", GONE)])
    assert role.acting and not role.without_lease and s.took_over_from is None
    assert s.takeovers["leader_gone"] == 1                     # counted once


def test_a_silent_leader_is_replaced_only_when_the_lease_shows_it_stopped_renewing():
    s = standby_of_a()
    silent = [peer("a", SILENT, acting=True, leased=True)]
    # renewing (the Lease changed within two retry periods): only cut off from this replica
    assert not s.update(True, False, lease(holder="a", unchanged_for=0.6), silent).acting
    # this replica cannot read the Lease: it cannot tell, and waits
    assert not s.update(True, False, lease(holder="a", reads_ok=False, unchanged_for=5),
                        silent).acting
    role = s.update(True, False, lease(holder="a", unchanged_for=1.1), silent)
    assert role.acting and role.reason == "leader_silent"


def test_a_takeover_ends_when_a_stronger_claim_shows_up():
    s = standby_of_a()
    assert s.update(True, False, lease(holder="a"), [peer("a", SILENT)]).acting is False
    assert s.update(True, False, lease(holder="a", unchanged_for=2), [peer("a", SILENT)]).acting
    # the hung leader wakes up still holding a valid Lease: it wins
    role = s.update(True, False, lease(holder="a"), [peer("a", acting=True, leased=True)])
    assert not role.acting and "a acts" in role.reason


def test_two_replicas_acting_without_the_lease_leave_it_to_the_smaller_identity():
    b = standby_of_a()
    assert b.update(True, False, lease(holder="a"), [peer("a", GONE), peer("c")]).acting
    # c took over too (it saw a go as well); c > b: b keeps acting, c gives way
    assert b.update(True, False, lease(holder="a"),
                    [peer("a", GONE), peer("c", acting=True)]).acting
    c = Failover("c", clock=lambda: 0.0)
    c.update(True, False, lease(holder="a"), [peer("a", acting=True, leased=True), peer("b")])
    assert c.update(True, False, lease(holder="a"), [peer("a", GONE), peer("b")]).acting
    role = c.update(True, False, lease(holder="a"), [peer("a", GONE), peer("b", acting=True)])
    assert not role.acting


def test_a_takeover_ends_when_another_replica_holds_the_lease():
    s = standby_of_a()
    assert s.update(True, False, lease(holder="a"), [peer("a", GONE)]).acting
    assert not s.update(True, False, lease(holder="c"), [peer("a", GONE)]).acting


def test_a_restarted_leader_does_not_end_the_takeover():
    s = standby_of_a()
    assert s.update(True, False, lease(holder="a"), [peer("a", GONE)]).acting
    # the same identity, a new process: live, not acting; the Lease still names it
    role = s.update(True, False, lease(holder="a", unchanged_for=2.0), [peer("a")])
    assert role.acting and role.candidate


def test_a_leader_rides_an_api_outage_through_while_its_peers_see_it():
    a = Failover("a", clock=lambda: 0.0)
    assert a.update(True, False, lease(leader=True, holder="a"), [peer("b")]).acting
    down = lease(leader=False, holder="a", reads_ok=False, unchanged_for=10)
    role = a.update(True, False, down, [peer("b")])
    assert role.acting and role.reason == "api unreachable" and role.without_lease
    assert role.candidate                                       # and renews when it is back
    assert a.update(True, False, down, [peer("b")]).acting      # for as long as it lasts
    # a peer falls silent too: it may have taken over unseen, so stop at the renew deadline
    assert not a.update(True, False, down, [peer("b", SILENT)]).acting


def test_without_the_link_a_leader_stops_at_the_renew_deadline_as_before():
    a = Failover("a", linked=False, clock=lambda: 0.0)
    assert a.update(True, False, lease(leader=True, holder="a"), []).acting
    assert not a.update(True, False, lease(holder="a", reads_ok=False), []).acting


def test_a_standby_never_takes_an_expired_lease_from_a_live_acting_leader():
    s = standby_of_a()
    # the API server is back after an outage: the Lease looks expired from here, but the
    # leader is live and acting on the link
    role = s.update(True, False, lease(holder="a", unchanged_for=30), [peer("a", acting=True)])
    assert not role.acting and not role.candidate


def test_a_stopping_leader_stops_acting_and_competing():
    a = Failover("a", clock=lambda: 0.0)
    a.update(True, False, lease(leader=True, holder="a"), [peer("b")])
    role = a.update(True, True, lease(leader=True, holder="a"), [peer("b")])
    assert not role.acting and not role.candidate and role.reason == "stopping"
