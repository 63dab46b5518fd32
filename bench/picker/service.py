"""`make bench-picker` (run.py drives the parts): decision throughput and latency through gRPC,
and the CPU cost of scraping.

1. In-process: Router.decide() alone (what the routing lab pays per decision).
2. Through gRPC: the picker's real server, each ext_proc server in turn (compiled, Python; plaintext, default profile, Prometheus metrics on,
   each endpoint's parsed metrics fed every 100 ms in 10 ms batches, as the signals process
   delivers them) in a
   child process, driven by a compiled load client (bench/picker/loadclient) playing Envoy: per
   request one ext_proc stream with request_headers + request_body (~4,000-token prompt,
   1,000-token prefix shared per tenant), then (with --response-phase) response_headers, then
   close: by default only the request phase, as the deployed EnvoyExtensionPolicy sends.
   Latency = stream opened -> routing answer, as the client sees it (queueing in gRPC included);
   `decide` = the server's own decide() time. Closed loop: `--streams` streams back to back
   (maximum throughput). Open loop: each of `--rates` new streams/s, each open `--hold` s (about
   rate x hold streams open at once). Both `--repeat` times, interleaved: the closed loop is
   reported by its median-throughput run, each rate by its median-p99 run, and the highest rate
   at which it and every lower rate had round-trip p99 <= 5 ms. The server's CPU per decision is read from /proc/<pid>/stat (all
   its threads). A null server (answers without deciding) on each: the Python one shows the cost of
   Python gRPC itself, the compiled one everything around decide().
3. Scraping: 64 fake vLLM /metrics pages (realistic size, histograms included) served by a child
   process; a second child runs the real Scraper at the default interval; its CPU time is reported.

Why one file of this size: the three measurements share the child processes (server, fake
vLLM fleet, scraper), their start/stop and the CPU accounting; each part is read top to bottom.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import subprocess
import time
from contextlib import contextmanager

# The load generator is compiled (bench/picker/loadclient, built by `make tools`): a
# Python client costs as much CPU per request as the server and would share its 2 cores.
LOAD_CLIENT = os.environ.get("PICKER_LOADCLIENT", os.path.join(
    os.path.dirname(__file__), "..", "..", ".tools", "bin", "picker-loadclient"))
SYSTEM_PROMPTS = [f"tenant {t} system prompt: " + "policy clause %d. " % t * 180 for t in range(8)]


def vllm_page(waiting: int, running: int, kv: float, model: str = "qwq") -> str:
    """A vLLM-like /metrics page: load gauges plus the histograms a real server exposes."""
    lab = f'engine="0",model_name="{model}"'
    lines = ["# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {waiting}",
             "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {running}",
             "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{lab}}} {kv}",
             "# TYPE vllm:cache_config_info gauge",
             f'vllm:cache_config_info{{block_size="16",engine="0",model_name="{model}",'
             f'num_gpu_blocks="4500",enable_prefix_caching="True"}} 1.0']
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_queue_time_seconds", "request_prefill_time_seconds"):
        lines.append(f"# TYPE vllm:{name} histogram")
        for le in (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 640, 2560, "+Inf"):
            lines.append(f'vllm:{name}_bucket{{{lab},le="{le}"}} {random.randint(0, 1000)}.0')
        lines.append(f"vllm:{name}_sum{{{lab}}} 1234.5")
        lines.append(f"vllm:{name}_count{{{lab}}} 1000.0")
    for name in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        lines.append(f"# TYPE vllm:{name.removesuffix('_total')} counter")
        lines.append(f"vllm:{name}{{{lab}}} {random.randint(0, 10**6)}.0")
    return "\n".join(lines) + "\n"


def _router(n: int, profile: str = "default", metrics=None, prefilter: bool = True,
            settings=None):
    """A Router on n endpoints; prefilter=False scores every candidate (no candidate prefilter)."""
    import dataclasses

    from picker.core import Router
    from picker.scheduling.profile import load_profile
    prof = load_profile(profile)
    if not prefilter:
        prof.prefilter = dataclasses.replace(prof.prefilter, above=1 << 30)
    router = Router(prof, rng=random.Random(1), metrics=metrics, settings=settings)
    addrs = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(n)]
    router.set_endpoints(addrs)
    return router, addrs


_PAGES: list[str] = []


def _page(rng: random.Random) -> str:
    """One of 50 pre-rendered pages with varied load (rendered on first use)."""
    if not _PAGES:
        _PAGES.extend(vllm_page(rng.randint(0, 6), rng.randint(5, 30), rng.random() * 0.9)
                      for _ in range(50))
    return rng.choice(_PAGES)


def _refresh(router, addrs, rng: random.Random) -> None:
    """Feed every endpoint a page, as a scrape would; parsing cost included."""
    for a in addrs:
        router.on_scrape_ok(a, _page(rng))


def _request_body(rng: random.Random) -> bytes:
    prompt = rng.choice(SYSTEM_PROMPTS) + " ".join(str(rng.random()) for _ in range(700))
    return json.dumps({"model": "qwq", "prompt": prompt, "max_tokens": 1500, "stream": True}).encode()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_inprocess(n: int, count: int = 3000, prefilter: bool = True) -> dict:
    """decide() alone. Wall time (perf_counter) and the thread's CPU time (thread_time) per
    decision: on a shared machine the wall-time tail is mostly preemption by other processes;
    the CPU-time tail is the decision's own cost."""
    from picker.core import RequestInfo
    router, addrs = _router(n, prefilter=prefilter)
    rng = random.Random(2)
    _refresh(router, addrs, rng)
    bodies = [_request_body(rng) for _ in range(200)]
    lat, cpu = [], []
    for i in range(count):
        if i % 100 == 0:
            _refresh(router, addrs, rng)
        t0, c0 = time.perf_counter(), time.thread_time()
        d = router.decide(RequestInfo("/v1/completions", {}, bodies[i % len(bodies)]))
        cpu.append(time.thread_time() - c0)
        lat.append(time.perf_counter() - t0)
        if i >= 30:
            router.on_request_done(f"picker-{i - 29}")
        del d
    return {"endpoints": n, "prefilter": prefilter, "decisions_per_s": count / sum(lat),
            "p50_ms": 1000 * _pct(lat, 0.5), "p99_ms": 1000 * _pct(lat, 0.99),
            "cpu_p50_ms": 1000 * _pct(cpu, 0.5), "cpu_p99_ms": 1000 * _pct(cpu, 0.99),
            "cpu_ms_per_decision": 1000 * sum(cpu) / count}


