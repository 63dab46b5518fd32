"""Picker replicas in the lab: how much routing quality 1, 2 and 4 replicas keep.

Each replica is the picker's real Router; every request goes to one replica drawn at random, and
only that replica sees it. The replicas run independent or shared (the policy
`replicas:N[:independent|:sync=S]`, lab/replicated_picker.py, says how they share).

    python -m lab.replicas [--workload shared-prefix] [--engines 16] [--seeds 0 1 2]
                           [--replicas 1 2 4] [--precise] [--json FILE]

`--precise`: the replicas route on the engines' KV-cache events, each subscribed on its own
(`+precise` policies): one picker, then 2 and 4 independent replicas, with and without events,
and 2 and 4 replicas active-passive with events (`replicas:N:active-passive+precise`: one
leader decides, the standbys follow the events; base/picker's --leader-election).
`--failover F` adds 2 replicas active-passive whose leader is gone after the fraction F of the
requests: the standby then decides with the view the peer link gave it (the leader's counts,
prefix additions and the outcomes it relayed)
(`replicas:2:active-passive:failover=K+precise`), and, for comparison, one without the link
(`...:failover=K:cold+precise`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from picker import defaults

from lab.experiment import named_workload, run_policies, summaries
from lab.simulation import LabConfig
from lab.stats import SUMMARY_KEYS, aggregate
from loadtest.metrics import percent_change
from loadtest.workloads import workload_settings
from local.sim.engines import DEFAULT_ENGINE_MODEL, get_engine_model


def precise_policies_for(replicas: list[int], failover_after: int | None = None) -> list[str]:
    """One picker and N independent replicas, approximate and precise (`+precise`), and N
    replicas active-passive, precise (what base/picker deploys); with `failover_after`, 2
    active-passive replicas failing over after that many decisions, linked and cold."""
    out = []
    for n in replicas:
        name = "picker" if n == 1 else f"replicas:{n}:independent"
        out += [name, f"{name}+precise"]
    out += [f"replicas:{n}:active-passive+precise" for n in replicas if n > 1]
    if failover_after is not None:
        out += [f"replicas:2:active-passive:failover={failover_after}{cold}+precise"
                for cold in ("", ":cold")]
    return out


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
        num_prompts: int | None = None, request_rate: float = math.inf,
        precise: bool = False, failover: float | None = None) -> dict:
    """Mean TTFT (and the rest of the lab's table) per policy over seeds, like `lab run`."""
    engine_model = get_engine_model(DEFAULT_ENGINE_MODEL)
    settings = workload_settings(workload, num_prompts=num_prompts)
    concurrency = settings.get("concurrency")
    if concurrency and engines != 3:
        concurrency = concurrency * engines // 3  # the same load per engine as the 3-group pool

    def progress(name: str, seed: int, result) -> None:
        print(f"  {workload} {name} seed {seed}: mean TTFT {result.summary['mean_ttft_ms']:.0f} ms",
              file=sys.stderr, flush=True)

    started = time.perf_counter()
    config = LabConfig(num_engines=engines, engine_model=engine_model, concurrency=concurrency,
                       request_rate=request_rate)
    failover_after = None
    if failover is not None:
        failover_after = int(len(named_workload(workload, num_prompts)(seeds[0])) * failover)
    policies = precise_policies_for(replicas, failover_after) if precise else policies_for(replicas)
    runs = run_policies(named_workload(workload, num_prompts), policies, seeds,
                        config, on_run=progress)
    return {"workload": workload, "engines": engines, "seeds": seeds, "concurrency": concurrency,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "num_prompts": num_prompts, "replicas": replicas, "precise": precise,
            "failover_after": failover_after,
            "sync_interval_s": defaults.PEER_SYNC_INTERVAL, "wall_s": time.perf_counter() - started,
            "policies": aggregate(summaries(runs), SUMMARY_KEYS)}


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
    p.add_argument("--precise", action="store_true",
                   help="independent replicas with and without KV-cache events (+precise)")
    p.add_argument("--failover", type=float, metavar="F",
                   help="with --precise: also 2 active-passive replicas whose leader is gone after "
                        "this fraction of the requests, the standby linked and cold")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if a.failover is not None and not (a.precise and 0 < a.failover < 1):
        p.error("--failover needs --precise and a fraction between 0 and 1")
    out = run(a.workload, a.engines, a.seeds, a.replicas, a.num_prompts, a.request_rate, a.precise,
              a.failover)
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
