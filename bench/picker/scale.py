"""`make bench-picker-scale`: the picker against pool size, scraping load and worker processes.

    python -m bench.picker.scale [--sizes 16,64,256,1024] [--grpc-sizes 16,256,1024]
                                 [--workers 1,2] [--seconds 5] [--repeat 3] [--json FILE]

1. In process: Router.decide() at each pool size, with the candidate prefilter (the default)
   and without it (every candidate scored); and at --lengths-sizes with output lengths off, the
   predictor learning (outcomes flowing, a forecast per decision, the learning counted) and the
   `lengths` profile routing on them (20 requests tracked per endpoint). Wall time and the thread's CPU time per decision:
   on a shared machine the wall-time tail is mostly preemption by other processes.
2. Through gRPC at each of --grpc-sizes: the real ext_proc server (one worker), its router fed
   parsed scrapes at the pool's adapted interval as the signals process would, driven by the
   Go load client: closed-loop decisions/s, and the round-trip p99 at --grpc-rate offered.
3. Scrape load: decisions on a 1,024-endpoint pool of fake vLLM /metrics pages (one child
   process serves them all), offered at --scrape-rate per second in open loop, while the pool
   is scraped (a) not at all (metrics fed once), (b) by the scraper on the deciding process's
   own event loop, (c) by the signals process. Latency = when the decision was due -> decided
   (event-loop delay included). Also the scraping process's CPU.
4. Workers: `python -m picker --workers N` (the real command line, static discovery on
   16 fake endpoints), closed loop from the Go load client over 4 connections: decisions/s and
   CPU per decision of the whole process tree, for each N, repeated and interleaved.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace

from bench.picker import service



# ---- 1. in process --------------------------------------------------------------------------
def inprocess(sizes: list[int], count: int = 3000) -> list[dict]:
    out = []
    for n in sizes:
        for prefilter in (True, False):
            out.append(service.bench_inprocess(n, count if prefilter or n <= 256 else count // 3,
                                               prefilter=prefilter))
    return out


def lengths(sizes: list[int], count: int = 3000) -> list[dict]:
    """decide() with output lengths off, learning, and routing on them (service.LENGTHS_MODES)."""
    return [service.bench_inprocess_lengths(n, mode, count)
            for n in sizes for mode in service.LENGTHS_MODES]


# ---- 2. gRPC at pool sizes --------------------------------------------------------------------
def grpc_sizes(sizes: list[int], seconds: float, rate: float, repeat: int, bodies: str) -> list[dict]:
    return [service.bench_grpc(n, "buffered", 64, seconds, [rate], 0.064, bodies, repeat=repeat)
            for n in sizes]


# ---- 3. scrape load ---------------------------------------------------------------------------
def _cpu_of(pid: int) -> float:
    return service._cpu_seconds(pid)


def _decide_under_scrape(ports: list[int], mode: str, rate: float, seconds: float, out) -> None:
    """Child: a Router on the fleet, scraped per `mode`, deciding `rate` times a second."""
    import random

    from picker import defaults
    from picker.runtime import run_loop
    from picker.core import PickerError, RequestInfo, RouterSettings

    import logging
    logging.getLogger("picker").setLevel(logging.ERROR)  # a scrape timing out is counted, not logged
    addrs = [f"127.0.0.1:{p}" for p in ports]
    interval = defaults.scrape_interval_for(len(addrs))

    async def main():
        router, _ = service._router(0)
        if mode == "none":
            router.settings = RouterSettings(staleness=1e9)
        router.set_endpoints(addrs)
        scraper = link = proc = None
        if mode == "none":
            page = service.vllm_page(2, 10, 0.4)
            for a in addrs:
                router.on_scrape_ok(a, page)
        elif mode == "in-loop":
            from picker.scraper import Scraper
            scraper = Scraper(router, interval)
            await scraper.start()
        else:
            from picker.workers import SignalsLink, start_signals_process
            proc, conns = start_signals_process(Namespace(
                scrape_interval=defaults.SCRAPE_INTERVAL, staleness=defaults.STALENESS,
                log_level="warning"), 1)
            link = SignalsLink(router, conns[0], peers=False)
            link.start()
            link.send_objects(addrs, [], [])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while sum(e.ready for e in router.endpoints.values()) < len(addrs) and loop.time() < deadline:
            await asyncio.sleep(0.1)
        ready = sum(e.ready for e in router.endpoints.values())
        await asyncio.sleep(2 * interval)  # steady state
        rng = random.Random(5)
        bodies = [service._request_body(rng) for _ in range(100)]
        lat, cpu, refused = [], [], 0
        cpu0 = time.process_time()
        sig0 = _cpu_of(proc.pid) if proc else 0.0
        scrapes0 = link.scrape_batches if link else (scraper.scrapes if scraper else 0)
        t0 = time.perf_counter()
        total = int(rate * seconds)
        give_up = t0 + 3 * seconds + 10  # a loop saturated by scraping may never catch up
        for i in range(total):
            if time.perf_counter() > give_up:
                break
            due = t0 + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            c0 = time.thread_time()
            try:
                d = router.decide(RequestInfo("/v1/completions", {}, bodies[i % len(bodies)]))
            except PickerError:  # every endpoint out: scrapes timing out on a saturated loop
                refused += 1
                continue
            finally:
                lat.append(time.perf_counter() - due)
                cpu.append(time.thread_time() - c0)
            router.on_request_done(d.request_id)
        wall = time.perf_counter() - t0
        r = {"mode": mode, "endpoints": len(addrs), "ready_endpoints": ready,
             "scrape_interval_s": interval, "offered_per_s": rate, "decisions": total,
             "completed": len(lat),
             "refused_503": refused,
             "p50_ms": 1000 * service._pct(lat, 0.5), "p99_ms": 1000 * service._pct(lat, 0.99),
             "decide_cpu_p99_ms": 1000 * service._pct(cpu, 0.99),
             "decider_cpu_cores": (time.process_time() - cpu0) / wall}
        if scraper is not None:
            r["scrapes_per_s"] = (scraper.scrapes - scrapes0) / wall
        if proc is not None:
            r["signals_process_cpu_cores"] = (_cpu_of(proc.pid) - sig0) / wall
        if scraper is not None:
            await scraper.close()
        if link is not None:
            await link.close()
            proc.join(5)
        out.put(r)
    run_loop(main())


def scrape_load(n: int, rate: float, seconds: float, repeat: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    runs: dict[str, list[dict]] = {m: [] for m in ("none", "in-loop", "signals-process")}
    with service.fake_vllm_fleet(ctx, n) as ports:
        for _ in range(repeat):
            for mode in runs:
                child = ctx.Process(target=_decide_under_scrape, args=(ports, mode, rate, seconds, q))
                child.start()
                runs[mode].append(q.get(timeout=seconds + 180))
                child.join(10)
    return [_median(rs, "p99_ms") for rs in runs.values()]


def _median(runs: list[dict], key: str) -> dict:
    chosen = sorted(runs, key=lambda r: r[key])[len(runs) // 2]
    return {**chosen, "repeats": [r[key] for r in runs]}


# ---- 4. workers -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its live descendants."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += _cpu_of(p)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return total


def _start_picker(endpoints: list[str], workers: int, server: str = "native") -> tuple[subprocess.Popen, int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "picker", "--discovery", "static", "--endpoints", ",".join(endpoints),
           "--no-secure-serving", "--grpc-port", str(port), "--health-port", str(_free_port()),
           "--metrics-port", str(_free_port()), "--outcomes-port", "0", "--bind", "127.0.0.1", "--workers", str(workers),
           "--log-level", "warning", "--ext-proc-server", server]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, port


def _wait_serving(port: int, bodies: str, workers: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            r = service._load_client(port, bodies, "buffered", 0.5, streams=4, conns=4)
            if r["errors"] == 0 and r["requests"] > 0:
                return
        except subprocess.CalledProcessError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"picker with {workers} workers never served on port {port}")


def workers_bench(n: int, counts: list[int] | list[tuple[str, int]], seconds: float, repeat: int,
                  bodies: str, conns: int = 4, streams: int = 64) -> list[dict]:
    """`python -m picker` per configuration: a worker count (the compiled ext_proc server) or
    (ext_proc server, worker count); all started first, then run in turn, interleaved."""
    configs = [c if isinstance(c, tuple) else ("native", c) for c in counts]
    pickers: dict[tuple[str, int], tuple[subprocess.Popen, int]] = {}
    runs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    with service.fake_vllm_fleet(mp.get_context("spawn"), n) as ports:
        endpoints = [f"127.0.0.1:{p}" for p in ports]
        try:
            for server, w in configs:
                pickers[(server, w)] = _start_picker(endpoints, w, server)
            for (server, w), (proc, port) in pickers.items():
                _wait_serving(port, bodies, w)
            time.sleep(1.0)
            for _ in range(repeat):  # interleaved: a slow spell of the machine hits every count alike
                for (server, w), (proc, port) in pickers.items():
                    cpu0, t0 = _tree_cpu(proc.pid), time.perf_counter()
                    try:
                        r = service._load_client(port, bodies, "buffered", seconds, streams=streams,
                                                 conns=conns)
                    except subprocess.TimeoutExpired:  # counted as a failed run, not fatal
                        r = {"requests": 0, "errors": 1, "decisions_per_s": 0.0, "p50_ms": None,
                             "p99_ms": None, "first_error": "load client timed out"}
                    cpu, wall = _tree_cpu(proc.pid) - cpu0, time.perf_counter() - t0
                    r.update(workers=w, server=server, endpoints=n, server_cpu_cores=cpu / wall,
                             server_cpu_ms_per_request=1000 * cpu / max(1, r["requests"]))
                    runs[(server, w)].append(r)
        finally:
            for proc, _ in pickers.values():
                proc.terminate()
            for proc, _ in pickers.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    out = []
    for rs in runs.values():
        m = _median(rs, "decisions_per_s")
        m["repeats"] = [{"decisions_per_s": r["decisions_per_s"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                         "server_cpu_cores": r["server_cpu_cores"]} for r in rs]
        out.append(m)
    base = statistics.median(r["decisions_per_s"] for r in runs[configs[0]])
    for o in out:
        o["speedup_vs_first"] = statistics.median(
            r["decisions_per_s"] for r in runs[(o["server"], o["workers"])]) / base
    return out


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.picker.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16,64,256,1024")
    p.add_argument("--grpc-sizes", default="16,256,1024")
    p.add_argument("--grpc-rate", type=float, default=500.0)
    p.add_argument("--scrape-endpoints", type=int, default=1024)
    p.add_argument("--scrape-rate", type=float, default=200.0)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--lengths-sizes", default="16,1024")
    p.add_argument("--parts", default="inprocess,lengths,grpc,scrape,workers")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    if not os.access(service.LOAD_CLIENT, os.X_OK):
        raise SystemExit(f"{service.LOAD_CLIENT} not found: build it with `make tools`")
    parts = a.parts.split(",")
    res: dict = {"machine": {"cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    if "inprocess" in parts:
        print("\nRouter.decide() in process (default profile, ~4,000-token prompts):")
        res["inprocess"] = inprocess([int(x) for x in a.sizes.split(",")])
        _save(res, a.json)
        for r in res["inprocess"]:
            print(f"  {r['endpoints']:5d} endpoints, prefilter {'on ' if r['prefilter'] else 'off'}: "
                  f"{r['decisions_per_s']:6.0f}/s  wall p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} ms  "
                  f"CPU p50 {r['cpu_p50_ms']:.3f} p99 {r['cpu_p99_ms']:.3f} ms", flush=True)
    if "lengths" in parts:
        print("\nRouter.decide() with output lengths off / learning / routing on them:")
        res["lengths"] = lengths([int(x) for x in a.lengths_sizes.split(",")])
        _save(res, a.json)
        for r in res["lengths"]:
            print(f"  {r['endpoints']:5d} endpoints, {r['mode']:8s}: CPU p50 {r['cpu_p50_ms']:.3f} "
                  f"p99 {r['cpu_p99_ms']:.3f} ms, {r['cpu_ms_per_decision']:.3f} ms/decision", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        bodies = os.path.join(tmp, "bodies.jsonl")
        service._write_bodies(bodies)
        if "grpc" in parts:
            print(f"\nthrough gRPC (one worker, buffered), closed loop 64 streams and open loop "
                  f"{a.grpc_rate:g}/s, {a.repeat} runs each:")
            res["grpc"] = grpc_sizes([int(x) for x in a.grpc_sizes.split(",")], a.seconds,
                                     a.grpc_rate, a.repeat, bodies)
            _save(res, a.json)
            for r in res["grpc"]:
                print("  " + service.grpc_line(r), flush=True)
        if "scrape" in parts:
            print(f"\ndecisions at {a.scrape_rate:g}/s on {a.scrape_endpoints} scraped endpoints "
                  "(latency = due -> decided):")
            res["scrape_load"] = scrape_load(a.scrape_endpoints, a.scrape_rate, a.seconds, a.repeat)
            _save(res, a.json)
            for r in res["scrape_load"]:
                extra = (f", scraping on the loop: {r.get('scrapes_per_s', 0):.0f} scrapes/s"
                         if r["mode"] == "in-loop" else
                         f", signals process {r['signals_process_cpu_cores']:.2f} cores"
                         if r["mode"] == "signals-process" else "")
                print(f"  scraping {r['mode']:15s}: p50 {r['p50_ms']:.2f} p99 {r['p99_ms']:.2f} ms "
                      f"(decide() CPU p99 {r['decide_cpu_p99_ms']:.3f} ms) "
                      f"{[round(x, 2) for x in r['repeats']]}, deciding process "
                      f"{r['decider_cpu_cores']:.2f} cores{extra}, {r['ready_endpoints']} ready, "
                      f"{r['refused_503']} refused (no ready endpoint), "
                      f"{r['completed']} of {r['decisions']} due within the run, "
                      f"interval {r['scrape_interval_s']:g} s", flush=True)
        if "workers" in parts:
            counts = [int(x) for x in a.workers.split(",")]
            print(f"\npython -m picker --workers N, 16 endpoints, closed loop 64 streams over 4 "
                  f"connections, {a.repeat} runs each, interleaved:")
            res["workers"] = workers_bench(16, counts, a.seconds, a.repeat, bodies)
            for r in res["workers"]:
                print(f"  {r['workers']} worker(s): {r['decisions_per_s']:6.0f} decisions/s "
                      f"{[round(x['decisions_per_s']) for x in r['repeats']]} (x{r['speedup_vs_first']:.2f}), "
                      f"p99 {r['p99_ms'] or 0:.1f} ms, {r['server_cpu_cores']:.2f} cores, "
                      f"{r['server_cpu_ms_per_request']:.2f} ms CPU/decision", flush=True)
    res["machine"]["load_avg_1m_end"] = os.getloadavg()[0]
    _save(res, a.json)


def _save(res: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
