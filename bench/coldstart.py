"""Cold start: a burst of concurrent requests sharing a prefix no group has seen, sent to a
freshly started router (a picker restart, a rollout, a new shared system prompt), in the lab.

    python -m bench coldstart

How the first N requests spread over the groups and their TTFT, for least request and the
picker's `default` and `upstream-default` profiles, over several trials (each trial: new engines,
a new picker, a new prefix). A router that learns prefix affinity can herd the whole burst onto
the first group that got the prefix before any scrape shows the load; `default` must spread the
burst no worse than least request.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench.common import load_average, save, stamp
from lab.stats import mean
from loadtest.prompts import PromptSpec, random_words
from local.sim.clock import to_model_seconds

POLICIES = ("least-request", "picker", "picker-upstream")
BURST = 30            # the article's concurrency: every client sends at once
PREFIX_WORDS = 2000   # the new shared system prompt (1 word = 1 token in the simulator)
QUESTION_WORDS = 200
OUTPUT_TOKENS = 300


def burst(trial: int):
    rng = np.random.default_rng(1000 + trial)
    prefix = random_words(rng, PREFIX_WORDS)
    return [PromptSpec(f"{prefix} {random_words(rng, QUESTION_WORDS)}", PREFIX_WORDS + QUESTION_WORDS,
                       OUTPUT_TOKENS, group="new-prefix") for _ in range(BURST)]


def _summary(trials: list[dict]) -> dict:
    """One policy's trials and their means (the largest group's share of the burst, TTFTs)."""
    return {"trials": trials,
            "mean_largest_share": mean(r["per_group"][0] for r in trials) / BURST,
            "all_on_one_group": sum(r["groups_used"] == 1 for r in trials),
            "mean_ttft_ms": mean(r["mean_ttft_ms"] for r in trials),
            "mean_max_ttft_ms": mean(r["max_ttft_ms"] for r in trials)}


def run(trials: int) -> dict:
    """Every policy on `trials` bursts (trial t: the prompts of burst(t), policy seed t)."""
    from lab.experiment import run_policies
    from lab.simulation import LabConfig
    from local.sim.engines import DEFAULT_ENGINE_MODEL, get_engine_model

    config = LabConfig(concurrency=BURST, engine_model=get_engine_model(DEFAULT_ENGINE_MODEL))
    out = {}
    for name, results in run_policies(burst, POLICIES, range(trials), config).items():
        rows = []
        for result in results:
            per_group = sorted((sum(1 for s in result.samples if s.target == ep) for ep in result.per_endpoint),
                               reverse=True)
            ttfts = [s.ttft * 1000 for s in result.samples]
            rows.append({"per_group": per_group, "groups_used": sum(1 for n in per_group if n),
                         "mean_ttft_ms": statistics.mean(ttfts), "max_ttft_ms": max(ttfts)})
        out[name] = _summary(rows)
        print(f"{name:16} largest group {out[name]['mean_largest_share']:.0%} of the burst, "
              f"mean TTFT {out[name]['mean_ttft_ms']:,.0f} ms", flush=True)
    return out


def main(trials: int = 10, http_trials: int = 3) -> dict:
    started, load_start = time.monotonic(), load_average()
    data = {"command": "python -m bench coldstart", "trials": trials, "burst": BURST,
            "prefix_tokens": PREFIX_WORDS, "question_tokens": QUESTION_WORDS, "output_tokens": OUTPUT_TOKENS,
            "load_average_start": load_start, "lab": run(trials), "http": run_http(http_trials) if http_trials else None,
            "http_speedup": HTTP_SPEEDUP, "wall_s": time.monotonic() - started, **stamp()}
    save("coldstart", data)
    return data


def report(d: dict) -> list[str]:
    lines = [f"Command: `{d['command']}` (lab, 3 A10 groups, {d['trials']} trials; HTTP: the local stack on the real "
             f"data plane, speedup {d.get('http_speedup', 20):g}, times in model ms, simulators and picker restarted "
             f"before each trial): {d['burst']} requests at once, "
             f"all starting with the same new {d['prefix_tokens']:,}-token prefix (+{d['question_tokens']} distinct "
             f"tokens, {d['output_tokens']} out), to idle engines and a router that has seen nothing.", "",
             "| policy | requests on the busiest group (mean) | trials with all on one group | per trial (busiest first) "
             "| mean TTFT ms | mean of max TTFT ms |", "|---|---|---|---|---|---|"]
    rows = [(f"lab {n}", r) for n, r in d["lab"].items()] + [(f"HTTP {n}", r) for n, r in (d.get("http") or {}).items()]
    for name, r in rows:
        spread = " ".join("/".join(map(str, t["per_group"])) for t in r["trials"])
        lines.append(f"| {name} | {r['mean_largest_share']:.0%} | {r['all_on_one_group']} of {len(r['trials'])} | "
                     f"{spread} | {r['mean_ttft_ms']:,.0f} | {r['mean_max_ttft_ms']:,.0f} |")
    return lines


# -- the same burst over HTTP, through the real Envoy ----------------------------------------------

HTTP_SPEEDUP = 20.0


async def _burst_http(port: int, specs, sims: list[str], headers: dict[str, str]) -> dict:
    import aiohttp

    async def successes(session, address):
        async with session.get(f"http://{address}/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total"))

    async def one(session, spec):
        body = {"model": "qwq", "prompt": spec.prompt, "max_tokens": spec.output_tokens, "ignore_eos": True,
                "stream": True}
        sent = time.monotonic()
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            first = None
            async for _ in r.content:
                first = first or time.monotonic()
        return to_model_seconds(first - sent, HTTP_SPEEDUP) * 1000  # model ms

    import asyncio
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = [await successes(session, a) for a in sims]
        ttfts = await asyncio.gather(*(one(session, s) for s in specs))
        after = [await successes(session, a) for a in sims]
    per_group = sorted((int(b - a) for a, b in zip(before, after)), reverse=True)
    return {"per_group": per_group, "groups_used": sum(1 for n in per_group if n),
            "mean_ttft_ms": statistics.mean(ttfts), "max_ttft_ms": max(ttfts)}


def run_http(trials: int) -> dict:
    """The burst through the local stack: listener http (least request) and llm-gw with each
    picker profile; simulators and picker restarted (cold) before every trial."""
    import asyncio

    from local.stack import Stack, StackConfig
    from local.stack.launcher import reset

    out = {}
    for name, profile, listener in (("least-request", "default", "http"), ("picker", "default", "llm-gw"),
                                    ("picker-upstream", "upstream-default", "llm-gw")):
        config = StackConfig(name=f"bench-coldstart-{profile}", profile=profile, speedup=HTTP_SPEEDUP)
        with Stack(config) as stack:
            port = stack.http_port if listener == "http" else stack.llm_port
            sims = [s.address for s in stack.topology.sims]
            rows = []
            for trial in range(trials):
                if reset(config.name, config.run_root) != 0:
                    raise RuntimeError("local.stack reset failed")
                rows.append(asyncio.run(_burst_http(port, burst(trial), sims, stack.auth_headers())))
        out[name] = _summary(rows)
        print(f"HTTP {name:16} largest group {out[name]['mean_largest_share']:.0%} of the burst", flush=True)
    return out
