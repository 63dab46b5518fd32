"""Locust users that stream OpenAI completions / chat completions and measure them like vLLM.

    locust -f loadtest/locustfile.py --host http://127.0.0.1 [--ports "PORT PORT"] \
        --workload demo -u 30 -r 30 [--mode ab|parallel] [--headless] [--result-dir results/x]

Every request is one locust row entry named "<port> <path>" (its time is the whole streamed
answer, its size the SSE bytes), so locust's counts, RPS and failures are true. TTFT, TPOT, ITL
and E2E per port are in the web UI's "LLM metrics" tab and on the page /loadtest/ (tables and
charts over time), with percentiles from the raw samples (loadtest.metrics), as in the result
JSON every run writes.

Modes: `ab` (default) sends all prompts to the first port, then the same prompts to the next,
like `python -m loadtest compare`; `parallel` spreads the users over the ports at once.

Importing this module imports locust, which monkey-patches the process with gevent: never
import it next to grpc (picker) or asyncio code; run it with `locust` or `python -m loadtest`.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict
from pathlib import Path

import gevent
from locust import FastHttpUser, constant, events, task
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from loadtest.clients import client_headers
from loadtest.metrics import (RequestSample, StreamTimer, parse_goodput, parse_percentiles,
                              save_run)
from loadtest.openai_api import (DONE, ENDPOINTS, OBJECTIVE_HEADER, SSEDecoder, SSEError,
                                 error_reason, request_body)
from loadtest.plan import MODES, WAIT, RunOptions, RunPlan, parse_ports, parse_workload_args
from loadtest.targets import (CLUSTER_PORTS, LOCAL_PORTS, api_key, client_keys, default_ports,
                              describe_ports, routing_names, target_url, unreachable)
from loadtest.workloads import WORKLOADS

log = logging.getLogger("loadtest")
PROGRESS_INTERVAL_S = 10.0


def _option(parser, name: str, *, ui: bool = True, **kwargs):
    """A custom option settable as --name, LOCUST_NAME (env) and `name = ...` in locust.conf."""
    env = "LOCUST_" + name.upper().replace("-", "_")
    kwargs["help"] = kwargs.get("help", "") + f" [env {env}]"
    parser.add_argument(f"--{name}", env_var=env, include_in_web_ui=ui, **kwargs)


@events.init_command_line_parser.add_listener
def _add_arguments(parser, **_kw):
    # parser.add_argument (not an argument group): only it knows include_in_web_ui.
    # The web form shows the first ones; the rest are flags, env vars or locust.conf only.
    _option(parser, "ports", default="auto",
            help="Gateway ports on the Host, space or comma separated, the first is the "
                 f"baseline; auto = {describe_ports(LOCAL_PORTS)} on 127.0.0.1 (the local "
                 f"stack), else {describe_ports(CLUSTER_PORTS)}; '' = the Host's own port")
    _option(parser, "mode", default="ab", choices=list(MODES),
            help="ab: all prompts on each port, one port after the other (like compare); "
                 "parallel: users spread over the ports at the same time")
    _option(parser, "workload", default="demo", choices=sorted(WORKLOADS),
            help="workload (loadtest/workloads.py)")
    _option(parser, "num-prompts", type=int, default=0, help="0 = the workload's number")
    _option(parser, "request-rate", type=float, default=0.0,
            help="req/s with gamma gaps; 0 = closed loop (users = max concurrency)")
    _option(parser, "endpoint", default="completions", choices=sorted(ENDPOINTS),
            help="completions -> /v1/completions, chat -> /v1/chat/completions")
    _option(parser, "goodput", default="",
            help="SLOs in ms for goodput like vLLM, e.g. 'ttft:500 tpot:50' ('' = none)")
    _option(parser, "percentiles", default="50,90,99",
            help="percentiles of TTFT/TPOT/ITL/E2E in the UI and the result JSON")
    _option(parser, "workload-args", default="", ui=False,
            help="workload overrides key=value,... e.g. path=/data/sharegpt.json")
    _option(parser, "seed", type=int, default=0, ui=False, help="workload seed")
    _option(parser, "model", default="qwq", ui=False, help="model name sent in the body")
    _option(parser, "objective", default="", ui=False,
            help=f"InferenceObjective name sent as {OBJECTIVE_HEADER} ('' = none)")
    _option(parser, "burstiness", type=float, default=1.0, ui=False,
            help="gamma shape, 1 = Poisson")
    _option(parser, "cycle-prompts", action="store_true", default=False, ui=False,
            help="parallel mode: start over when all prompts were sent (else each is sent "
                 "once and the test ends)")
    _option(parser, "request-timeout", type=float, default=900.0, ui=False,
            help="seconds for a whole streamed request")
    _option(parser, "label", default="", ui=False, help="label stored in the result JSON")
    _option(parser, "result-dir", default="", ui=False,
            help="folder for run-<time>.json (vLLM fields) and .samples.jsonl of every run "
                 "(default results/locust-<start time>)")
    _option(parser, "skip-port-check", action="store_true", default=False, ui=False,
            help="start even if a port does not answer before the run")


def _flag(value) -> bool:
    """Booleans come from the command line as bools and from the web form as strings."""
    return value is True or str(value).lower() in ("true", "1", "on", "yes")


def options_from_parsed(opts, host: str) -> RunOptions:
    ports = default_ports(host) if str(opts.ports).strip() == "auto" else parse_ports(opts.ports)
    return RunOptions(
        workload=opts.workload, seed=int(opts.seed), ports=ports,
        model=opts.model, endpoint=opts.endpoint, objective=opts.objective,
        num_prompts=int(opts.num_prompts) or None, request_rate=float(opts.request_rate),
        burstiness=float(opts.burstiness), cycle=_flag(opts.cycle_prompts),
        request_timeout=float(opts.request_timeout),
        workload_args=parse_workload_args(opts.workload_args), mode=opts.mode)


# once per target, not once per simulated user (it may read the local stack's key file)
_api_key = functools.lru_cache(maxsize=8)(api_key)
_client_keys = functools.lru_cache(maxsize=8)(client_keys)


class OpenAIUser(FastHttpUser):
    """One closed-loop client: takes the next prompt, streams the answer, records a sample."""

    host = "http://127.0.0.1"
    wait_time = constant(0)
    network_timeout = 900.0
    connection_timeout = 10.0

    def on_start(self):
        self.plan: RunPlan = self.environment.loadtest_plan
        self.own_port = self.plan.next_port()   # parallel mode; A/B phases name the port
        options = self.plan.options
        self.path = ENDPOINTS[options.endpoint]
        self.headers = {"Accept": "text/event-stream"}
        if options.objective:
            self.headers[OBJECTIVE_HEADER] = options.objective
        key = _api_key(self.environment.host or self.host, tuple(options.ports))
        self.client_headers = client_headers(options.clients, self.headers, key, options.objective,
                                             OBJECTIVE_HEADER)
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        # a workload's own client ids (class mixes): each with its API key, when there is one
        for client, client_key in _client_keys(self.environment.host or self.host,
                                               tuple(options.ports)).items():
            if client not in self.client_headers:
                self.client_headers[client] = {**self.headers, "Authorization": f"Bearer {client_key}"}

    @task
    def stream_one(self):
        item = self.plan.next_request()
        while item is WAIT:  # A/B: the previous port's phase is still answering
            gevent.sleep(0.05)
            item = self.plan.next_request()
        if item is None:
            raise StopUser()  # this process's prompts are all handed out
        spec, send_at, port = item
        delay = send_at - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        sample = self.send(spec, port if port is not None else self.own_port)
        self.plan.record(sample)

    def send(self, spec, port: int | None) -> RequestSample:
        options = self.plan.options
        body = request_body(spec, options.endpoint, options.model)
        url = target_url(self.host, port, self.path)
        row = f"{port} {self.path}" if port else self.path
        timer = StreamTimer(time.time(), time.perf_counter(), prompt_tokens=spec.prompt_tokens,
                            target=str(port or ""), endpoint=self.path, group=spec.group,
                            client=spec.client)
        headers = self.client_headers.get(spec.client, self.headers)
        error, size = "", 0
        with self.client.post(url, json=body, headers=headers, stream=True,
                              catch_response=True, name=row) as resp:
            try:
                with gevent.Timeout(options.request_timeout,
                                    SSEError(f"timeout after {options.request_timeout:g}s")):
                    error, size = self.read_stream(resp, timer)
            except SSEError as err:
                error = str(err)
            except Exception as err:  # connection reset, socket timeout...: a failed request
                error = f"{type(err).__name__}: {err}"
            sample = timer.finish(time.perf_counter(), error=error)
            resp.request_meta["response_time"] = (sample.end - sample.start) * 1000
            resp.request_meta["response_length"] = size
            if sample.success:
                resp.success()
            else:
                resp.failure(sample.error)
        return sample

    @staticmethod
    def read_stream(resp, timer: StreamTimer) -> tuple[str, int]:
        """Read SSE lines as they arrive; returns (failure reason or '', bytes read)."""
        if resp.status_code == 0:
            return f"connection error: {getattr(resp, 'error', None) or 'no response'}", 0
        if resp.status_code != 200:
            return error_reason(resp.status_code, resp.content), len(resp.content or b"")
        decoder = SSEDecoder()
        size = 0
        # readline() returns as soon as one line is in; iter_content(n) would wait for n bytes
        # and batch several chunks together, which distorts TTFT/ITL.
        raw = resp._response
        while True:
            line = raw.readline(b"\n")
            size += len(line)
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
            return "broken SSE: stream ended before data: [DONE]", size
        return "", size


# --- run lifecycle: plan per process, samples to the master, phases, result files -------------

@events.init.add_listener
def _on_init(environment, runner=None, web_ui=None, **_kw):
    environment.loadtest_status = "ready: press Start (the run checks that each port answers)"
    environment.loadtest_result_files = []
    if isinstance(runner, MasterRunner):
        runner.register_message("loadtest_sample", _master_got_sample)
    if isinstance(runner, WorkerRunner):
        runner.register_message("loadtest_phase_start", _worker_phase_start)
    if web_ui is not None:
        from loadtest import webui  # Flask routes and the extra tab: master / local only
        webui.install(environment, web_ui)


def _master_got_sample(environment, msg, **_kw):
    environment.loadtest_plan.record(RequestSample(**msg.data))


def _worker_phase_start(environment, msg, **_kw):
    environment.loadtest_plan.start_phase(int(msg.data))


def _set_status(environment, text: str, level=logging.INFO) -> None:
    environment.loadtest_status = text
    log.log(level, "loadtest: %s", text)


@events.test_start.add_listener
def _on_test_start(environment, **_kw):
    runner = environment.runner
    opts = environment.parsed_options
    try:
        options = getattr(environment, "loadtest_options", None) or \
            options_from_parsed(opts, environment.host or OpenAIUser.host)
        if opts is not None:
            environment.loadtest_stats = {"percentiles": parse_percentiles(opts.percentiles),
                                          "goodput": parse_goodput(opts.goodput)}
        specs = options.build()
    except (ValueError, OSError) as err:
        _abort(environment, f"not started: {err}")
        return
    environment.loadtest_written = False
    environment.loadtest_started = time.time()
    if isinstance(runner, WorkerRunner):
        # workers learn the count through the custom options the master sends with the spawn;
        # a worker that joined after the start (index >= count) gets no prompts
        count = int(getattr(opts, "loadtest_worker_count", 1) or 1)
        plan = RunPlan(specs, options, worker_index=runner.worker_index, worker_count=count,
                       on_sample=lambda s: runner.send_message("loadtest_sample", asdict(s)),
                       on_phase_done=lambda _phase: None)   # the master opens the next phase
        environment.loadtest_plan = plan
        return
    if isinstance(runner, MasterRunner):
        opts.loadtest_worker_count = runner.worker_count
        plan = RunPlan(specs, options, on_done=lambda: _finish(environment),
                       on_phase_done=lambda phase: _master_next_phase(environment, phase))
    else:
        plan = RunPlan(specs, options, on_done=lambda: _finish(environment),
                       on_phase_done=lambda phase: _next_phase(environment, phase))
    environment.loadtest_plan = plan
    host = environment.host or OpenAIUser.host
    environment.loadtest_routing = routing_names(host, options.ports)
    if opts is not None and not _flag(getattr(opts, "skip_port_check", False)):
        problem = unreachable(host, options.ports)
        if problem:
            plan.finished = True   # users stop at their first request
            _abort(environment, f"not started: {problem}")
            return
    if opts is not None and _flag(getattr(opts, "headless", False)):
        environment.loadtest_progress = gevent.spawn(_print_progress, environment)
    mode = "A/B, one port after the other" if plan.phase_count > 1 else "all ports at once"
    _set_status(environment, f"running: {plan.total} prompts ({options.workload}) per port, "
                f"{mode}: {_names(environment)}; {plan.progress()}")


def _names(environment) -> str:
    names = getattr(environment, "loadtest_routing", {})
    return ", ".join(names.values()) if names else describe_ports([])


def _abort(environment, text: str) -> None:
    _set_status(environment, text, logging.ERROR)
    runner = environment.runner
    if _flag(getattr(environment.parsed_options, "headless", False)):
        environment.process_exit_code = 2
        gevent.spawn(runner.quit)
    else:  # the web UI shows the reason; the user can fix the form and start again
        gevent.spawn(runner.stop)


def _next_phase(environment, phase: int) -> None:
    plan = environment.loadtest_plan
    plan.start_phase(phase)
    log.info("loadtest: %s", plan.progress())


def _master_next_phase(environment, phase: int) -> None:
    _next_phase(environment, phase)
    environment.runner.send_message("loadtest_phase_start", phase)


def _print_progress(environment):
    while True:
        gevent.sleep(PROGRESS_INTERVAL_S)
        log.info("loadtest progress: %s", environment.loadtest_plan.progress())


def _finish(environment):
    """All prompts answered: write results, then end (headless) or stop (web UI) the test."""
    plan = environment.loadtest_plan
    where = f"on each of {_names(environment)}, one after the other" \
        if plan.phase_count > 1 else f"on {_names(environment)}"
    environment.loadtest_status = (f"finished: all {plan.total} prompts were answered {where} "
                                   f"({plan.progress()}); the test stopped by itself")
    _write_results(environment)
    log.info("loadtest: %s", environment.loadtest_status)
    on_done = getattr(environment, "loadtest_on_done", None)
    if on_done:
        on_done()
    elif _flag(getattr(environment.parsed_options, "headless", False)):
        gevent.spawn(environment.runner.quit)
    else:
        gevent.spawn(environment.runner.stop)


@events.test_stop.add_listener
def _on_test_stop(environment, **_kw):
    progress = getattr(environment, "loadtest_progress", None)
    if progress is not None:
        progress.kill(block=False)
    if isinstance(environment.runner, WorkerRunner):
        return
    plan = getattr(environment, "loadtest_plan", None)
    status = getattr(environment, "loadtest_status", "")
    if plan is not None and status.startswith("running"):
        environment.loadtest_status = (
            f"stopped before the end (Stop button, --run-time or Ctrl-C): {plan.progress()}")
    _write_results(environment)


def _write_results(environment):
    plan = getattr(environment, "loadtest_plan", None)
    opts = environment.parsed_options
    if opts is None or plan is None or getattr(environment, "loadtest_written", False):
        return  # compare writes its own files; a run is written once
    environment.loadtest_written = True
    if not plan.samples:
        log.info("loadtest: no request finished, no result file written")
        return
    result_dir = getattr(opts, "result_dir", "") or getattr(environment, "loadtest_default_dir",
                                                            "")
    if not result_dir:
        result_dir = f"results/locust-{time.strftime('%Y%m%d-%H%M%S')}"
        environment.loadtest_default_dir = result_dir   # later runs of this process join it
    stem = Path(result_dir) / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    o = plan.options
    stats = getattr(environment, "loadtest_stats", {})
    result = save_run(stem, plan.samples, model_id=o.model, endpoint_type="openai",
                      label=opts.label or f"{environment.host} ports {o.ports} ({o.mode})",
                      workload=o.workload, seed=o.seed, num_prompts=plan.total,
                      request_rate=o.request_rate or "inf", mode=o.mode,
                      max_concurrency=getattr(opts, "num_users", None),
                      percentiles=stats.get("percentiles"), goodput=stats.get("goodput"))
    environment.loadtest_result_files = [stem.with_name(stem.name + ".json"),
                                         stem.with_name(stem.name + ".samples.jsonl")]
    environment.loadtest_status += f"; results in {stem}.json and {stem}.samples.jsonl"
    log.info("loadtest: %d completed, %d failed; wrote %s.json and %s.samples.jsonl",
             result["completed"], result["failed"], stem, stem)
