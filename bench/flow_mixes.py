"""Flow control with several clients (lab): mixes of clients whose answers differ ~10x in
length, below saturation and at it, the picker without and with its flow control.

Run by `python -m bench flow` after fairness and priorities. Every client's prompts draw from
the same lengths (PROMPT_TOKENS); its answers from its own range (OUTPUT_TOKENS: chat ~250
tokens, agent ~800, reasoning ~2,500). Each mix runs on 3 A10 groups with, per seed, the same
requests for every policy:

- least request, the picker without flow control (`picker`), with it (`picker-flow`) and with
  it while the clients send no `x-client-id` (`picker-flow, no client ids`: the holdback then
  sees one client, so only the room test acts);
- arrivals: `one loop` (one closed loop whose requests belong to the clients by their shares: a
  gateway's clients seen as one), `own loops` (each client its own closed loop, its concurrency
  its share of the total: LabConfig.group_concurrency) or `open` (Poisson, a fraction of the
  mix's capacity = least request's request throughput on the mix, closed loop at
  CAPACITY_CONCURRENCY, measured per seed; each request's client drawn by the shares).

Target below saturation: flow control never worse than the picker without it beyond the seed
spread (mean and P99 TTFT, output throughput; spread = the larger of the two std over seeds) and
no request refused. At saturation the figures are reported: there the holdback leaves a reserve
for the client that sends fewer requests (request counts are what it can see of a client's load).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from lab.stats import over_seeds

PROMPT_TOKENS = (1000, 3000)
OUTPUT_TOKENS = {"chat": (100, 400), "agent": (400, 1200), "reasoning": (1000, 4000)}
CAPACITY_CONCURRENCY = 60          # a closed loop that keeps the pool saturated
POLICIES = ("least-request", "picker", "picker-flow", "picker-flow, no client ids")
KEYS = ("mean_ttft_ms", "p99_ttft_ms", "output_throughput", "failed")


@dataclass(frozen=True)
class Mix:
    name: str
    shares: tuple[tuple[str, float], ...]   # (client, share of the requests / of the concurrency)
    arrivals: str                           # "one loop" | "own loops" | "open"
    load: float                             # loops: total concurrency; open: fraction of capacity
    saturated: bool
    requests: int = 200                     # own loops: the client with the longest answers sends
                                            # its share of this, the others in proportion to speed

    def describe(self) -> str:
        shares = " / ".join(f"{c} {s:.0%}" for c, s in self.shares)
        load = f"concurrency {self.load:g}" if self.arrivals != "open" else f"{self.load:g}x capacity"
        return f"{shares}, {self.arrivals}, {load}"


CHAT_REASONING = (("chat", 0.6), ("reasoning", 0.4))
THREE = (("chat", 0.5), ("agent", 0.3), ("reasoning", 0.2))
REASONING_BUSIER = (("chat", 0.2), ("reasoning", 0.8))
MIXES = [
    Mix("2 clients, one loop", CHAT_REASONING, "one loop", 28, False),
    Mix("2 clients, own loops", CHAT_REASONING, "own loops", 28, False),
    Mix("3 clients, own loops", THREE, "own loops", 28, False),
    Mix("3 clients, open", THREE, "open", 0.7, False),
    Mix("2 clients, reasoning busier, open", REASONING_BUSIER, "open", 0.7, False),
    Mix("2 clients, one loop, saturated", CHAT_REASONING, "one loop", 56, True),
    Mix("3 clients, own loops, saturated", THREE, "own loops", 56, True),
    Mix("3 clients, open, saturated", THREE, "open", 2.0, True),
]


def _engine():
    from local.sim.engines import A10_QWQ32B
    return A10_QWQ32B


def _specs(seed: int, clients: list[str]) -> list:
    """One prompt per entry of `clients`, its answer length from its client's range."""
    from loadtest.prompts import PromptSpec, random_words
    gen = np.random.default_rng(seed)
    out = []
    for c in clients:
        n_in = int(gen.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1))
        lo, hi = OUTPUT_TOKENS[c]
        out.append(PromptSpec(prompt=random_words(gen, n_in), prompt_tokens=n_in,
                              output_tokens=int(gen.integers(lo, hi + 1)), group=c))
    return out


