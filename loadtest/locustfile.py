"""Locust users that stream OpenAI completions / chat completions and measure them like vLLM.

    locust -f loadtest/locustfile.py --host http://127.0.0.1 --ports "8080 8081" \
        --workload demo -u 15 -r 15 [--headless --result-dir results/x]

Every request is one POST row named "<port> <path>" (its time is the whole streamed answer),
plus rows TTFT, TPOT and E2E with the same name for successful requests. Percentiles for
reports come from the raw samples (loadtest.metrics), not from locust's rounded histogram.

Importing this module imports locust, which monkey-patches the process with gevent: never
import it next to grpc (picker) or asyncio code; run it with `locust` or `python -m loadtest`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import gevent
from locust import FastHttpUser, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from loadtest.metrics import RequestSample, StreamTimer, save_run
from loadtest.openai_api import (DONE, ENDPOINTS, OBJECTIVE_HEADER, SSEDecoder, SSEError,
                                 error_reason, request_body)
from loadtest.plan import RunOptions, RunPlan, parse_ports, parse_workload_args
from loadtest.workloads import PROFILES

log = logging.getLogger("loadtest")
PROGRESS_INTERVAL_S = 10.0


@events.init_command_line_parser.add_listener
def _add_arguments(parser, **_kw):
    # parser.add_argument (not an argument group): only it knows include_in_web_ui
    group = parser
    group.add_argument("--ports", default="8080 8081", help="target ports on --host, "
                       "space or comma separated; users are spread over them ('' = host's port)")
    group.add_argument("--model", default="qwq", help="model name sent in the body")
    group.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS),
                       help="completions -> /v1/completions, chat -> /v1/chat/completions")
    group.add_argument("--objective", default="",
                       help=f"InferenceObjective name sent as {OBJECTIVE_HEADER} ('' = none)")
    group.add_argument("--workload", default="demo", choices=sorted(PROFILES),
                       help="workload profile (loadtest/workloads.py)")
    group.add_argument("--workload-args", default="",
                       help="profile overrides key=value,... e.g. path=/data/sharegpt.json")
    group.add_argument("--seed", type=int, default=0, help="workload seed")
    group.add_argument("--num-prompts", type=int, default=0, help="0 = the profile's number")
    group.add_argument("--request-rate", type=float, default=0.0,
                       help="req/s with gamma gaps; 0 = closed loop (users = concurrency)")
    group.add_argument("--burstiness", type=float, default=1.0, help="gamma shape, 1 = Poisson")
    group.add_argument("--cycle-prompts", action="store_true", default=False,
                       help="start over when all prompts were sent (else each is sent once "
                            "and the test ends)")
    group.add_argument("--request-timeout", type=float, default=900.0,
                       help="seconds for a whole streamed request")
    group.add_argument("--result-dir", default="", include_in_web_ui=False,
                       help="write <dir>/run-<time>.json (vLLM fields) and .samples.jsonl "
                            "(headless default: results/locust-<time>)")


def options_from_parsed(opts) -> RunOptions:
    return RunOptions(
        workload=opts.workload, seed=int(opts.seed), ports=parse_ports(opts.ports),
        model=opts.model, endpoint=opts.endpoint, objective=opts.objective,
        num_prompts=int(opts.num_prompts) or None, request_rate=float(opts.request_rate),
        burstiness=float(opts.burstiness), cycle=bool(opts.cycle_prompts),
        request_timeout=float(opts.request_timeout),
        workload_args=parse_workload_args(opts.workload_args))


def target_url(host: str, port: int | None, path: str) -> str:
    parts = urlsplit(host if "://" in host else f"http://{host}")
    netloc = parts.hostname if port is None else f"{parts.hostname}:{port}"
    if port is None and parts.port:
        netloc = f"{parts.hostname}:{parts.port}"
    return f"{parts.scheme}://{netloc}{path}"


class OpenAIUser(FastHttpUser):
    """One closed-loop client: takes the next prompt, streams the answer, records a sample."""

    host = "http://127.0.0.1"
    wait_time = constant(0)
    network_timeout = 900.0
    connection_timeout = 10.0

    def on_start(self):
        self.plan: RunPlan = self.environment.loadtest_plan
        self.port = self.plan.next_port()
        options = self.plan.options
        self.path = ENDPOINTS[options.endpoint]
        self.url = target_url(self.host, self.port, self.path)
        self.row = f"{self.port} {self.path}" if self.port else self.path
        self.headers = {"Accept": "text/event-stream"}
        if options.objective:
            self.headers[OBJECTIVE_HEADER] = options.objective

    @task
    def stream_one(self):
        item = self.plan.next_request()
        if item is None:
            raise StopUser()  # this process's prompts are all handed out
        spec, send_at = item
        delay = send_at - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        sample = self.send(spec)
        self.report(sample)
        self.plan.record(sample)

    def send(self, spec) -> RequestSample:
        options = self.plan.options
        body = request_body(spec, options.endpoint, options.model)
        timer = StreamTimer(time.time(), time.perf_counter(), prompt_tokens=spec.prompt_tokens,
                            target=str(self.port or ""), endpoint=self.path, group=spec.group)
        error = ""
        with self.client.post(self.url, json=body, headers=self.headers, stream=True,
                              catch_response=True, name=self.row) as resp:
            try:
                with gevent.Timeout(options.request_timeout,
                                    SSEError(f"timeout after {options.request_timeout:g}s")):
                    error = self.read_stream(resp, timer)
            except SSEError as err:
                error = str(err)
            except Exception as err:  # connection reset, socket timeout...: a failed request
                error = f"{type(err).__name__}: {err}"
            sample = timer.finish(time.perf_counter(), error=error)
            resp.request_meta["response_time"] = (sample.end - sample.start) * 1000
            if sample.success:
                resp.success()
            else:
                resp.failure(sample.error)
        return sample

    @staticmethod
    def read_stream(resp, timer: StreamTimer) -> str:
        """Read SSE lines as they arrive; returns a failure reason or ''."""
        if resp.status_code == 0:
            return f"connection error: {getattr(resp, 'error', None) or 'no response'}"
        if resp.status_code != 200:
            return error_reason(resp.status_code, resp.content)
        decoder = SSEDecoder()
        # readline() returns as soon as one line is in; iter_content(n) would wait for n bytes
        # and batch several chunks together, which distorts TTFT/ITL.
        raw = resp._response
        while True:
            line = raw.readline(b"\n")
            if not line:
                event = decoder.close()
                if event is not None and event is not DONE:
                    timer.on_event(event, time.perf_counter())
                break
            event = decoder.feed(line)
            if event is DONE:
                break
            if event is not None:
                timer.on_event(event, time.perf_counter())
        if not decoder.done:
            return "broken SSE: stream ended before data: [DONE]"
        return ""

    def report(self, sample: RequestSample) -> None:
        if not sample.success:
            return
        fire = self.environment.events.request.fire
        rows = [("TTFT", sample.ttft), ("E2E", sample.latency)]
        if sample.tpot is not None:
            rows.append(("TPOT", sample.tpot))
        for kind, seconds in rows:
            fire(request_type=kind, name=self.row, response_time=seconds * 1000.0,
                 response_length=sample.output_tokens, exception=None, context={})


# --- run lifecycle: plan per process, samples to the master, result files ---------------------

@events.init.add_listener
def _on_init(environment, runner=None, **_kw):
    if isinstance(runner, MasterRunner):
        runner.register_message("loadtest_sample", _master_got_sample)
        runner.register_message("loadtest_done", _master_got_done)


def _master_got_sample(environment, msg, **_kw):
    environment.loadtest_plan.record(RequestSample(**msg.data))


def _master_got_done(environment, msg, **_kw):
    environment.loadtest_workers_done += 1
    if environment.loadtest_workers_done >= environment.loadtest_worker_count:
        _finish(environment)


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    options = getattr(environment, "loadtest_options", None) or \
        options_from_parsed(environment.parsed_options)
    specs = options.build()
    runner = environment.runner
    environment.loadtest_written = False
    if isinstance(runner, MasterRunner):
        # workers learn the count through the custom options the master sends with the spawn
        environment.parsed_options.loadtest_worker_count = runner.worker_count
        environment.loadtest_worker_count = runner.worker_count
        environment.loadtest_workers_done = 0
        plan = RunPlan(specs, options)
    elif isinstance(runner, WorkerRunner):
        count = int(getattr(environment.parsed_options, "loadtest_worker_count", 1) or 1)
        # a worker that joined after the start (index >= count) gets no prompts
        plan = RunPlan(specs, options, worker_index=runner.worker_index,
                       worker_count=count,
                       on_sample=lambda s: runner.send_message("loadtest_sample", asdict(s)),
                       on_done=lambda: runner.send_message("loadtest_done", runner.worker_index))
        if plan.total == 0:
            runner.send_message("loadtest_done", runner.worker_index)
    else:
        plan = RunPlan(specs, options, on_done=lambda: _finish(environment))
    environment.loadtest_plan = plan
    headless = bool(getattr(environment.parsed_options, "headless", False))
    if headless and not isinstance(runner, WorkerRunner):
        environment.loadtest_progress = gevent.spawn(_print_progress, plan)
    log.info("loadtest: %s prompts (%s), ports %s, endpoint %s, seed %s", plan.total,
             options.workload, options.ports or "of --host", options.endpoint, options.seed)


def _print_progress(plan: RunPlan):
    while True:
        gevent.sleep(PROGRESS_INTERVAL_S)
        log.info("loadtest progress: %s", plan.progress())


def _finish(environment):
    """All prompts answered: write results, then end (headless) or stop (web UI) the test."""
    _write_results(environment)
    on_done = getattr(environment, "loadtest_on_done", None)
    if on_done:
        on_done()
    elif getattr(environment.parsed_options, "headless", False):
        gevent.spawn(environment.runner.quit)
    else:
        gevent.spawn(environment.runner.stop)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    progress = getattr(environment, "loadtest_progress", None)
    if progress is not None:
        progress.kill(block=False)
    if not isinstance(environment.runner, WorkerRunner):
        _write_results(environment)


def _write_results(environment):
    plan = getattr(environment, "loadtest_plan", None)
    opts = environment.parsed_options
    if plan is None or not plan.samples or getattr(environment, "loadtest_written", False):
        return
    result_dir = getattr(opts, "result_dir", "") if opts is not None else ""
    if not result_dir and getattr(opts, "headless", False):
        result_dir = f"results/locust-{time.strftime('%Y%m%d-%H%M%S')}"
    if not result_dir:
        return
    environment.loadtest_written = True
    stem = Path(result_dir) / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    o = plan.options
    result = save_run(stem, plan.samples, model_id=o.model, endpoint_type="openai",
                      label=f"{environment.host} ports {o.ports}", workload=o.workload,
                      seed=o.seed, num_prompts=plan.total, request_rate=o.request_rate or "inf",
                      max_concurrency=getattr(opts, "num_users", None))
    log.info("loadtest: %d completed, %d failed; wrote %s.json and %s.samples.jsonl",
             result["completed"], result["failed"], stem, stem)
