"""The `outcomes-http` benchmark: what the picker's outcome path (Envoy's gRPC access log to the
picker's --outcomes-port, fed by base/gateway's token-accounting.lua) costs and loses on the real
data plane. Run it under the shared lock: `flock /work/heavy.lock python -m bench outcomes-http`.

One local stack (2 simulated groups at A10 timing / SPEEDUP, the picker, Envoy Gateway + Envoy,
the repo's gateway objects with the local edge). Closed loop: CLIENTS clients send completions
through llm-gw, half streamed with usage, half not. Rounds alternate three gateway configurations,
written into the files Envoy Gateway reads and pushed to Envoy over xDS (the round starts once
Envoy has them):
  off   no access log to the picker and no token-accounting Lua on the picker's route;
  lua   the token accounting only;
  on    both, as deployed.
Per round: the requests served, the CPU seconds of the Envoy process and of the picker (all its
processes), per request; on's outcomes received (picker_outcomes_total) and their lag
(picker_outcome_lag_seconds). Then the restart: RESTART_REQUESTS long streamed requests are sent,
the picker is stopped (SIGTERM) while they stream and started again after they have ended; the
outcomes of those requests that reach the new picker, and Envoy's own access log counters
(written, dropped), say what is lost.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import psutil
import yaml

from bench.common import load_average, save, stamp
from bench.markdown import md_table

SPEEDUP = 20.0
CLIENTS = 8
ROUND_SECONDS = 15.0
ROUNDS = 2  # of each configuration, interleaved
RESTART_REQUESTS = 12
CONFIGS = ("off", "lua", "on")


def _gateway_docs(stack) -> tuple[Path, list[dict]]:
    path = stack.layout.resources / "gateway.yaml"
    return path, [d for d in yaml.safe_load_all(path.read_text()) if d]


NO_LUA = "-no-lua"  # the picker's EnvoyExtensionPolicy's name suffix in the configuration 'off'


def configure(stack, original: list[dict], config: str) -> None:
    """Write `config` into the files Envoy Gateway reads; return once Envoy runs it."""
    from local import dataplane
    import copy
    docs = copy.deepcopy(original)
    policy = next(d for d in docs if d["kind"] == "EnvoyExtensionPolicy" and d["spec"].get("extProc"))
    name = policy["metadata"]["name"]
    for d in docs:
        if d["kind"] == "EnvoyProxy" and config != "on":
            settings = d["spec"]["telemetry"]["accessLog"]["settings"]
            settings[:] = [s for s in settings if not any(k["type"] == "ALS" for k in s["sinks"])]
    if config == "off":
        # Envoy Gateway's file provider stores an object it already has with a JSON merge patch
        # of the new one, in which a key left out keeps its old value: a policy without `lua`
        # would keep its Lua. A policy of another name replaces it whole (the old one is deleted);
        # the picker's cluster is named after the policy, so its patches follow the new name.
        policy["spec"].pop("lua", None)
        policy["metadata"]["name"] = name + NO_LUA
        for d in docs:
            for patch in d["spec"].get("jsonPatches", []) if d["kind"] == "EnvoyPatchPolicy" else []:
                patch["name"] = patch["name"].replace(f"/{name}/", f"/{name}{NO_LUA}/")
    path, _ = _gateway_docs(stack)
    dataplane.write_atomically(path, dataplane.dump(docs))
    want_als, want_lua = config == "on", config != "off"
    extproc = f"{name}{NO_LUA if config == 'off' else ''}/extproc/"
    deadline = time.monotonic() + 60
    while True:
        # the access logger and the ext_proc filter are the listeners' (a replaced listener drains
        # beside the new one for a while: only the active ones count); Envoy Gateway leaves the
        # Lua filter in the listener, disabled, and turns it on per route: the routes say whether
        # it runs
        listeners = active_listeners(stack)
        has_als = "picker-outcomes" in listeners
        has_extproc = extproc in listeners
        has_lua = f"{name}/lua/" in route_configs(stack)
        if has_als == want_als and has_lua == want_lua and has_extproc:
            return
        if time.monotonic() > deadline:
            errors = [line for line in Path(stack.proc("envoy-gateway").log).read_text().splitlines()
                      if '"error"' in line or "ERROR" in line]
            raise RuntimeError(f"Envoy never ran configuration {config!r} (als {has_als}, lua {has_lua}, "
                               f"ext_proc {extproc!r} {has_extproc}); Envoy Gateway's last errors: "
                               + "\n".join(errors[-5:]))
        time.sleep(0.3)


def active_listeners(stack) -> str:
    """Envoy's listeners in use now (JSON text), not those still draining after an update."""
    import json
    url = f"{stack.envoy_admin()}/config_dump?resource=dynamic_listeners"
    dump = json.load(urllib.request.urlopen(url, timeout=10))
    return json.dumps([c.get("active_state") for c in dump.get("configs", [])])