# decide() with output lengths (picker.lengths): off; the predictor learning with outcomes flowing
# (every decision forecast, the default profile); and the `lengths` profile routing on them
# (a projection of each candidate's KV over its tracked requests' predicted ends).
LENGTHS_MODES = ("off", "learning", "routing")
TRACKED_PER_ENDPOINT = 20        # requests in flight per endpoint the projection walks


def bench_inprocess_lengths(n: int, mode: str, count: int = 3000) -> dict:
    """decide() CPU per decision with output lengths `mode` (LENGTHS_MODES), n endpoints."""
    from picker.core import RequestInfo, RouterSettings
    from picker.lengths.features import Features
    from picker.lengths.predictor import PredictorSettings
    from picker.signals.outcomes import Outcome
    router, addrs = _router(n, profile="lengths" if mode == "routing" else "default",
                            settings=RouterSettings(lengths=None if mode == "off"
                                                    else PredictorSettings()))
    rng = random.Random(2)
    _refresh(router, addrs, rng)
    bodies = [_request_body(rng) for _ in range(200)]
    clients = [f"app-{k}" for k in range(8)]

    def decide(i: int):
        return router.decide(RequestInfo("/v1/completions", {"x-client-id": clients[i % 8]},
                                         bodies[i % len(bodies)]))

    def outcome(d, tokens: int) -> Outcome:
        return Outcome(d.request_id, d.endpoint, 200, 4000, tokens, 1.0, 1.0 + 0.1 * tokens, "",
                       d.target_model, d.features, 0.0)

    if mode != "off":       # a history of answers, then every endpoint's requests in flight
        for i in range(400):
            router.on_outcome(outcome(decide(i), rng.randint(50, 4000)))
        forecast = router.predictor.forecast(Features.from_key(decide(0).features))
        for a in addrs:
            for k in range(TRACKED_PER_ENDPOINT):
                router.work.add(f"bench-{a}-{k}", a, -rng.random() * 60, 3000, 4000, forecast)
        _refresh(router, addrs, rng)
    lat, cpu = [], []
    for i in range(count):
        if i % 100 == 0:
            _refresh(router, addrs, rng)
        t0, c0 = time.perf_counter(), time.thread_time()
        d = decide(i)
        cpu.append(time.thread_time() - c0)
        lat.append(time.perf_counter() - t0)
        router.on_request_done(d.request_id)
        if mode != "off":   # its outcome (learning is part of the cost: every worker learns)
            c1 = time.thread_time()
            router.on_outcome(outcome(d, rng.randint(50, 4000)))
            cpu[-1] += time.thread_time() - c1
    return {"endpoints": n, "mode": mode, "decisions_per_s": count / sum(lat),
            "cpu_p50_ms": 1000 * _pct(cpu, 0.5), "cpu_p99_ms": 1000 * _pct(cpu, 0.99),
            "cpu_ms_per_decision": 1000 * sum(cpu) / count}


