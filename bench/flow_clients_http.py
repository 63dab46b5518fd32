"""Fairness and priorities through HTTP: two clients with their own API keys on the real data
plane, the picker with and without flow control.

    flock /tmp/local-stack.lock python -m bench flow-fairness-http [--seeds 0]

`make demo`'s stack (3 simulators at speedup 5 with the demo's KV / 6, the picker, Envoy Gateway
+ Envoy, the edge's API keys) three times: the picker with `--no-flow-control`, with
`--flow-control`, and with `--flow-control --workers 2` (base/picker's worker count).
The picker's flow-control bounds are its defaults in model time (30 s, 5 s, 120 s, 5 s divided by
the speedup), as the stack does for its scrape interval. Every run starts cold (`python -m local.stack
reset`) and goes through listener llm-gw (the picker); `loadtest compare --client` sends each
client with its own key, so the edge names them apart in `x-client-id`.

- capacity: least request's request throughput (listener http) on the demo workload, closed
  loop 30, measured first on the stack without flow control: what the lab calls capacity.
- fairness: a light client (key `user`) at 0.15 x capacity and a heavy one (key `loadtest`) at
  1.5 x (10x its rate), same priority, open loop; then the light client alone (the same requests
  at the same times). Target: its mean TTFT with the heavy one within 1.5x of alone.
- priorities: `interactive` (priority 10, key `user`) and standard (no objective: priority 0,
  key `loadtest`) at 0.75 x capacity each. Target: interactive's P99 TTFT at most half of
  standard's.
- a mix below saturation: a chat client (key `loadtest`, 60 % of the requests, answers of
  MIX_CHAT tokens) and a reasoning client (key `user`, 40 %, answers ~10x longer, MIX_REASONING)
  on the demo's prompts, MIX_LOAD x capacity in all, open loop. The busier client is the one with
  the short answers. Target: flow control refuses nothing and its mean TTFT is that of the
  picker without it (same run, wall-clock noise aside).

Beside it, the lab on the same scale (`python -m bench flow`'s experiment on the demo workload and
the demo's engines: KV / 6), same seeds, the picker without and with flow control: through HTTP
and in the lab the figures should agree.

The `user` key has the edge's per-client rate limit (120 requests a minute); the light and the
interactive client stay under it (a 429 `local_rate_limited` would show in the failures).
"""
from __future__ import annotations

import time
from pathlib import Path

from bench.common import PY, RESULTS, load_average, read_json, run, save, stamp
from bench.markdown import versus
from bench.flow import HEAVY, LIGHT, PRIORITY_LOAD

NAME = "flow-fairness-http"
WORKLOAD = "demo"
HEAVY_PROMPTS = 150                       # the lab's count
LIGHT_PROMPTS = max(10, round(HEAVY_PROMPTS * LIGHT / HEAVY))
PRIORITY_PROMPTS = 100                    # each class: stays under the `user` key's 120 a minute
CALIBRATION_PROMPTS = 150
# The mix: bench flow's chat and reasoning answer lengths (bench/flow_mixes.py) at the demo's scale.
MIX_LOAD = 0.8
MIX_PROMPTS = 150
MIX_CHAT = (17, 67)          # tokens: 100-400 / DEMO_SCALE
MIX_REASONING = (167, 667)   # 1,000-4,000 / DEMO_SCALE
# Each stack: the results' label -> (flow control off/on, more picker arguments). The local stack's
# picker runs one worker; base/picker runs 2, each with its own queue (the arrivals the holdback
# counts are shared: flowcontrol/activity.py), so flow control is also measured as deployed.
MODES = {"off": ("off", ()), "on": ("on", ()), "on-workers2": ("on", ("--workers", "2"))}
KEY_ENV = {"loadtest": "BENCH_KEY_LOADTEST", "user": "BENCH_KEY_USER"}
KEPT = ("completed", "failed", "errors_by_kind", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "total_output_tokens", "output_throughput", "request_throughput", "duration")


def flow_bounds(speedup: float) -> list[str]:
    """The picker's flow-control time bounds, its defaults in model seconds, as wall seconds."""
    from picker import defaults
    bounds = {"--flow-max-wait": defaults.FLOW_MAX_WAIT,
              "--flow-max-wait-sheddable": defaults.FLOW_MAX_WAIT_SHEDDABLE,
              "--flow-activity-window": defaults.FLOW_ACTIVITY_WINDOW,
              "--flow-stale-hold": defaults.FLOW_STALE_HOLD}
    return [a for flag, model_s in bounds.items() for a in (flag, f"{model_s / speedup:g}")]


def client_arg(name: str, rate: float, prompts: int, key: str, objective: str | None = None,
               output_len: tuple[int, int] | None = None) -> list[str]:
    fields = f"name={name},rate={rate:.4g},prompts={prompts},key_env={KEY_ENV[key]}"
    fields += f",objective={objective}" if objective else ""
    return ["--client", fields + (f",output_len={output_len[0]}-{output_len[1]}" if output_len else "")]


