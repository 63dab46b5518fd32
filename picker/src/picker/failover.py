"""Which replica answers Envoy: the acting leader, decided from the Lease and from what the
replicas tell each other over the peer link (peer_link.py).

Envoy health-checks every replica on the ext_proc port (base/gateway): the acting leader answers
SERVING, every other replica NOT_SERVING, so Envoy sends its streams to the acting leader only.
The Lease (leader.py) names the leader in normal operation; the peer link lets a standby act at
once when the leader is gone, instead of waiting for the Lease to expire:

- the leader said goodbye (SIGTERM: `left`): a handover, act now;
- the leader's link closed without a goodbye (`gone`: its process died, the kernel closed its
  sockets): act now;
- the leader fell silent (`silent`: no heartbeat for the silence bound) while this replica reads
  the Lease without error and has not seen it change for two retry periods (a living leader renews
  every retry period): it hangs, act now. A leader that is only cut off from this replica keeps
  renewing, so the standby does not take over;
- and, as before, whoever holds the Lease acts.

A replica that acts without the Lease keeps competing for it and acts until it holds it, or until
a stronger claim shows up on the link: a live replica acting with the Lease, or, between two
acting without it, the smaller identity. A leader whose Lease requests fail (the API server is
unreachable) rides the outage through: it goes on acting while every peer it knows is live on the
link and none acts (nobody can take over without the API server, and the standbys see it alive).
If a peer is silent too, it stops acting at the renew deadline as before: it cannot tell whether
that peer took over.

A standby competes for the Lease only while no live peer acts, so an expired Lease (after an API
outage, or a restarted leader's) is never taken from a leader that is alive and acting.

Pure: no I/O, no threads; the clock is injected. app.py feeds it the elector's state
(leader.LeaseElector.view) and the link's peer states, and applies the result to the health
services.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

# Peer states (peer_link.py sets them)
LIVE, SILENT, GONE, LEFT = "live", "silent", "gone", "left"
# Why a replica acts, or stopped acting (logged, and the `reason` label of picker_failovers_total)
TAKEOVER_REASONS = ("handover", "leader_gone", "leader_silent")


@dataclass(frozen=True)
class PeerState:
    """What the link knows of one other replica."""
    identity: str
    status: str                # LIVE, SILENT, GONE or LEFT
    acting: bool = False       # its last claim: it answers Envoy
    leased: bool = False       # its last claim: it holds the Lease (renewed within the deadline)
    since: float = 0.0         # clock() when the status began


@dataclass(frozen=True)
class LeaseView:
    """The elector's state as the failover rules need it (leader.LeaseElector.view)."""
    leader: bool               # holds the Lease, renewed within the renew deadline
    holder: str | None         # the holder last read ("" or None: free or never read)
    reads_ok: bool             # the last Lease request got an answer (not an error or timeout)
    unchanged_for: float       # seconds since this replica last saw the Lease change
    retry_period: float


@dataclass(frozen=True)
class Role:
    acting: bool               # answer SERVING to Envoy's health check
    candidate: bool            # may acquire the Lease
    reason: str                # why (logged on every change)
    without_lease: bool = False  # acting but not holding the Lease (a takeover, an API outage)


@dataclass
class Failover:
    identity: str
    linked: bool = True    # --peers: takeovers and riding an API outage through need the link
    clock: Callable[[], float] = time.monotonic
    role: Role = field(default_factory=lambda: Role(False, False, "starting"))
    last_leader: str | None = None     # the identity last seen acting (or holding the Lease)
    took_over_from: str | None = None  # set while acting after a takeover, until the Lease is ours
    takeovers: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TAKEOVER_REASONS, 0))

    def update(self, warm: bool, stopping: bool, lease: LeaseView | None,
               peers: list[PeerState]) -> Role:
        """The role now; counts takeovers. `lease` None: no leader election (every replica acts,
        as before)."""
        live_acting = [p for p in peers if p.status == LIVE and p.acting]
        for p in live_acting:
            self.last_leader = p.identity
        if lease is not None and lease.holder and lease.holder != self.identity \
                and not live_acting and self.last_leader is None:
            self.last_leader = lease.holder
        role = self._decide(warm, stopping, lease, peers, live_acting)
        if role.acting and role.reason in TAKEOVER_REASONS and not self.role.acting:
            self.takeovers[role.reason] += 1
        if not role.without_lease:
            self.took_over_from = None
        self.role = role
        return role

    def _decide(self, warm, stopping, lease, peers, live_acting) -> Role:
        if stopping:
            return Role(False, False, "stopping")
        if not warm:
            return Role(False, False, "not warm")
        candidate = not live_acting
        if lease is None:
            return Role(True, False, "no leader election")
        if lease.leader:
            return Role(True, True, "lease")
        if self._stronger(live_acting):
            return Role(False, False, f"{self._stronger(live_acting)} acts")
        was = self.role
        if was.acting and was.reason in ("lease", "api unreachable") and self._ride_through(
                lease, peers):
            return Role(True, candidate, "api unreachable", without_lease=True)
        if was.acting and self.took_over_from is not None and lease.holder in (
                None, "", self.identity, self.took_over_from):
            return Role(True, candidate, was.reason, without_lease=True)
        reason = self._takeover(lease, peers)
        if reason is not None:
            self.took_over_from = self.last_leader
            return Role(True, candidate, reason, without_lease=True)
        return Role(False, candidate, "standby")

    def _stronger(self, live_acting: list[PeerState]) -> str | None:
        """A live peer whose claim beats this replica's (which holds no valid Lease here): one
        with the Lease, or one without it and a smaller identity."""
        for p in live_acting:
            if p.leased or p.identity < self.identity:
                return p.identity
        return None

    def _ride_through(self, lease: LeaseView, peers: list[PeerState]) -> bool:
        """The leader's Lease requests fail, nobody else holds it, and every peer is live on the
        link (so none of them took over unseen)."""
        return (self.linked and not lease.reads_ok and lease.holder in (None, "", self.identity)
                and all(p.status in (LIVE, LEFT, GONE) for p in peers))

    def _takeover(self, lease: LeaseView, peers: list[PeerState]) -> str | None:
        """Why this standby acts now, or None: the last leader left, died or hangs."""
        leader = next((p for p in peers if p.identity == self.last_leader), None)
        if leader is None or lease.holder not in (None, "", self.identity, leader.identity):
            return None   # no leader known, or another replica already holds the Lease
        if leader.status == LEFT:
            return "handover"
        if leader.status == GONE:
            return "leader_gone"
        if leader.status == SILENT and lease.reads_ok \
                and lease.unchanged_for > 2 * lease.retry_period:
            return "leader_silent"
        return None
