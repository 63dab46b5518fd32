"""Picker replicas as one lab policy: N copies of the picker's real Router, each request decided
by one replica drawn at random (Envoy spreads ext_proc streams over the picker's endpoints).

- independent: nothing shared; each replica learns prefix affinity from its share of the
  traffic and counts only its own in-flight requests (`replicas:N:independent`);
- active-passive (`replicas:N:active-passive`, what base/picker runs with --leader-election):
  one leader decides every request, the N-1 standbys follow the engines' KV-cache events too but
  decide nothing (they are not Ready, so Envoy sends them no stream). The decisions are the
  leader's alone, so by construction this is one picker; no failover is modelled (in the
  deployment a failover is a gap of 5xx under FailClose, not a routing change:
  picker/README.md "High availability");
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
                 kv_delay: float | None = None, active_passive: bool = False):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        # Precise: every replica subscribes to every engine on its own (same batches, same delay).
        self.parts = [PickerPolicy(profile, precise=precise, kv_delay=kv_delay)
                      for _ in range(replicas)]
        self.kv_events = precise
        self.scrape_interval = self.parts[0].scrape_interval  # the lab records engine history
        self.active_passive = active_passive
        self.shared = shared and replicas > 1 and not active_passive
        self.sync_interval = sync_interval
        self.name = f"replicas:{replicas}" + (":active-passive" if active_passive else
                                              "" if shared else ":independent")
        if precise:
            self.name += self.parts[0].name[len("picker"):]

    @classmethod
    def from_name(cls, name: str, **options) -> "ReplicatedPicker":
        """`replicas:N` (shared view, exchanged every PEER_SYNC_INTERVAL), `replicas:N:sync=S`
        (every S seconds; 0 = before every decision), `replicas:N:independent` or
        `replicas:N:active-passive`."""
        parts = name.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise ValueError(f"bad policy {name!r}: replicas:N[:independent|:active-passive|:sync=SECONDS]")
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
            if self.shared:
                p.router.share_with_peers()
        self.rng = random.Random(rng.random())
        self.replica_of: dict[int, int] = {}
        self.next_sync = -math.inf

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

    def pick(self, request):
        if self.shared:
            self._sync()
        i = 0 if self.active_passive else self.rng.randrange(len(self.parts))
        endpoint = self.parts[i].pick(request)
        self.replica_of[id(request)] = i
        return endpoint

    def on_done(self, request, endpoint):
        if self.shared:
            self._sync()
        i = self.replica_of.pop(id(request), None)
        if i is not None:
            self.parts[i].on_done(request, endpoint)