def fairness_clients(capacity: float, alone: bool = False) -> list[str]:
    light = client_arg("light", LIGHT * capacity, LIGHT_PROMPTS, "user")
    return light if alone else client_arg("heavy", HEAVY * capacity, HEAVY_PROMPTS, "loadtest") + light


def priority_clients(capacity: float) -> list[str]:
    rate = PRIORITY_LOAD * capacity
    return (client_arg("interactive", rate, PRIORITY_PROMPTS, "user", "interactive")
            + client_arg("standard", rate, PRIORITY_PROMPTS, "loadtest"))


def mix_clients(capacity: float) -> list[str]:
    """The chat client sends 60 % of the requests (the `user` key's rate limit is for the other)."""
    rate = MIX_LOAD * capacity
    chat = round(MIX_PROMPTS * 0.6)
    return (client_arg("chat", 0.6 * rate, chat, "loadtest", output_len=MIX_CHAT)
            + client_arg("reasoning", 0.4 * rate, MIX_PROMPTS - chat, "user", output_len=MIX_REASONING))


def kept(summary: dict) -> dict:
    return {k: summary.get(k) for k in KEPT}


class StackRuns:
    """`loadtest compare` runs against one running stack, each started cold, on one port."""

    def __init__(self, stack, seed: int, out: Path):
        self.stack, self.seed, self.out = stack, seed, out
        self.env = {env: stack.api_key(client) for client, env in KEY_ENV.items()}
        self.env["OPENAI_API_KEY"] = stack.api_key("loadtest")
        self.walls: dict[str, float] = {}

    def compare(self, label: str, port: int, args: list[str]) -> dict:
        c = self.stack.config
        out = self.out / label
        cmd = [PY, "-m", "loadtest", "compare", "--host", c.host, "--ports", str(port), "--workload", WORKLOAD,
               "--seed", str(self.seed), "--repetitions", "1", "--out", str(out),
               "--metrics-endpoints", *(f"http://{s.address}" for s in self.stack.topology.sims),
               "--before-each-run", f"{PY} -m local.stack reset --name {c.name} --run-root {c.run_root}", *args]
        self.walls[label] = run(cmd, log=self.out / f"{label}.log", env=self.env)
        return read_json(out / f"{port}.json")

    def capacity(self) -> dict:
        """Least request's closed-loop request throughput: the pool's capacity."""
        r = self.compare("capacity", self.stack.http_port, ["--num-prompts", str(CALIBRATION_PROMPTS),
                                                             "--concurrency", "30"])
        return kept(r)

    def clients(self, label: str, args: list[str]) -> dict:
        return {name: kept(s) for name, s in self.compare(label, self.stack.llm_port, args)["by_client"].items()}


def run_mode(mode: str, seed: int, capacity: float | None, picker_args: tuple[str, ...] = (),
             tag: str = "") -> tuple[dict, float | None]:
    """One stack, the picker with (`on`) or without (`off`) flow control (and `picker_args`):
    calibration when no capacity is known yet, then fairness (both clients, the light alone) and
    priorities. Runs in results/bench/flow-fairness-http/seed<seed>-<mode><tag>/."""
    from local.stack.demo import DEMO_SPEEDUP, demo_config
    from local.stack.launcher import Stack
    flag = ["--flow-control", *flow_bounds(DEMO_SPEEDUP)] if mode == "on" else ["--no-flow-control"]
    flag += list(picker_args)
    config = demo_config(name=f"bench-fairness-{mode}", seed=seed, picker_args=flag)
    out: dict = {"picker_args": flag}
    with Stack(config) as stack:
        runs = StackRuns(stack, seed, RESULTS / NAME / f"seed{seed}-{mode}{tag}")
        if capacity is None:
            out["calibration"] = runs.capacity()
            capacity = out["calibration"]["request_throughput"]
            print(f"capacity {capacity:.2f} req/s", flush=True)
        out["fairness"] = {"mixed": runs.clients("fairness", fairness_clients(capacity)),
                           "alone": runs.clients("light-alone", fairness_clients(capacity, alone=True))["light"]}
        out["priorities"] = runs.clients("priorities", priority_clients(capacity))
        out["mix"] = runs.clients("mix", mix_clients(capacity))
        out["wall_s"] = runs.walls
    f, p = out["fairness"], out["priorities"]
    print(f"flow control {mode} {' '.join(picker_args)}: light alone {f['alone']['mean_ttft_ms']:,.0f} ms, with heavy "
          f"{f['mixed']['light']['mean_ttft_ms']:,.0f} ms; P99 interactive {p['interactive']['p99_ttft_ms']:,.0f} ms, "
          f"standard {p['standard']['p99_ttft_ms']:,.0f} ms", flush=True)
    return out, capacity