def route_configs(stack) -> str:
    url = f"{stack.envoy_admin()}/config_dump?resource=dynamic_route_configs"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def envoy_pid(stack) -> int:
    """The Envoy process Envoy Gateway runs (its child, through func-e)."""
    eg = psutil.Process(stack.proc("envoy-gateway").pid)
    for p in eg.children(recursive=True):
        cmd = p.cmdline()
        if p.name() == "envoy" or (cmd and cmd[0].endswith("/envoy")):
            return p.pid
    raise RuntimeError("no Envoy process under Envoy Gateway")


def cpu(pid: int, children: bool = False) -> float:
    p = psutil.Process(pid)
    total = sum(p.cpu_times()[:2])
    if children:
        total += sum(sum(c.cpu_times()[:2]) for c in p.children(recursive=True))
    return total


def metric(stack, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.config.picker_metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def closed_loop(stack, seconds: float, clients: int = CLIENTS) -> tuple[int, int]:
    """(requests answered 200, others) in `seconds`."""
    url = f"http://127.0.0.1:{stack.llm_port}/v1/completions"
    ok = bad = 0
    stop = time.monotonic() + seconds

    async def client(i: int, session) -> None:
        nonlocal ok, bad
        n = 0
        while time.monotonic() < stop:
            n += 1
            stream = n % 2 == 0
            body = {"model": "qwq", "prompt": f"client {i} request {n} " * 20, "max_tokens": 32,
                    "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
            async with session.post(url, json=body) as r:
                await r.read()
                ok += r.status == 200
                bad += r.status != 200

    async with aiohttp.ClientSession(headers=stack.auth_headers()) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    return ok, bad


async def measure_rounds(stack, original) -> dict:
    per = {c: {"requests": 0, "failed": 0, "envoy_cpu_s": 0.0, "picker_cpu_s": 0.0, "wall_s": 0.0}
           for c in CONFIGS}
    outcomes = {"received": 0.0, "requests_on": 0}
    for _ in range(ROUNDS):
        for config in CONFIGS:
            configure(stack, original, config)
            await asyncio.sleep(2)  # the last round's outcomes and xDS work settle
            envoy, picker = envoy_pid(stack), stack.proc("picker").pid
            got0 = metric(stack, "picker_outcomes_total")
            e0, p0, t0 = cpu(envoy), cpu(picker, children=True), time.monotonic()
            ok, bad = await closed_loop(stack, ROUND_SECONDS)
            e1, p1, t1 = cpu(envoy), cpu(picker, children=True), time.monotonic()
            r = per[config]
            r["requests"] += ok
            r["failed"] += bad
            r["envoy_cpu_s"] += e1 - e0
            r["picker_cpu_s"] += p1 - p0
            r["wall_s"] += t1 - t0
            if config == "on":
                await asyncio.sleep(2.5)  # Envoy's 1 s buffer flush, and the relay
                outcomes["received"] += metric(stack, "picker_outcomes_total") - got0
                outcomes["requests_on"] += ok + bad
    for r in per.values():
        n = max(1, r["requests"] + r["failed"])
        r["envoy_cpu_ms_per_request"] = 1000 * r["envoy_cpu_s"] / n
        r["picker_cpu_ms_per_request"] = 1000 * r["picker_cpu_s"] / n
    count = metric(stack, "picker_outcome_lag_seconds_count")
    lag = {"mean_s": metric(stack, "picker_outcome_lag_seconds_sum") / count if count else None,
           "outcomes": count}
    return {"per_config": per, "outcomes": outcomes, "lag": lag}


def envoy_access_log_stats(stack) -> dict[str, int]:
    import json
    data = json.load(urllib.request.urlopen(f"{stack.envoy_admin()}/stats?format=json", timeout=5))
    return {s["name"]: s["value"] for s in data["stats"] if "value" in s and "access_log" in s["name"]}


async def measure_restart(stack) -> dict:
    """Long streamed requests end while the picker is down: do their outcomes arrive later?"""
    url = f"http://127.0.0.1:{stack.llm_port}/v1/completions"
    before = metric(stack, "picker_outcomes_total")
    stats0 = envoy_access_log_stats(stack)
    # ~10 s of decoding at this speedup: they end while the picker is down
    body = {"model": "qwq", "prompt": "restart " * 50, "max_tokens": 1500, "stream": True,
            "stream_options": {"include_usage": True}}
    done = []

    async def one(session):
        async with session.post(url, json=body) as r:
            await r.read()
            done.append((r.status, time.monotonic()))

    async with aiohttp.ClientSession(headers=stack.auth_headers()) as session:
        tasks = [asyncio.ensure_future(one(session)) for _ in range(RESTART_REQUESTS)]
        await asyncio.sleep(1.0)  # all decided and streaming
        stopped_at = time.monotonic()
        await asyncio.to_thread(stack.stop_process, "picker")
        await asyncio.gather(*tasks)
    ended_down = sum(1 for _, t in done if t > stopped_at)
    await asyncio.sleep(3)  # Envoy tries to flush its buffer to the stopped picker
    await asyncio.to_thread(stack.restart_process, "picker")
    await asyncio.sleep(3)
    after_restart = metric(stack, "picker_outcomes_total")  # a new process: counts from zero
    # a request that ends now is reported to the new picker: the path works again
    async with aiohttp.ClientSession(headers=stack.auth_headers()) as session:
        async with session.post(url, json={**body, "max_tokens": 8}) as r:
            await r.read()
    await asyncio.sleep(2.5)
    stats1 = envoy_access_log_stats(stack)
    return {"requests": RESTART_REQUESTS, "statuses": sorted({s for s, _ in done}),
            "ended_while_down": ended_down, "outcomes_before_stop": before,
            "outcomes_at_new_picker_of_those": after_restart,
            "outcomes_at_new_picker_after_one_more": metric(stack, "picker_outcomes_total"),
            "envoy_stats_delta": {k: stats1.get(k, 0) - stats0.get(k, 0) for k in stats1}}


async def run_all(stack) -> dict:
    _, original = _gateway_docs(stack)
    rounds = await measure_rounds(stack, original)
    configure(stack, original, "on")
    restart = await measure_restart(stack)
    return {**rounds, "restart": restart}


def run() -> dict:
    from local.stack import Stack, StackConfig
    from local.stack.processes import free_ports
    load_start = load_average()
    ports = free_ports(8)
    with tempfile.TemporaryDirectory() as tmp:
        config = StackConfig(name="bench-outcomes", run_root=Path(tmp), groups=2, speedup=SPEEDUP, seed=5,
                             sim_ports=ports[6:8], http_port=ports[0], llm_port=ports[1],
                             picker_grpc_port=ports[2], picker_health_port=ports[3],
                             picker_metrics_port=ports[4], picker_outcomes_port=ports[5])
        started = time.perf_counter()
        with Stack(config) as stack:
            data = asyncio.run(run_all(stack))
        data.update(wall_s=time.perf_counter() - started, load_average_start=load_start, speedup=SPEEDUP,
                    clients=CLIENTS, round_seconds=ROUND_SECONDS, rounds=ROUNDS, **stamp())
    save("outcomes-http", data)
    return data


def report(d: dict) -> list[str]:
    per = d["per_config"]
    rows = [[c, f"{per[c]['requests']}", f"{per[c]['envoy_cpu_ms_per_request']:.3f}",
             f"{per[c]['picker_cpu_ms_per_request']:.3f}"] for c in CONFIGS]
    o, r = d["outcomes"], d["restart"]
    return [
        f"Closed loop of {d['clients']} clients through llm-gw (2 simulated groups at A10 timing / "
        f"{d['speedup']:g}), {d['rounds']} rounds of {d['round_seconds']:g} s per configuration, interleaved; "
        f"CPU of the Envoy process and of the picker (all its processes) per request.",
        "",
        *md_table(["configuration", "requests", "Envoy CPU ms/request", "picker CPU ms/request"], rows),
        "",
        f"Outcomes received with the access log on: {o['received']:.0f} of {o['requests_on']} requests; "
        f"mean lag from a response's end to its outcome in the picker "
        f"{d['lag']['mean_s'] * 1000:.0f} ms." if d["lag"]["mean_s"] is not None else "No lag measured.",
        "",
        f"Restart: {r['requests']} long streamed requests, the picker stopped while they streamed "
        f"({r['ended_while_down']} ended while it was down): the new picker received "
        f"{r['outcomes_at_new_picker_of_those']:.0f} of their outcomes; Envoy's access log counters over "
        f"the restart: {r['envoy_stats_delta']}.",
    ]
