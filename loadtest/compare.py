"""Run the same workload against several Gateway ports (least request vs picker) and report.

Locust runs in this process as a library (locust.env.Environment + LocalRunner): one runner per
(port, repetition), so each run has its own users, samples and /metrics scrapes, and progress can
be printed between runs. Importing this module imports locust, which gevent-monkey-patches the
process; nothing here (or imported from here) may import grpc.
"""
from __future__ import annotations

import locust  # noqa: F401  (first: gevent monkey-patching before sockets are created)

import json
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import gevent
import greenlet
from gevent.event import Event
from locust import events
from locust.env import Environment

from loadtest import locustfile
from loadtest.metrics import (DEFAULT_PERCENTILES, RequestSample, by_client, error_counts, run_duration,
                              save_run, summarize)
from loadtest.plan import RunOptions
from loadtest.report import comparison_table, headline, load_folder, spread, write_report
from loadtest.scrape import LoadRecorder
from loadtest.targets import LOOPBACK, host_parts, local_stack, routing_names

# Ctrl-C: the main greenlet gets KeyboardInterrupt (the CLI prints one line); the hub need not
# print it as well. Python raises it in whichever greenlet runs when the signal arrives: in a
# locust user's greenlet it would end that user only and the run would go on, so the handler
# throws it into the main greenlet (the one importing this module, the CLI's).
gevent.get_hub().NOT_ERROR = (*gevent.get_hub().NOT_ERROR, KeyboardInterrupt)
_MAIN_GREENLET = greenlet.getcurrent()


def _interrupt_main() -> None:
    if not _MAIN_GREENLET.dead:
        _MAIN_GREENLET.throw(KeyboardInterrupt)


gevent.signal_handler(signal.SIGINT, _interrupt_main)

DEFAULT_METRICS_ENDPOINTS = [f"http://127.0.0.1:{p}" for p in (8101, 8102, 8103)]


class Progress:
    """Progress on stderr: one rewritten line on a terminal, a line every 10 s otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0

    def show(self, text: str, final: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        elif final or now - self.last >= 10.0:
            self.stream.write(text + "\n")
            self.last = now
        self.stream.flush()


def run_one(host: str, options: RunOptions, concurrency: int, recorder: LoadRecorder,
            label: str, progress: Progress, run_timeout: float) -> tuple[list[RequestSample], int]:
    """One headless locust run of the whole workload against options.ports.

    Returns the samples and the number of prompts (more than samples after a run timeout)."""
    env = Environment(user_classes=[locustfile.OpenAIUser], events=events,
                      host=host if "://" in host else f"http://{host}")
    env.loadtest_options = options
    done = Event()
    env.loadtest_on_done = done.set
    runner = env.create_local_runner()
    scraper = gevent.spawn(recorder.poll_forever)
    deadline = time.monotonic() + run_timeout
    try:
        runner.start(concurrency, spawn_rate=max(concurrency, 1))
        while not hasattr(env, "loadtest_plan"):  # test_start runs in the spawning greenlet
            gevent.sleep(0.01)
        plan = env.loadtest_plan
        while not done.wait(timeout=1.0):
            progress.show(f"{label}: {plan.progress()}")
            if time.monotonic() > deadline:
                progress.show(f"{label}: run timeout after {run_timeout:g}s, stopping", True)
                break
        progress.show(f"{label}: {plan.progress()}", final=True)
        return list(plan.samples), plan.total
    finally:
        runner.quit()
        scraper.kill(block=False)


def wait_idle(recorder: LoadRecorder, timeout: float, progress: Progress) -> None:
    """Let the backends drain (requests of the previous run) before the next run starts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if recorder.is_idle():
            return
        progress.show("waiting for the endpoints to become idle ...")
        gevent.sleep(1.0)
    progress.show(f"endpoints still busy after {timeout:g}s; starting anyway", final=True)