def _serve(n: int, port_queue, ctl, timings, server: str = "native") -> None:
    """Child: the real gRPC server (with its Prometheus metrics) and a router fed parsed scrapes
    of every endpoint once per the pool's scrape interval, in batches every 10 ms, as the
    signals process delivers them (the parsing itself happens in that other process). On each
    message on `ctl` it puts the decide() times (what picker_decision_duration_seconds
    observes) recorded since the last one on `timings`."""
    import queue

    from picker import defaults
    from picker.runtime import run_loop
    from picker.observability.metrics import PickerMetrics
    from picker.protocol.server import start_servers
    from picker.signals.metrics import parse_vllm_metrics

    seconds: list[float] = []

    class TimedMetrics(PickerMetrics):
        def record_decision(self, d, s: float) -> None:
            super().record_decision(d, s)
            seconds.append(s)

    async def main():
        router, addrs = _router(n, metrics=TimedMetrics())
        rng = random.Random(3)
        _refresh(router, addrs, rng)
        parsed = [parse_vllm_metrics(_page(rng)) for _ in range(50)]
        servers = await start_servers(router, 0, 0, secure=False, host="127.0.0.1", server=server)
        port_queue.put(servers.grpc_port)
        flush = 0.01
        per_batch = max(1, round(n * flush / defaults.scrape_interval_for(n)))
        for i in itertools.count():
            await asyncio.sleep(flush)
            for j in range(i * per_batch, (i + 1) * per_batch):
                router.on_metrics(addrs[j % n], rng.choice(parsed))
            try:
                ctl.get_nowait()
            except queue.Empty:
                continue
            timings.put({"count": len(seconds), "p50_ms": 1000 * _pct(seconds, 0.5) if seconds else None,
                         "p99_ms": 1000 * _pct(seconds, 0.99) if seconds else None})
            seconds.clear()
    run_loop(main())


class NullRouter:
    """Decides nothing: every request goes to one endpoint (the native null server's Router)."""
    metrics = None

    def __init__(self, dest: str):
        from picker.core import RouterSettings
        self.settings = RouterSettings()
        self.dest = dest

    def decide(self, info):
        from picker.core import Decision
        return Decision(self.dest, "null", "", "", info.body or b"", None, 0)

    def on_request_done(self, request_id, usage=None) -> None:
        pass