def lab_same_scale(seeds: list[int]) -> dict:
    """bench flow's lab experiment on the stack's scale: the demo workload on the demo's engines."""
    from bench import flow
    from local.stack.demo import demo_config
    from local.stack.plan import sim_engine_model
    return flow.run(seeds, workload=WORKLOAD, engine=sim_engine_model(demo_config()),
                    policies=("picker", "picker-flow"))


def main(seeds: list[int] | None = None) -> dict:
    seeds = seeds or [0]
    started, load_start = time.monotonic(), load_average()
    runs = []
    for seed in seeds:
        capacity, modes = None, {}
        for label, (mode, picker_args) in MODES.items():
            modes[label], capacity = run_mode(mode, seed, capacity, picker_args, tag=label[len(mode):])
        runs.append({"seed": seed, "capacity_rps": capacity, "modes": modes})
    lab = lab_same_scale(seeds)
    data = {"command": f"python -m bench {NAME}", "workload": WORKLOAD, "speedup": 5.0, "seeds": seeds,
            "light": LIGHT, "heavy": HEAVY, "priority_load": PRIORITY_LOAD, "heavy_prompts": HEAVY_PROMPTS,
            "light_prompts": LIGHT_PROMPTS, "priority_prompts": PRIORITY_PROMPTS, "mix_load": MIX_LOAD,
            "mix_prompts": MIX_PROMPTS, "mix_chat": MIX_CHAT, "mix_reasoning": MIX_REASONING, "runs": runs, "lab": lab,
            "wall_s": time.monotonic() - started, "load_average_start": load_start, **stamp()}
    save(NAME, data)
    return data


# ---- BENCHMARKS.md -----------------------------------------------------------------------------

def _failed(row: dict) -> str:
    kinds = row.get("errors_by_kind") or {}
    return f"{row['failed']}" + (f" ({', '.join(f'{n} {k}' for k, n in kinds.items())})" if kinds else "")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "n/a"


