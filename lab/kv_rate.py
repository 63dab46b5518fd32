"""How many KV-cache events an engine publishes: the simulator's engine core under a workload,
in virtual time (the same engine code `python -m local.sim` runs; its events are what the HTTP
server publishes, one batch per engine step that produced any).

    python -m lab.kv_rate [--workload demo] [--seeds 0 1 2 3 4] [--json FILE]

Defaults: the `demo` workload on the local stack's pool (3 groups, the a10-qwq32b engine model
with its KV capacity / 6, concurrency 30), routed by least request. Rates are per engine and per
model second; the local stack at speedup S publishes S times as many per wall second. Payload
bytes are the msgpack payloads as local/sim/kv_events.py encodes them (vLLM's format).
"""

from __future__ import annotations

import argparse
import json
import sys

from lab.experiment import named_workload, run_policies
from lab.policies import LeastRequest
from lab.simulation import LabConfig
from lab.stats import over_seeds
from loadtest.workloads import DEMO_SCALE  # the demo's simulators have the KV capacity / this
from local.sim.engine import BlockRemoved, BlockStored
from local.sim.engines import A10_QWQ32B
from local.sim.kv_events import encode_batch


class CountingLeastRequest(LeastRequest):
    """Least request, counting the KV-cache events the engines publish."""
    name = "least-request"
    kv_events = True

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.counts = {ep.address: dict(batches=0, events=0, stored_events=0, blocks_stored=0,
                                        blocks_removed=0, cleared=0, payload_bytes=0, last=0.0)
                       for ep in endpoints}

    def on_kv_events(self, endpoint, seq, events, at):
        c = self.counts[endpoint.address]
        c["batches"] += 1
        c["events"] += len(events)
        for e in events:
            if isinstance(e, BlockStored):
                c["stored_events"] += 1
                c["blocks_stored"] += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                c["blocks_removed"] += len(e.block_hashes)
            else:
                c["cleared"] += 1
        c["payload_bytes"] += len(encode_batch(events, at))
        c["last"] = max(c["last"], at)


RATE_KEYS = ("batches", "events", "blocks_stored", "blocks_removed", "payload_bytes")


def measure(workload: str = "demo", seeds: list[int] | None = None, engines: int = 3,
            kv_scale: int = DEMO_SCALE, concurrency: int = 30) -> dict:
    seeds = seeds or [0]
    model = A10_QWQ32B.with_overrides(num_gpu_blocks=A10_QWQ32B.num_gpu_blocks // kv_scale)
    policies = []
    factory = {"least-request": lambda: policies.append(CountingLeastRequest()) or policies[-1]}
    runs = run_policies(named_workload(workload), factory, seeds,
                        LabConfig(num_engines=engines, engine_model=model, concurrency=concurrency))
    per_run = []
    for policy, run in zip(policies, runs["least-request"]):
        duration = run.summary["duration"]
        for address, c in policy.counts.items():
            per_run.append({k: c[k] / duration for k in RATE_KEYS})
    stats = {k: over_seeds(r[k] for r in per_run) for k in RATE_KEYS}   # over seeds and engines
    mean = {k: stats[k]["mean"] for k in RATE_KEYS}
    peak = {k: stats[k]["max"] for k in RATE_KEYS}
    return {"workload": workload, "seeds": seeds, "engines": engines, "concurrency": concurrency,
            "engine_model": model.name, "num_gpu_blocks": model.num_gpu_blocks,
            "block_size": model.block_size,
            "per_engine_per_model_s": {"mean": mean, "max": peak},
            "durations_s": [r.summary["duration"] for r in runs["least-request"]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.kv_rate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="demo")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--json", help="also write the result here")
    a = p.parse_args(argv)
    out = measure(a.workload, a.seeds)
    m, x = out["per_engine_per_model_s"]["mean"], out["per_engine_per_model_s"]["max"]
    print(f"{a.workload}, {out['engines']} engines ({out['num_gpu_blocks']} blocks of "
          f"{out['block_size']}), seeds {' '.join(map(str, a.seeds))}: per engine and model second")
    for k in RATE_KEYS:
        print(f"  {k:16s} mean {m[k]:10.1f}   max {x[k]:10.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