def _counts(mix: Mix) -> dict[str, int]:
    """Own loops: requests per client so that the loops last about as long (a client's rate is
    its concurrency over its requests' duration, ~ its prompt and answer tokens)."""
    cost = {c: sum(PROMPT_TOKENS) / 2 / 8 + sum(OUTPUT_TOKENS[c]) / 2 for c, _ in mix.shares}
    slowest = max(cost, key=cost.get)
    base = dict(mix.shares)[slowest] * mix.requests
    return {c: max(1, round(base * (s / dict(mix.shares)[slowest]) * cost[slowest] / cost[c]))
            for c, s in mix.shares}


def _requests(mix: Mix, seed: int) -> list:
    from lab.simulation import prepare_requests
    gen = np.random.default_rng(seed + 7919)
    names = [c for c, _ in mix.shares]
    if mix.arrivals == "own loops":
        clients = [c for c, n in _counts(mix).items() for _ in range(n)]
        clients = [clients[i] for i in gen.permutation(len(clients))]
    else:
        clients = list(gen.choice(names, size=mix.requests, p=[s for _, s in mix.shares]))
    reqs = prepare_requests(_specs(seed, [str(c) for c in clients]), _engine().block_size)
    for r in reqs:
        r.client = r.group
    return reqs


def _config(mix: Mix, seed: int, reqs: list, capacity: float | None):
    from lab.simulation import LabConfig
    if mix.arrivals == "one loop":
        return LabConfig(concurrency=int(mix.load), seed=seed, engine_model=_engine())
    if mix.arrivals == "own loops":
        limits = {c: max(1, round(s * mix.load)) for c, s in mix.shares}
        return LabConfig(concurrency=None, group_concurrency=limits, seed=seed, engine_model=_engine())
    gaps = np.random.default_rng(seed).exponential(1.0 / (mix.load * capacity), size=len(reqs))
    for r, t in zip(reqs, np.cumsum(gaps).tolist()):
        r.arrival = t
    return LabConfig(concurrency=None, seed=seed, engine_model=_engine())


def _capacity(mix: Mix, seed: int, reqs: list) -> float:
    from lab.policies import make_policy
    from lab.simulation import LabConfig, run_lab
    for r in reqs:
        r.arrival = None
    run = run_lab(reqs, make_policy("least-request"),
                  LabConfig(concurrency=CAPACITY_CONCURRENCY, seed=seed, engine_model=_engine()))
    return run.summary["request_throughput"]


def _policy(name: str):
    from lab.picker_policy import PickerPolicy
    from lab.policies import make_policy
    if name == "least-request":
        return make_policy(name)
    return PickerPolicy("default", flow=name.startswith("picker-flow"))


def _run(mix: Mix, seed: int) -> dict:
    """Every policy on the mix's requests for one seed: its summary keys, per client, held."""
    from lab.simulation import run_lab
    reqs = _requests(mix, seed)
    capacity = _capacity(mix, seed, reqs) if mix.arrivals == "open" else None
    config = _config(mix, seed, reqs, capacity)
    out = {"seed": seed, "capacity_rps": capacity, "policies": {}}
    for name in POLICIES:
        ids = not name.endswith("no client ids")
        for r in reqs:
            r.client = r.group if ids else ""
        policy = _policy(name)
        run = run_lab(reqs, policy, config)
        s = run.summary
        out["policies"][name] = {**{k: s[k] for k in KEYS}, "held": getattr(policy, "held", 0),
                                 "clients": _by_client(run.samples)}
    return out


def _by_client(samples) -> dict:
    out = {}
    for c in sorted({s.group for s in samples}):
        ok = [s.ttft * 1000 for s in samples if s.group == c and s.success]
        out[c] = {"completed": len(ok), "failed": sum(1 for s in samples if s.group == c and not s.success),
                  "mean_ttft_ms": statistics.fmean(ok) if ok else None}
    return out