def compare(*, host: str, ports: list[int], out: Path, options: RunOptions,
            concurrency: int | None, repetitions: int = 2,
            metrics_endpoints: list[str] | None = None, scrape_interval: float = 1.0,
            idle_timeout: float = 60.0, run_timeout: float = 3600.0,
            percentiles=DEFAULT_PERCENTILES, goodput: dict | None = None, label: str = "",
            speedup: float | None = None, before_each_run: str | None = None) -> str:
    """Run every port `repetitions` times (order alternates), write the folder, return Markdown.

    One repetition writes <port>.json/.samples.jsonl/.load.jsonl; several write one
    <port>-rep<k>.* set per run and <port>.json over all of them (no samples copy).
    `before_each_run`: a shell command run before every run (e.g. one that restarts the servers and
    the router, so that no run inherits the caches and prefix state of the one before)."""
    settings = options.settings()
    if concurrency is None:  # clients are open loop: no cap unless one is asked for
        concurrency = (not options.clients and settings.get("concurrency")) or int(settings["num_prompts"])
    endpoints = DEFAULT_METRICS_ENDPOINTS if metrics_endpoints is None else metrics_endpoints
    out.mkdir(parents=True, exist_ok=True)
    progress = Progress()
    meta = {"host": host, "ports": ports, "endpoint": options.endpoint, "model": options.model,
            "objective": options.objective, "workload": options.workload, "seed": options.seed,
            "workload_settings": settings, "concurrency": concurrency,
            "request_rate": options.request_rate, "repetitions": repetitions,
            "percentiles": list(percentiles), "goodput": goodput or {}, "label": label,
            "speedup": speedup, "metrics_endpoints": endpoints,
            "routing": routing_names(host, ports), "before_each_run": before_each_run,
            "clients": [asdict(c) for c in options.clients],
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    stats = {"percentiles": percentiles, "goodput": goodput}
    by_port: dict[int, list[list[RequestSample]]] = {p: [] for p in ports}
    unfinished = {p: 0 for p in ports}
    scrape_errors: dict[str, str] = {}
    for rep in range(1, repetitions + 1):
        order = ports if rep % 2 == 1 else list(reversed(ports))
        for port in order:
            if before_each_run:
                progress.show(f"before port {port} rep {rep}: {before_each_run}", final=True)
                subprocess.run(before_each_run, shell=True, check=True)
            recorder = LoadRecorder(endpoints, interval=scrape_interval, sleep=gevent.sleep)
            wait_idle(recorder, idle_timeout, progress)
            name = f"port {port} rep {rep}/{repetitions}"
            samples, total = run_one(host, replace(options, ports=[port]), concurrency, recorder,
                                     name, progress, run_timeout)
            stem = str(port) if repetitions == 1 else f"{port}-rep{rep}"
            save_run(out / stem, samples, **_run_meta(meta, port, concurrency), **stats,
                     unfinished=total - len(samples))
            unfinished[port] += total - len(samples)
            with open(out / f"{stem}.load.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in recorder.rows)
            scrape_errors.update(recorder.errors)
            by_port[port].append(samples)
            meta["runs"].append({"port": port, "rep": rep, "stem": stem})
    if repetitions > 1:
        for port, runs in by_port.items():
            # all repetitions together; duration = the sum of the runs' wall times
            result = summarize([s for run in runs for s in run],
                               duration=sum(run_duration(run) for run in runs), **stats,
                               **_run_meta(meta, port, concurrency), unfinished=unfinished[port])
            result["errors_by_reason"] = error_counts([s for run in runs for s in run])
            clients = by_client([s for run in runs for s in run], **stats)
            if clients:
                result["by_client"] = clients
            (out / f"{port}.json").write_text(json.dumps(result, indent=2) + "\n",
                                              encoding="utf-8")
    meta["scrape_errors"] = scrape_errors
    (out / "compare.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return write_report(out)


def _run_meta(meta: dict, port: int, concurrency: int) -> dict:
    label = f"{meta['label']} port {port}" if meta.get("label") else f"port {port}"
    return {"date": time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": "openai",
            "label": label, "routing": meta["routing"][str(port)], "model_id": meta["model"],
            "workload": meta["workload"], "seed": meta["seed"],
            "num_prompts": meta["workload_settings"]["num_prompts"],
            "request_rate": meta["request_rate"] or "inf", "max_concurrency": concurrency,
            "speedup": meta.get("speedup")}


def options_from_args(args) -> RunOptions:
    from loadtest.plan import parse_workload_args
    return RunOptions(workload=args.workload, seed=args.seed, model=args.model,
                      endpoint=args.endpoint, objective=args.objective,
                      num_prompts=args.num_prompts, request_rate=args.request_rate,
                      burstiness=args.burstiness, request_timeout=args.request_timeout,
                      workload_args=parse_workload_args(args.workload_args),
                      clients=tuple(getattr(args, "clients", ()) or ()))


def resolve_stack(args) -> tuple[list[str] | None, float | None]:
    """Metrics endpoints and speedup: from the flags, else from the matching local stack."""
    stack = local_stack(args.host, args.ports)
    endpoints = None if args.metrics_endpoints is None else \
        [e if "://" in e else f"http://{e}" for e in args.metrics_endpoints
         if e.lower() != "none"]
    if endpoints is None and stack:
        endpoints = stack["sims"]
    speedup = args.speedup if args.speedup is not None else (stack or {}).get("speedup")
    if speedup is None and host_parts(args.host)[1] not in LOOPBACK:
        speedup = 1.0    # a real Gateway: wall clock is model time
    return endpoints, speedup


def main(args) -> int:
    options = options_from_args(args)
    out = Path(args.out or f"results/compare-{time.strftime('%Y%m%d-%H%M%S')}")
    endpoints, speedup = resolve_stack(args)
    with removed_if_empty(out):
        compare(host=args.host, ports=args.ports, out=out, options=options,
                concurrency=args.concurrency, repetitions=args.repetitions,
                metrics_endpoints=endpoints, scrape_interval=args.scrape_interval,
                idle_timeout=args.idle_timeout, run_timeout=args.run_timeout,
                percentiles=args.percentiles, goodput=args.goodput, label=args.label,
                speedup=speedup, before_each_run=args.before_each_run)
    meta, results, runs = load_folder(out)
    print(headline(meta))
    print(comparison_table(results, meta.get("percentiles"), spread(meta, runs)))
    print(f"results: {out}/ (report.md, {', '.join(str(p) + '.json' for p in args.ports)}, "
          f"plots *.png)")
    failed = sum(r["failed"] for r in results.values())
    completed = sum(r["completed"] for r in results.values())
    if failed:
        print(f"warning: {failed} failed requests (reasons in report.md)", file=sys.stderr)
    return 1 if completed == 0 else 0


@contextmanager
def removed_if_empty(folder: Path):
    """Delete `folder` when the block ends (also by Ctrl-C) without any result file in it."""
    existed = folder.exists()
    try:
        yield
    finally:
        if not existed and folder.is_dir() and not any(folder.glob("*.samples.jsonl")):
            shutil.rmtree(folder, ignore_errors=True)