def report(d: dict) -> list[str]:
    lines = [f"Command: `{d['command']}` (under `flock /tmp/local-stack.lock`; {d['wall_s'] / 60:.1f} min wall): "
             f"`make demo`'s stack (3 simulator processes at speedup {d['speedup']:g} with the demo's KV, the "
             "picker with one worker, Envoy Gateway + Envoy, the edge's API keys) three times: the picker without "
             "and with `--flow-control`, and with it and `--workers 2` (`on-workers2`, as base/picker runs it: "
             "each worker holds its own queue) (its time bounds in model time: 30 s, 5 s, 120 s and the 5 s stale hold / the speedup). Clients "
             "sent by `loadtest compare --client` with their own API keys (the edge sets `x-client-id` from "
             "them), open loop, Poisson, through listener llm-gw, the `demo` workload; every run starts cold. "
             "Capacity = least request's closed-loop (30) request throughput on listener http, measured first. "
             "Times are wall-clock ms at the speedup; TTFT over completed requests; a machine shared with "
             "other work. The lab's figures: \"Flow control: fairness and priorities (lab)\".", ""]
    for r in d["runs"]:
        lines += [f"Seed {r['seed']}: capacity {r['capacity_rps']:.2f} req/s.", "",
                  f"**Fairness**: light client (key `user`, {d['light']:g}x capacity, {d['light_prompts']} "
                  f"requests) and heavy client (key `loadtest`, {d['heavy']:g}x, {d['heavy_prompts']} requests), "
                  "same priority. Target: the light client's mean TTFT within 1.5x of alone.", "",
                  "| flow control | light alone: mean TTFT ms | light with heavy | ratio | light P99 alone / "
                  "with heavy | heavy mean / P99 TTFT | share of completed light / heavy | failed light | "
                  "failed heavy |", "|---|---|---|---|---|---|---|---|---|"]
        for mode, m in r["modes"].items():
            alone, light, heavy = m["fairness"]["alone"], m["fairness"]["mixed"]["light"], m["fairness"]["mixed"]["heavy"]
            done = light["completed"] + heavy["completed"]
            lines.append(f"| {mode} | {alone['mean_ttft_ms']:,.0f} | {light['mean_ttft_ms']:,.0f} | "
                         f"{_ratio(light['mean_ttft_ms'], alone['mean_ttft_ms'])}x | {alone['p99_ttft_ms']:,.0f} / "
                         f"{light['p99_ttft_ms']:,.0f} | {heavy['mean_ttft_ms']:,.0f} / {heavy['p99_ttft_ms']:,.0f} | "
                         f"{light['completed'] / done:.0%} / {heavy['completed'] / done:.0%} "
                         f"({light['completed']} / {heavy['completed']}) | {_failed(light)} | {_failed(heavy)} |")
        lines += ["", f"**Priorities**: `interactive` (priority 10, key `user`) and standard (no objective, "
                  f"priority 0, key `loadtest`), {d['priority_load']:g}x capacity and {d['priority_prompts']} "
                  "requests each. Target: interactive P99 TTFT at most half of standard's.", "",
                  "| flow control | interactive P99 TTFT ms | standard P99 | ratio | interactive mean | standard "
                  "mean | completed interactive / standard | failed interactive | failed standard |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for mode, m in r["modes"].items():
            hi, lo = m["priorities"]["interactive"], m["priorities"]["standard"]
            lines.append(f"| {mode} | {hi['p99_ttft_ms']:,.0f} | {lo['p99_ttft_ms']:,.0f} | "
                         f"{_ratio(hi['p99_ttft_ms'], lo['p99_ttft_ms'])} | {hi['mean_ttft_ms']:,.0f} | "
                         f"{lo['mean_ttft_ms']:,.0f} | {hi['completed']} / {lo['completed']} | {_failed(hi)} | "
                         f"{_failed(lo)} |")
        if all("mix" in m for m in r["modes"].values()):
            lines += [""] + _mix_lines(d, r)
        lines.append("")
    if d.get("lab"):
        lines += _lab_lines(d["lab"])
    return lines[:-1]


def _mix_lines(d: dict, r: dict) -> list[str]:
    chat, reasoning = d.get("mix_chat", MIX_CHAT), d.get("mix_reasoning", MIX_REASONING)
    lines = [f"**A mix below saturation**: chat (key `loadtest`, 60 % of {d.get('mix_prompts', MIX_PROMPTS)} "
             f"requests, answers {chat[0]}-{chat[1]} tokens) and reasoning (key `user`, 40 %, answers "
             f"{reasoning[0]}-{reasoning[1]} tokens), the demo's prompts, {d.get('mix_load', MIX_LOAD):g}x capacity in "
             "all, open loop: the busier client has the short answers. Target: flow control refuses nothing and "
             "keeps the mean TTFT of the picker without it.", "",
             "| flow control | chat mean / P99 TTFT ms | reasoning mean / P99 TTFT ms | both: mean TTFT ms | "
             "failed chat | failed reasoning | target |", "|---|---|---|---|---|---|---|"]
    off = r["modes"].get("off", {}).get("mix")
    for mode, m in r["modes"].items():
        chat_row, reasoning_row = m["mix"]["chat"], m["mix"]["reasoning"]
        both = _mean_of(chat_row, reasoning_row)
        target = ""
        if mode != "off" and off is not None:
            refused = chat_row["failed"] + reasoning_row["failed"]
            target = f"{versus(both, _mean_of(off['chat'], off['reasoning']))} vs off; " + (
                "nothing refused" if not refused else f"NOT met: {refused} refused")
        lines.append(f"| {mode} | {chat_row['mean_ttft_ms']:,.0f} / {chat_row['p99_ttft_ms']:,.0f} | "
                     f"{reasoning_row['mean_ttft_ms']:,.0f} / {reasoning_row['p99_ttft_ms']:,.0f} | {both:,.0f} | "
                     f"{_failed(chat_row)} | {_failed(reasoning_row)} | {target} |")
    return lines


def _mean_of(*rows: dict) -> float:
    """The mean TTFT over the completed requests of several clients."""
    done = sum(r["completed"] for r in rows)
    return sum(r["mean_ttft_ms"] * r["completed"] for r in rows) / done if done else float("nan")


def _lab_lines(lab: dict) -> list[str]:
    """The lab on the same scale, per seed: the two targets' ratios and the refused requests."""
    lines = ["The lab on the same scale (the demo workload on 3 simulated groups with the demo's KV, "
             "`python -m bench flow`'s experiment: 150 heavy, 15 light, 112 requests per priority class), "
             "capacity measured there per seed:", "",
             "| seed | policy | capacity req/s (model) | light with heavy / alone, mean TTFT | failed heavy | "
             "interactive / standard P99 TTFT | failed standard |", "|---|---|---|---|---|---|---|"]
    for name, rows in lab["fairness"].items():
        for f, p in zip(rows, lab["priorities"][name]):
            seed = f["seed"]
            capacity = lab["capacity_rps"].get(str(seed), lab["capacity_rps"].get(seed))  # JSON keys are strings
            lines.append(f"| {seed} | {name} | {capacity:.2f} | "
                         f"{_ratio(f['mixed']['light']['mean_ttft_ms'], f['alone']['mean_ttft_ms'])}x | "
                         f"{f['mixed']['heavy']['failed']} | "
                         f"{_ratio(p['interactive']['p99_ttft_ms'], p['standard']['p99_ttft_ms'])} | "
                         f"{p['standard']['failed']} |")
    return lines + [""]
