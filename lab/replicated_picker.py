"""Picker replicas as one lab policy: N copies of the picker's real Router, each request decided
by one replica drawn at random (Envoy spreads ext_proc streams over the picker's endpoints).

- independent: nothing shared; each replica learns prefix affinity from its share of the
  traffic and counts only its own in-flight requests (`replicas:N:independent`);
- active-passive (`replicas:N:active-passive`, what base/picker runs with --leader-election):
  one leader decides every request, the N-1 standbys follow the engines' KV-cache events too but
  decide nothing (Envoy's health check sends them no stream). The decisions are the leader's
  alone, so by construction this is one picker. `replicas:N:active-passive:failover=K`: after
  the K-th decision the leader is gone and the next replica decides from then on, with the view
  the peer link gave it (the leader's in-flight counts and prefix additions after each of its
  decisions, and the outcomes Envoy's access log gives the acting replica, relayed; at the
  failover the dead leader's in-flight counts dropped and its since-scrape counts held for two
  scrape intervals, as the link does with a peer that is gone);
  `...:failover=K:cold`: a standby without the link (only its own scrapes and KV events, and
  the outcomes once it acts);
- shared (`replicas:N`): every `sync_interval` seconds (PEER_SYNC_INTERVAL; `replicas:N:sync=S`
  sets it; the picker itself sends changes as they happen and the whole table every
  PEER_SYNC_INTERVAL, so `sync=0` and the default bound it from both sides) the replicas exchange
  what the picker's signals process relays between workers and replicas
  (picker/src/picker/signals_process.py): each one's in-flight counts per endpoint
  (`Router.own_loads` -> `Router.set_peer_loads`, summed by `merge_loads`) and the prefix-index
  additions of its decisions (`Router.take_prefix_additions` -> `Router.add_peer_prefixes`).

The experiment over 1, 2 and 4 replicas is lab/replicas.py.
"""

from __future__ import annotations

import math
import random

from picker import defaults
from picker.signals.state import merge_loads

from lab.picker_policy import PickerPolicy, picker_events
from lab.policy_api import Policy


