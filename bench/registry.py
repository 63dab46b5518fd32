"""Every benchmark of `python -m bench`, in one list: to add one, add one `Benchmark` here (its
runner and its section's body live in its own module). The list's order is the order
`python -m bench` runs them in and the order of BENCHMARKS.md's sections."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from bench import (autoscale, coldstart, crosscheck, demo, failover, flow, flow_clients_http, keda_chain,
                   kv_http, kv_suites, lab_suites, lengths_http, outcomes_http, phases, robustness, test_time,
                   validation_time, vllm_engine)
from bench.markdown import section
from bench.picker import kvevents as picker_kvevents
from bench.picker import suites as picker_suites


@dataclass(frozen=True)
class Benchmark:
    name: str  # python -m bench NAME
    about: str  # what it runs (python -m bench --help)
    run: Callable[[argparse.Namespace], object]  # runs it, saves results/bench/<result>.json
    section: Callable[..., list[str]]  # BENCHMARKS.md section from each result's JSON (None: not run)
    results: tuple[str, ...] = ()  # the results/bench/<result>.json it writes; () = its name

    @property
    def result_names(self) -> tuple[str, ...]:
        return self.results or (self.name,)


def titled(title: str, body: Callable[[dict], list[str]]) -> Callable[[dict | None], list[str]]:
    """A section `## title` with the lines `body(result)` writes, "(not run)" without a result."""
    return lambda d: section(title, d, body)


BENCHMARKS = [
    Benchmark("validation", "python -m validation, warm: one run to fill the caches, then 3 timed runs",
              lambda a: validation_time.run_warm(), titled("Validation time", validation_time.report)),
    Benchmark("picker", "make bench-picker: decisions/s and latency in process and through gRPC, scrape CPU",
              lambda a: picker_suites.run_service(),
              titled("Picker decision throughput and latency", picker_suites.service_report)),
    Benchmark("lab", "python -m lab run on the article and shared-prefix workloads, least request vs the "
              "picker's profiles, --seeds", lambda a: [lab_suites.run_lab(w, a.seeds) for w in ("article", "shared-prefix")],
              lab_suites.lab_section, results=("lab-article", "lab-shared-prefix")),
    Benchmark("matrix", "python -m lab matrix: every scenario x policy x seed (--matrix-args for more options)",
              lambda a: lab_suites.run_matrix(a.seeds, a.matrix_args.split()),
              titled("Routing lab: scenario matrix", lab_suites.matrix_report), results=("lab-matrix",)),
    Benchmark("lengths-gap", "the lab on the length-sensitive scenarios: the learned-lengths profile, told "
              "each class's distribution or each true length, both oracles (where its gap goes)",
              lambda a: lab_suites.run_lengths_gap(a.seeds),
              titled("Learned output lengths: where the gap to the oracles goes", lab_suites.lengths_gap_report)),
    Benchmark("autoscale", "python -m lab plan on the day trace: fixed pools of 2..6 groups vs the shipped "
              "autoscaler settings, --seeds", lambda a: autoscale.run_autoscale(a.seeds),
              titled("Autoscaling: fixed pools vs the shipped scaler over a day", autoscale.report)),
    Benchmark("autoscale-day", "the same over a whole 24 h day, fixed pools of 5 and 6 groups (the smaller "
              "ones miss the objective on the 6 h day and cost the most CPU here), --seeds",
              lambda a: autoscale.run_autoscale(a.seeds, name="autoscale-day", hours=24, pools=(5, 6)),
              titled("Autoscaling over a whole 24 h day: 5 and 6 fixed groups vs the shipped scaler",
                     autoscale.report)),
    Benchmark("keda-chain", "tests/autoscaling/test_keda_chain.py: Prometheus -> KEDA -> HPA -> LeaderWorkerSet "
              "-> simulated groups -> the picker on loopback, the timeline up, without Prometheus and down "
              "(needs make autoscaling-tools)", lambda a: keda_chain.run(),
              titled("Autoscaling chain on the real KEDA, HPA controller and Prometheus", keda_chain.report)),
    Benchmark("crosscheck", "python -m local.stack demo and the same workload in the lab, side by side",
              lambda a: crosscheck.main(a.seed, a.seeds, a.speedup),
              titled("Scaled HTTP comparison and the lab cross-check", crosscheck.section_lines)),
    Benchmark("phases", "the lab with the picker told of each request's end at its decision or at the response's end",
              lambda a: phases.main(a.seeds),
              titled("What the picker is sent: request phase only or the response phase too", phases.report)),
    Benchmark("coldstart", "a burst sharing a new prefix at a fresh router, in the lab and over HTTP",
              lambda a: coldstart.main(),
              titled("Cold start: a burst sharing a new prefix at a fresh router", coldstart.report)),
    Benchmark("demo", "make demo: both listeners, CPU per process, Envoy's listener counters",
              lambda a: demo.run(), titled("`make demo` on the real data plane", demo.report)),
    Benchmark("picker-scale", "make bench-picker-scale: decide() against pool size, scraping, worker processes",
              lambda a: picker_suites.run_scale(),
              titled("Picker at scale: pool size, scraping, worker processes", picker_suites.scale_report)),
    Benchmark("kv-events", "precise prefix routing's cost: decoding and indexing KV-cache events per batch, "
              "over ZMQ at 16/256/1,024 endpoints, memory per endpoint, decide() with and without",
              lambda a: picker_kvevents.run(),
              titled("Precise prefix routing: the cost of following the engines' KV-cache events",
                     picker_kvevents.report)),
    Benchmark("prefilter", "the lab on 16 groups: the default profile vs the prefilter forced on",
              lambda a: lab_suites.run_prefilter(a.seeds),
              titled("Picker candidate prefilter: routing quality", lab_suites.prefilter_report)),
    Benchmark("replicas", "python -m lab.replicas on 16 groups: 1, 2, 4 picker replicas, shared or independent",
              lambda a: lab_suites.run_replicas(a.seeds),
              titled("Picker replicas: routing quality with 1, 2 and 4 replicas", lab_suites.replicas_report)),
    Benchmark("flow", "the lab: flow control (late binding) for two clients' fairness and for priorities "
              "(the first 3 of --seeds)",
              lambda a: flow.main(a.seeds[:3] if a.seeds else None),
              titled("Flow control: fairness and priorities (lab)", flow.report)),
    Benchmark("matrix-flow", "python -m lab matrix on the scenarios late binding is for: least request, the "
              "picker with and without flow control, the oracle with and without holding",
              lambda a: flow.run_matrix(a.seeds),
              titled("Flow control on the scenario matrix", lab_suites.matrix_report),
              results=("lab-matrix-flow",)),
    Benchmark("flow-http", "make demo's stack twice, the picker with and without flow control, bursty "
              "open-loop arrivals on both listeners (run under flock /tmp/local-stack.lock)",
              lambda a: flow.run_http(),
              titled("Flow control through HTTP: bursty arrivals on the real data plane", flow.http_report)),
    Benchmark("flow-fairness-http", "make demo's stack three times, the picker without flow control, with it, with it "
              "and 2 workers: two "
              "clients with their own API keys, a light one next to a 10x heavier one and interactive next to "
              "standard, open loop into a saturated pool (run under flock /tmp/local-stack.lock; --seeds: the "
              "first only)",
              lambda a: flow_clients_http.main(a.seeds[:1] if a.seeds else None),
              titled("Flow control through HTTP: fairness and priorities between two clients",
                     flow_clients_http.report)),
    Benchmark("kv-rate", "python -m lab.kv_rate: KV-cache events the simulator's engine publishes "
              "under the demo workload", lambda a: kv_suites.run_kv_rate(a.seeds),
              titled("KV-cache events: the simulator's event rate", kv_suites.kv_rate_report)),
    Benchmark("cache-pressure", "python -m lab matrix on the cache-pressure scenarios: 1, 2, 4 "
              "picker replicas, approximate vs precise (KV-cache events) vs the oracle",
              lambda a: kv_suites.run_pressure(a.seeds),
              titled("Precise prefix routing under cache pressure", kv_suites.pressure_report)),
    Benchmark("matrix-precise", "python -m lab matrix on every matrix scenario: the "
              "picker approximate vs precise", lambda a: kv_suites.run_matrix_precise(a.seeds),
              titled("Precise prefix routing on the scenario matrix", kv_suites.matrix_precise_report)),
    Benchmark("replicas-precise", "python -m lab.replicas --precise on 16 groups: 1, 2, 4 "
              "independent replicas with and without KV-cache events, 2 and 4 active-passive",
              lambda a: kv_suites.run_replicas_precise(a.seeds),
              titled("Picker replicas with precise prefix routing", kv_suites.replicas_precise_report)),
    Benchmark("precise-http", "make demo with the picker on KV-cache events and on its approximate "
              "index, both listeners; the events' delivery lag (run under flock /tmp/local-stack.lock)",
              lambda a: kv_http.run(),
              titled("Precise prefix routing on the real data plane", kv_http.report)),
    Benchmark("outcomes-http", "the picker's outcome path on the real data plane: Envoy's and the picker's "
              "CPU per request with the access log and token accounting off, Lua only, on; outcomes "
              "received, their lag, what a picker restart loses (run under flock /work/heavy.lock)",
              lambda a: outcomes_http.run(),
              titled("Outcomes: what the access log to the picker costs and loses", outcomes_http.report)),
    Benchmark("lengths-http", "routing on learned output lengths through the real data plane: "
              "chat-reasoning and client-mix, least request vs the picker's default and lengths profiles, "
              "each run cold (run under flock /work/heavy.lock)",
              lambda a: lengths_http.main(a.seeds[:1] if a.seeds else None),
              titled("Learned output lengths through HTTP", lengths_http.report)),
    Benchmark("vllm", "real vLLM's CPU build (make vllm): server start, memory, request latency on this "
              "CPU, the conformance suite's wall time", lambda a: vllm_engine.run_vllm(),
              titled("Real vLLM on this machine (CPU build, tiny model)", vllm_engine.report)),
    Benchmark("soak", "picker/tests/test_abuse.py for --soak-seconds: abuse rounds against one picker",
              lambda a: robustness.soak(a.soak_seconds),
              titled("The picker under hostile traffic (soak)", robustness.soak_report)),
    Benchmark("dead-backend", "tests/e2e/test_e2e_dead_backend.py: a group killed or stalled under load",
              lambda a: robustness.dead_backend(),
              titled("A dead or stalled backend on both listeners", robustness.dead_backend_report)),
    Benchmark("failover", "tests/e2e/test_e2e_failover.py with FAILOVER_BENCH=1: the picker's acting leader "
              "terminated, killed, stopped 10 s, and the API server stopped 30 s, under steady load on 8081 "
              "(run under flock /work/heavy.lock)", lambda a: failover.run(),
              titled("The picker fails over: what a client sees", failover.report)),
    Benchmark("edge-abuse", "tests/e2e/test_e2e_edge_abuse.py: bad input at the edge through Envoy "
              "(run under flock /tmp/local-stack.lock)",
              lambda a: robustness.edge_abuse(),
              titled("Bad input at the edge", robustness.edge_abuse_report)),
    Benchmark("token-budget", "tests/e2e/test_e2e_token_budget.py: token budgets per client, overshoot "
              "streamed and not (run under flock /tmp/local-stack.lock)",
              lambda a: robustness.token_budget(),
              titled("Token budgets per client", robustness.token_budget_report)),
    Benchmark("test-time", "make check (once to warm its caches, then timed) and make test, warm, with "
              "pytest's durations", lambda a: test_time.run_warm(),
              titled("How long the checks take: make check and make test", test_time.report)),
    Benchmark("ci-time", "a fresh clone's .ci/run (its own virtualenvs and tools; ~30 min of both cores)",
              lambda a: test_time.run_fresh(),
              titled("A fresh clone's CI run (.ci/run)", test_time.ci_report)),
]
BY_NAME = {b.name: b for b in BENCHMARKS}
