"""Picker replicas in the lab: how much routing quality 1, 2 and 4 replicas keep.

Each replica is the picker's real Router (lab.picker_policy.PickerPolicy); every request goes to
one replica drawn at random (Envoy spreads ext_proc streams over the picker's endpoints), and
only that replica sees it. Two ways to run them:

- independent: nothing shared; each replica learns prefix affinity from its share of the
  traffic and counts only its own in-flight requests (plain `replicas: N`);
- shared: every `sync_interval` seconds (PEER_SYNC_INTERVAL; `replicas:N:sync=S` sets it;
  the picker itself sends changes as they happen and the whole table every PEER_SYNC_INTERVAL,
  so `sync=0` and the default bound it from both sides) the replicas exchange what the picker's signals process
  relays between workers and replicas (picker/src/picker/signals_process.py): each one's
  in-flight counts per endpoint (`Router.own_loads` -> `Router.set_peer_loads`) and the
  prefix-index additions of its decisions (`Router.prefix_log` -> `Router.add_peer_prefixes`).

    python -m lab.replicas [--workload shared-prefix] [--engines 16] [--seeds 0 1 2]
                           [--replicas 1 2 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time

from picker import defaults

from loadtest.metrics import percent_change
from lab.picker_policy import PickerPolicy
from lab.policies import Policy


class ReplicatedPicker(Policy):
    def __init__(self, replicas: int, shared: bool = True, profile: str = "default",
                 sync_interval: float = defaults.PEER_SYNC_INTERVAL):
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        self.parts = [PickerPolicy(profile) for _ in range(replicas)]
        self.scrape_interval = self.parts[0].scrape_interval  # the lab records engine history
        self.shared = shared and replicas > 1
        self.sync_interval = sync_interval
        self.name = f"replicas:{replicas}" + ("" if shared else ":independent")

    @classmethod
    def from_name(cls, name: str) -> "ReplicatedPicker":
        """`replicas:N` (shared view, exchanged every PEER_SYNC_INTERVAL), `replicas:N:sync=S`
        (every S seconds; 0 = before every decision) or `replicas:N:independent`."""
        parts = name.split(":")
        if len(parts) not in (2, 3) or not parts[1].isdigit():
            raise ValueError(f"bad policy {name!r}: replicas:N[:independent|:sync=SECONDS]")
        option = parts[2] if len(parts) == 3 else ""
        if option == "independent":
            return cls(int(parts[1]), shared=False)
        if option.startswith("sync="):
            try:
                return cls(int(parts[1]), sync_interval=float(option[5:]))
            except ValueError:
                pass
        elif not option:
            return cls(int(parts[1]))
        raise ValueError(f"bad policy {name!r}: replicas:N[:independent|:sync=SECONDS]")

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        # Same scrape phases in every replica (their scrapes read the same engine history); the
        # first replica draws from `rng` exactly as a lone PickerPolicy would.
        for p in self.parts:
            p.start(endpoints, clock, rng)
            if self.shared:
                p.router.prefix_log = []
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
        adds = []
        for r in routers:
            adds.append(r.prefix_log)
            r.prefix_log = []
        for i, r in enumerate(routers):
            total: dict[str, tuple] = {}
            for j, lj in enumerate(loads):
                if j == i:
                    continue
                for addr, load in lj.items():
                    t = total.get(addr, (0, 0, 0, 0))
                    total[addr] = tuple(a + b for a, b in zip(t, load))
            r.set_peer_loads(total)
            r.add_peer_prefixes(a for j, lst in enumerate(adds) if j != i for a in lst)

    def pick(self, request):
        if self.shared:
            self._sync()
        i = self.rng.randrange(len(self.parts))
        endpoint = self.parts[i].pick(request)
        self.replica_of[id(request)] = i
        return endpoint

    def on_done(self, request, endpoint):
        if self.shared:
            self._sync()
        i = self.replica_of.pop(id(request), None)
        if i is not None:
            self.parts[i].on_done(request, endpoint)


def policies_for(replicas: list[int]) -> list[str]:
    """One replica, then per count: shared, independent; and the largest count sharing before
    every decision (no exchange delay: the upper bound of a shared view)."""
    out = []
    for n in replicas:
        out.append("picker" if n == 1 else f"replicas:{n}")
        if n > 1:
            out.append(f"replicas:{n}:independent")
    if max(replicas) > 1:
        out.append(f"replicas:{max(replicas)}:sync=0")
    return out


def run(workload: str, engines: int, seeds: list[int], replicas: list[int],
        num_prompts: int | None = None, request_rate: float = math.inf) -> dict:
    """Mean TTFT (and the rest of the lab's table) per policy over seeds, like `lab run`."""
    from lab.__main__ import aggregate
    from lab.policies import make_policy
    from lab.runner import LabConfig, prepare_requests, run_lab
    from loadtest.workloads import build_workload, workload_settings
    from local.sim.engines import DEFAULT_ENGINE_MODEL, get_engine_model

    engine_model = get_engine_model(DEFAULT_ENGINE_MODEL)
    settings = workload_settings(workload, num_prompts=num_prompts)
    concurrency = settings.get("concurrency")
    if concurrency and engines != 3:
        concurrency = concurrency * engines // 3  # the same load per engine as the 3-group pool
    names = policies_for(replicas)
    results: dict[str, list[dict]] = {n: [] for n in names}
    started = time.perf_counter()
    for seed in seeds:
        specs = build_workload(workload, seed=seed, num_prompts=num_prompts)
        requests = prepare_requests(specs, engine_model.block_size)
        for name in names:
            config = LabConfig(num_engines=engines, engine_model=engine_model, concurrency=concurrency,
                               request_rate=request_rate, seed=seed)
            r = run_lab(requests, make_policy(name), config)
            results[name].append(r.summary)
            print(f"  {workload} {name} seed {seed}: mean TTFT {r.summary['mean_ttft_ms']:.0f} ms",
                  file=sys.stderr, flush=True)
    agg = aggregate(results)
    return {"workload": workload, "engines": engines, "seeds": seeds, "concurrency": concurrency,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "num_prompts": num_prompts, "replicas": replicas,
            "sync_interval_s": defaults.PEER_SYNC_INTERVAL, "wall_s": time.perf_counter() - started,
            "policies": agg}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="shared-prefix")
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-prompts", type=int)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s (default: all at once, then as the concurrency allows)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    out = run(a.workload, a.engines, a.seeds, a.replicas, a.num_prompts, a.request_rate)
    base = out["policies"]["picker"]["mean_ttft_ms"]["mean"]
    print(f"{a.workload}, {a.engines} engines, seeds {' '.join(map(str, a.seeds))}: mean TTFT "
          "(ms, mean ± std over seeds), change against one replica")
    for name, stats in out["policies"].items():
        m = stats["mean_ttft_ms"]
        print(f"  {name:26s} {m['mean']:9.0f} ± {m['std']:6.0f}  {percent_change(base, m['mean']):+6.1f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