class ReplicatedPicker(Policy):
    reads_engines = False        # its replicas read only their scrapes

    def __init__(self, replicas: int, shared: bool = True, profile: str = "default",
                 sync_interval: float = defaults.PEER_SYNC_INTERVAL, precise: bool = False,
                 kv_delay: float | None = None, active_passive: bool = False,
                 failover_after: int | None = None, linked: bool = True):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        # Precise: every replica subscribes to every engine on its own (same batches, same delay).
        self.parts = [PickerPolicy(profile, precise=precise, kv_delay=kv_delay,
                                   id_prefix="picker-" if i == 0 else f"picker-{i}.")
                      for i in range(replicas)]
        self.kv_events = precise
        self.scrape_interval = self.parts[0].scrape_interval  # the lab records engine history
        self.active_passive = active_passive
        self.shared = shared and replicas > 1 and not active_passive
        self.sync_interval = sync_interval
        self.name = f"replicas:{replicas}" + (":active-passive" if active_passive else
                                              "" if shared else ":independent")
        if failover_after is not None and (not active_passive or replicas < 2):
            raise ValueError("a failover needs 2 or more active-passive replicas")
        self.failover_after, self.linked = failover_after, linked
        if failover_after is not None:
            self.name += f":failover={failover_after}" + ("" if linked else ":cold")
        if precise:
            self.name += self.parts[0].name[len("picker"):]

    @classmethod
    def from_name(cls, name: str, **options) -> "ReplicatedPicker":
        """`replicas:N` (shared view, exchanged every PEER_SYNC_INTERVAL), `replicas:N:sync=S`
        (every S seconds; 0 = before every decision), `replicas:N:independent` or
        `replicas:N:active-passive`."""
        parts = name.split(":")
        if len(parts) >= 4 and parts[2] == "active-passive" and parts[3].startswith("failover="):
            cold = parts[4:] == ["cold"]
            if parts[1].isdigit() and parts[3][9:].isdigit() and (cold or len(parts) == 4):
                return cls(int(parts[1]), shared=False, active_passive=True,
                           failover_after=int(parts[3][9:]), linked=not cold, **options)
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise ValueError(f"bad policy {name!r}: replicas:N[:independent|:active-passive"
                             f"[:failover=K[:cold]]|:sync=SECONDS]")
        option = parts[2] if len(parts) == 3 else ""
        if option == "independent":
            return cls(int(parts[1]), shared=False, **options)
        if option == "active-passive":
            return cls(int(parts[1]), shared=False, active_passive=True, **options)
        if option.startswith("sync="):
            try:
                return cls(int(parts[1]), sync_interval=float(option[5:]), **options)
            except ValueError:
                pass
        elif not option:
            return cls(int(parts[1]), **options)
        raise ValueError(f"bad policy {name!r}: replicas:N[:independent|:active-passive|:sync=SECONDS]")

    def on_kv_events(self, endpoint, seq, events, at):
        converted = picker_events(events)
        for p in self.parts:
            p.queue_kv(endpoint.address, seq, converted, at)

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        # Same scrape phases in every replica (their scrapes read the same engine history); the
        # first replica draws from `rng` exactly as a lone PickerPolicy would.
        for p in self.parts:
            p.start(endpoints, clock, rng)
            if self.shared or (self.failover_after is not None and self.linked):
                p.router.share_with_peers()
        self.rng = random.Random(rng.random())
        self.replica_of: dict[int, int] = {}
        self.next_sync = -math.inf
        self.decisions = 0
        self.active = 0
        self.release_at: float | None = None   # after a failover: when the held counts go

    @property
    def scrapes(self) -> int:
        return sum(p.scrapes for p in self.parts)

    def _sync(self) -> None:
        now = self.clock()
        if now < self.next_sync:
            return
        self.next_sync = now + self.sync_interval
        routers = [p.router for p in self.parts]
        loads = [r.own_loads() for r in routers]
        adds = [r.take_prefix_additions() for r in routers]
        for i, r in enumerate(routers):
            r.set_peer_loads(merge_loads(lj for j, lj in enumerate(loads) if j != i))
            r.add_peer_prefixes(a for j, lst in enumerate(adds) if j != i for a in lst)

    def _fail_over(self) -> None:
        """The active replica is gone: the next one decides. As the link does (peer_link.py), it
        drops the dead one's in-flight counts at once and holds its since-scrape counts for two
        scrape intervals (those requests are on the engines, in none of its scrapes yet)."""
        now = self.clock()
        if self.release_at is not None and now >= self.release_at:
            self.parts[self.active].router.set_peer_loads({})
            self.release_at = None
        if self.active + 1 < len(self.parts) and self.decisions == self.failover_after:
            dead = self.parts[self.active].router.own_loads()
            self.active += 1
            if self.linked:
                held = {a: (0, 0, load[2], load[3]) for a, load in dead.items() if load[2] or load[3]}
                self.parts[self.active].router.set_peer_loads(held)
                self.release_at = now + 2 * self.scrape_interval

    def _follow(self) -> None:
        """The peer link: the active replica's decisions reach the standbys as they happen."""
        leader = self.parts[self.active].router
        loads, adds = leader.own_loads(), leader.take_prefix_additions()
        for p in self.parts[self.active + 1:]:
            p.router.set_peer_loads(loads)
            p.router.add_peer_prefixes(adds)

    def pick(self, request):
        if self.shared:
            self._sync()
        if self.failover_after is not None:
            self._fail_over()
        i = self.active if self.active_passive else self.rng.randrange(len(self.parts))
        endpoint = self.parts[i].pick(request)
        self.decisions += 1
        if self.failover_after is not None and self.linked:
            self._follow()
        self.replica_of[id(request)] = i
        return endpoint

    def on_done(self, request, endpoint):
        if self.shared:
            self._sync()
        i = self.replica_of.pop(id(request), None)
        if i is None:
            return
        if self.failover_after is None:
            self.parts[i].on_done(request, endpoint)
            return
        # Envoy's access log goes to the acting replica (the ready one), which relays each
        # outcome over the link, so a linked standby learns answer lengths and timings as the
        # leader does; a cold one hears only what arrives once it acts; a dead one, nothing.
        for p in self.parts[self.active:] if self.linked else self.parts[self.active:self.active + 1]:
            p.on_done(request, endpoint)
        if self.linked and i == self.active:
            self._follow()
