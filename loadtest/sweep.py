"""Rate sweep: every port at several request rates (same prompts), TTFT and goodput against rate.

    python -m loadtest sweep [--ports PORT PORT] --rates 1 2 4 8 --goodput ttft:2000 tpot:100

Like guidellm's sweep or a loop over `vllm bench serve --request-rate R`: at each rate each port
gets the same prompts with the same Poisson (gamma) send times; the port order alternates from
one rate to the next. The folder holds <port>-rate<R>.json (vLLM fields), .samples.jsonl and
.load.jsonl per run, sweep.json, report.md and sweep.png. Imports locust (via compare).
"""
from __future__ import annotations

from loadtest import compare  # first: locust's gevent monkey-patching

import json
import time
from dataclasses import replace
from pathlib import Path

import gevent

from loadtest.report import sweep_table, write_sweep_report
from loadtest.scrape import LoadRecorder
from loadtest.metrics import save_run


def sweep(*, host: str, ports: list[int], rates: list[float], out: Path,
          options: compare.RunOptions, concurrency: int | None, metrics_endpoints, percentiles,
          goodput: dict, label: str = "", speedup: float | None = None,
          scrape_interval: float = 1.0, idle_timeout: float = 60.0,
          run_timeout: float = 3600.0) -> str:
    settings = options.settings()
    if concurrency is None:  # vLLM's default: no limit; the rate paces the requests
        concurrency = int(settings["num_prompts"])
    endpoints = compare.DEFAULT_METRICS_ENDPOINTS if metrics_endpoints is None \
        else metrics_endpoints
    out.mkdir(parents=True, exist_ok=True)
    progress = compare.Progress()
    meta = {"host": host, "ports": ports, "rates": rates, "endpoint": options.endpoint,
            "model": options.model, "workload": options.workload, "seed": options.seed,
            "workload_settings": settings, "concurrency": concurrency,
            "burstiness": options.burstiness, "percentiles": list(percentiles),
            "goodput": goodput or {}, "label": label, "speedup": speedup,
            "metrics_endpoints": endpoints, "request_rate": "sweep", "repetitions": 1,
            "routing": compare.routing_names(host, ports),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": []}
    for i, rate in enumerate(rates):
        for port in (ports if i % 2 == 0 else list(reversed(ports))):
            recorder = LoadRecorder(endpoints, interval=scrape_interval, sleep=gevent.sleep)
            compare.wait_idle(recorder, idle_timeout, progress)
            samples, total = compare.run_one(
                host, replace(options, ports=[port], request_rate=rate), concurrency, recorder,
                f"rate {rate:g}/s port {port}", progress, run_timeout)
            stem = f"{port}-rate{rate:g}"
            run_meta = compare._run_meta({**meta, "request_rate": rate}, port, concurrency)
            save_run(out / stem, samples, **run_meta, percentiles=percentiles,
                     goodput=goodput, unfinished=total - len(samples))
            with open(out / f"{stem}.load.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in recorder.rows)
            meta["runs"].append({"port": port, "rate": rate, "stem": stem})
            (out / "sweep.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return write_sweep_report(out)


def main(args) -> int:
    options = compare.options_from_args(argparse_rate_free(args))
    out = Path(args.out or f"results/sweep-{time.strftime('%Y%m%d-%H%M%S')}")
    endpoints, speedup = compare.resolve_stack(args)
    with compare.removed_if_empty(out):
        sweep(host=args.host, ports=args.ports, rates=args.rates, out=out, options=options,
              concurrency=args.concurrency, metrics_endpoints=endpoints,
              percentiles=args.percentiles, goodput=args.goodput, label=args.label,
              speedup=speedup, scrape_interval=args.scrape_interval,
              idle_timeout=args.idle_timeout, run_timeout=args.run_timeout)
    print(sweep_table(out))
    print(f"results: {out}/ (report.md, sweep.png, <port>-rate<R>.json)")
    return 0


def argparse_rate_free(args):
    """compare's options without a fixed rate (the sweep sets one per run)."""
    args.request_rate = 0.0
    return args