def run(seeds: list[int], mixes: list[Mix] | None = None) -> list[dict]:
    rows = []
    for mix in mixes or MIXES:
        runs = []
        for seed in seeds:
            r = _run(mix, seed)
            runs.append(r)
            p = r["policies"]
            print(f"mix {mix.name:36} seed {seed}: mean TTFT ms " + ", ".join(
                f"{n} {p[n]['mean_ttft_ms']:,.0f} ({p[n]['failed']} failed)" for n in POLICIES), flush=True)
        rows.append({"mix": mix.name, "about": mix.describe(), "saturated": mix.saturated,
                     "runs": runs, "stats": _stats(runs), "assessment": assess(_stats(runs))})
    return rows


def _stats(runs: list[dict]) -> dict:
    """policy -> key -> over seeds (plus each client's mean TTFT and failed, summed over seeds)."""
    out = {}
    for name in POLICIES:
        per = [r["policies"][name] for r in runs]
        out[name] = {k: over_seeds(p[k] for p in per) for k in KEYS}
        out[name]["held"] = sum(p["held"] for p in per)
        clients = sorted(per[0]["clients"])
        out[name]["clients"] = {c: {"mean_ttft_ms": statistics.fmean(
            p["clients"][c]["mean_ttft_ms"] for p in per if p["clients"][c]["mean_ttft_ms"] is not None),
            "failed": sum(p["clients"][c]["failed"] for p in per)} for c in clients}
    return out


def assess(stats: dict, with_flow: str = "picker-flow", without: str = "picker") -> dict:
    """Flow control against the picker without it: worse beyond the seed spread per key, and
    requests refused (over all seeds)."""
    worse = {}
    for key, higher_better in (("mean_ttft_ms", False), ("p99_ttft_ms", False), ("output_throughput", True)):
        a, b = stats[with_flow][key], stats[without][key]
        diff = a["mean"] - b["mean"]
        worse[key] = (-diff if higher_better else diff) > max(a["std"], b["std"])
    refused = int(sum(stats[with_flow]["failed"]["values"]))
    return {"worse_beyond_spread": worse, "refused": refused,
            "met": not any(worse.values()) and refused == 0}


def report(rows: list[dict]) -> list[str]:
    from bench.markdown import md_table, num, versus
    lines = ["**Several clients** (`bench/flow_mixes.py`): chat (~250-token answers), agent (~800) and "
             "reasoning (~2,500) clients, the same prompt lengths (1,000-3,000 tokens), 200 requests a "
             "run (own loops: the reasoning client's share of 200, the others in proportion to their "
             "speed). Target below saturation: `picker-flow` never worse than `picker` beyond the "
             "seed spread (mean and P99 TTFT, output tokens/s) and no request refused. `held`: "
             "requests flow control held, all seeds.", ""]
    table = []
    for row in rows:
        st = row["stats"]
        base = st["picker"]
        for name in POLICIES:
            s = st[name]
            clients = ", ".join(f"{c} {num(v['mean_ttft_ms'])}" + (f" ({v['failed']} failed)" if v["failed"] else "")
                                for c, v in s["clients"].items())
            verdict = ""
            if name == "picker-flow":
                a = row["assessment"]
                if row["saturated"]:
                    verdict = "(saturated: reported)"
                else:
                    verdict = "met" if a["met"] else "NOT met: " + ", ".join(
                        [k for k, w in a["worse_beyond_spread"].items() if w]
                        + ([f"{a['refused']} refused"] if a["refused"] else []))
            table.append([row["mix"] if name == POLICIES[0] else "", row["about"] if name == POLICIES[0] else "",
                          name, f"{num(s['mean_ttft_ms']['mean'])} ± {num(s['mean_ttft_ms']['std'])}"
                          + ("" if name == "picker" else f" ({versus(s['mean_ttft_ms']['mean'], base['mean_ttft_ms']['mean'])})"),
                          f"{num(s['p99_ttft_ms']['mean'])} ± {num(s['p99_ttft_ms']['std'])}",
                          f"{num(s['output_throughput']['mean'])} ± {num(s['output_throughput']['std'])}",
                          f"{int(sum(s['failed']['values']))}", s["held"], clients, verdict])
    lines += md_table(["mix", "arrivals", "policy", "mean TTFT ms (vs picker)", "P99 TTFT ms",
                       "output tok/s", "refused / failed", "held", "mean TTFT ms per client", "target"], table)
    return lines