def _serve_null(port_queue, server: str = "python") -> None:
    """Child: an ext_proc server that answers without deciding. `python`: a bare grpc.aio
    servicer answering prebuilt messages (the cost of Python gRPC itself); `native`: the
    compiled transport with the picker's own Python side (Request, answers) over a Router that
    decides nothing (the cost of everything around decide())."""
    from picker.runtime import run_loop
    dest = "10.0.0.1:8000"

    if server == "native":
        async def main():
            from picker.protocol.limits import ServerLimits
            from picker.protocol.native import NativeExtProc
            native = NativeExtProc(NullRouter(dest), ServerLimits(), host="127.0.0.1")
            native.start()
            port_queue.put(native.port)
            await asyncio.Event().wait()
        run_loop(main())
        return

    import grpc
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from picker.protocol import answers
    from picker.protocol import messages as msg

    def answer(body: bytes | None) -> answers.RouteAnswer:
        return answers.RouteAnswer([(answers.DESTINATION_HEADER, dest)], answers.ROUTED_REMOVES,
                                   {answers.LB_NAMESPACE: {answers.DESTINATION_HEADER: dest}}, body)

    class Null(ep_grpc.ExternalProcessorServicer):
        async def Process(self, it, ctx):
            full_duplex = False
            async for req in it:
                if req.HasField("protocol_config"):
                    full_duplex = req.protocol_config.request_body_mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED
                kind = req.WhichOneof("request")
                if kind == "request_headers" and not full_duplex:
                    yield msg.strip_headers_response()
                elif kind == "request_body":
                    for r in msg.route_responses(answer(req.request_body.body if full_duplex else None),
                                                 False, full_duplex):
                        yield r
                elif kind == "response_headers":
                    yield msg.response_headers_response()

    async def main():
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Null(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()
    run_loop(main())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a whole process (all its threads, e.g. gRPC's poller)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load_client(port: int, bodies: str, mode: str, seconds: float, streams: int = 64,
                 rate: float = 0.0, hold: float = 0.0, response_phase: bool = False,
                 conns: int = 1, chunk: int = 0) -> dict:
    cmd = [LOAD_CLIENT, "-addr", f"127.0.0.1:{port}", "-bodies", bodies, "-mode", mode,
           "-seconds", str(seconds), "-streams", str(streams), "-warmup", "0", "-conns", str(conns),
           "-rate", str(rate), "-hold", f"{hold}s", f"-response-phase={str(response_phase).lower()}",
           "-chunk", str(chunk)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 120)
    return json.loads(out.stdout)


def bench_grpc(n: int | None, mode: str, streams: int, seconds: float, rates: list[float],
               hold: float, bodies: str, response_phase: bool = False, repeat: int = 3,
               server: str = "native") -> dict:
    """n endpoints (None: the null server) on the `server` ext_proc server (native | python).
    Closed loop (`streams` streams back to back: the maximum throughput), then open loop at
    each rate (new streams/s, each open `hold` s), both `repeat` times, interleaved; the closed
    loop is its median-throughput run, each rate its median-p99 run."""
    ctx = mp.get_context("spawn")
    q, ctl, timings = ctx.Queue(), ctx.Queue(), ctx.Queue()
    target, args = (_serve_null, (q, server)) if n is None else (_serve, (n, q, ctl, timings, server))
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()

    def measure(**kw) -> dict:
        if n is not None:
            _decide_times(ctl, timings)  # reset
        cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
        r = _load_client(port, bodies, mode, seconds, response_phase=response_phase, **kw)
        cpu, wall = _cpu_seconds(proc.pid) - cpu0, time.perf_counter() - t0
        r["server_cpu_ms_per_request"] = 1000 * cpu / max(1, r["requests"])
        r["server_cpu_cores"] = cpu / wall
        if n is not None:
            r["decide"] = _decide_times(ctl, timings)
        return r

    try:
        port = q.get(timeout=60)
        _load_client(port, bodies, mode, 1.0, streams)  # warm-up: connections, caches, prefix index
        out = {"endpoints": n, "mode": mode, "response_phase": response_phase, "server": server}
        closed: list[dict] = []
        by_rate: dict[float, list[dict]] = {rate: [] for rate in rates}
        for _ in range(repeat):  # interleaved: a slow spell of the machine hits every run alike
            closed.append(measure(streams=streams))
            for rate in rates:
                by_rate[rate].append(measure(rate=rate, hold=hold))
        out["closed_loop"] = _median_run(closed, "decisions_per_s")
        out["open_loops"] = [{"offered_per_s": rate, **_median_run(runs, "p99_ms")}
                             for rate, runs in by_rate.items()]
        out["max_rate_p99_within_target"] = latency_bounded_rate(out["open_loops"])
    finally:
        proc.terminate()
        proc.join()
    return out


def _median_run(runs: list[dict], key: str) -> dict:
    """The run with the median `key` (the upper one of an even count), with every run's summary:
    on this VM one 5 s run swings up to 2x in throughput and several-fold in p99."""
    chosen = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    keys = ("decisions_per_s", "p50_ms", "p99_ms", "errors")
    return {**chosen, "repeats": [{k: r[k] for k in keys} for r in runs]}


P99_TARGET_MS = 5.0


def latency_bounded_rate(open_loops: list[dict]) -> float | None:
    """The highest offered rate at which it and every lower rate met the latency target."""
    best = None
    for run in sorted(open_loops, key=lambda o: o["offered_per_s"]):
        if not _meets_latency_target(run):
            break
        best = run["offered_per_s"]
    return best


def _meets_latency_target(run: dict) -> bool:
    """The offered rate was served (within 2 %, no errors in any repeat) with round-trip p99 <=
    the target."""
    return (not any(r["errors"] for r in run.get("repeats", [run]))
            and run["decisions_per_s"] >= 0.98 * run["offered_per_s"] and run["p99_ms"] <= P99_TARGET_MS)


def _decide_times(ctl, timings) -> dict:
    ctl.put("report")
    return timings.get(timeout=30)


def _fake_vllm_fleet(n: int, port_queue) -> None:
    from aiohttp import web

    async def main():
        ports = []
        runners = []
        for _ in range(n):
            page = vllm_page(2, 10, 0.4)
            app = web.Application()
            app.router.add_get("/metrics", lambda r, page=page: web.Response(text=page))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            ports.append(site._server.sockets[0].getsockname()[1])
        port_queue.put(ports)
        await asyncio.Event().wait()
    asyncio.run(main())


@contextmanager
def fake_vllm_fleet(ctx, n: int, timeout: float = 120.0):
    """`n` fake vLLM /metrics servers in a process of their own (multiprocessing context `ctx`):
    `with fake_vllm_fleet(ctx, n) as ports:`; the process is stopped on leaving."""
    q = ctx.Queue()
    fleet = ctx.Process(target=_fake_vllm_fleet, args=(n, q), daemon=True)
    fleet.start()
    try:
        yield q.get(timeout=timeout)
    finally:
        fleet.terminate()
        fleet.join()


def _scrape_child(ports: list[int], interval: float, seconds: float, out_queue) -> None:
    from picker.scraper import Scraper

    async def main():
        router, _ = _router(0)
        router.set_endpoints([f"127.0.0.1:{p}" for p in ports])
        scraper = Scraper(router, interval)
        await scraper.start()
        await asyncio.sleep(1.0)  # connections up
        c0, s0, t0 = time.process_time(), scraper.scrapes, time.perf_counter()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        ready = sum(e.ready for e in router.endpoints.values())
        out_queue.put({"endpoints": len(ports), "interval_s": interval,
                       "scrapes_per_s": (scraper.scrapes - s0) / wall,
                       "cpu_cores": cpu / wall, "cpu_ms_per_scrape": 1000 * cpu / max(1, scraper.scrapes - s0),
                       "ready_endpoints": ready, "page_bytes": len(vllm_page(2, 10, 0.4))})
        await scraper.close()
    asyncio.run(main())


def bench_scrape(n: int, interval: float, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with fake_vllm_fleet(ctx, n) as ports:
        child = ctx.Process(target=_scrape_child, args=(ports, interval, seconds, q))
        child.start()
        out = q.get(timeout=seconds + 60)
        child.join()
    return out


def _write_bodies(path: str, count: int = 200) -> None:
    rng = random.Random(4)
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(_request_body(rng) + b"\n")


def grpc_line(r: dict) -> str:
    c = r["closed_loop"]
    label = ("null server" if r["endpoints"] is None else f"{r['endpoints']:3d} endpoints") + \
        f" {r.get('server', 'python'):>6}"
    lines = [f"{label:>20}: closed {c['decisions_per_s']:5.0f}/s {_runs(c, 'decisions_per_s', 0)} "
             f"p50 {c['p50_ms']:7.1f} p99 "
             f"{c['p99_ms']:7.1f} ms, server {c['server_cpu_ms_per_request']:.2f} ms CPU/decision "
             f"({c['server_cpu_cores']:.2f} cores){_decide(c)}{_errors(c)}"]
    for o in r["open_loops"]:
        lines.append(f"{'':>20}  open {o['offered_per_s']:5.0f}/s offered: {o['decisions_per_s']:5.0f}/s "
                     f"p50 {o['p50_ms']:7.1f} p99 {o['p99_ms']:7.1f} ms {_runs(o)}, server "
                     f"{o['server_cpu_ms_per_request']:.2f} ms CPU/decision{_decide(o)}{_errors(o)}")
    best = r["max_rate_p99_within_target"]
    lines.append(f"{'':>20}  p99 <= {P99_TARGET_MS:g} ms at every rate up to: "
                 + (f"{best:.0f}/s offered" if best else "none of the offered rates"))
    return "\n  ".join(lines)


def _runs(r: dict, key: str = "p99_ms", digits: int = 1) -> str:
    return "[" + " ".join(f"{x[key]:.{digits}f}" for x in r.get("repeats", [])) + "]"


def _decide(r: dict) -> str:
    d = r.get("decide")
    if not d or not d["count"]:
        return ""
    return f", decide p50 {d['p50_ms']:.2f} p99 {d['p99_ms']:.2f} ms"


def _errors(r: dict) -> str:
    return f", {r['errors']} errors ({r.get('first_error')})" if r["errors"] else ""
