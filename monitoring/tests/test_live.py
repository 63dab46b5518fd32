"""Every dashboard query and alert expression against a real Prometheus scraping the local stack.

The stack (simulators, picker, gateway) runs on free loopback ports; Prometheus scrapes it with
the config derived from the PodMonitors (monitoring/local_prometheus.py) while load runs on both listeners:
plain requests, sheddable ones (objective `batch`) against a picker whose saturation thresholds
are low enough to shed them, and one simulator stopped half way (so the picker's scrape errors
and a down target exist). Then every dashboard query must return series, every selector in an
alert expression must match series, and every metric named must be one a component exports.
Over 30 s: the load runs LOAD_SECONDS before and after the simulator stops, for Prometheus's
rate windows to fill, after the stack and Prometheus start.
"""
from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import aiohttp
import promql_parser
import pytest
import yaml

from local.stack import Stack
from local.stack.config import REPO
from monitoring import dashboards, rules
from monitoring import local_prometheus

SAMPLES = REPO.parent / "shared" / "metrics-samples"
RATE_WINDOW = "30s"            # $__rate_interval for the dashboards' queries (scrapes every 1 s)
LOAD_SECONDS = 12.0            # before and after one simulator is stopped

pytestmark = [pytest.mark.timeout(240), pytest.mark.server]  # the local stack and Prometheus


def dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for make in dashboards.DASHBOARDS:
        path = dashboards.OUT / f"{make().uid}.json"
        out += [(f"{path.stem}: {title}", expr.replace("$__rate_interval", RATE_WINDOW))
                for title, expr in dashboards.expressions(path)]
    return out


def alert_expressions() -> list[tuple[str, str]]:
    return [(a["alert"], a["expr"]) for a in rules.alerts()]


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, vector selector) for every selector in a PromQL expression."""
    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, str(node)))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def sheddable_profile(path: Path) -> Path:
    """The default scheduling profile with saturation thresholds any load exceeds."""
    profile = yaml.safe_load((REPO / "picker/src/picker/profiles/default.yaml").read_text())
    profile["name"] = "shed-early"
    profile["saturation"] = {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 0.01}
    path.write_text(yaml.safe_dump(profile))
    return path


async def client(session, url: str, stop_at: float, headers: dict, tally: dict) -> None:
    body = {"model": "qwq", "messages": [{"role": "user", "content": "Explain KV caches. " * 40}],
            "max_tokens": 48, "stream": True, "stream_options": {"include_usage": True}}
    while time.monotonic() < stop_at:
        try:
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                tally[r.status] = tally.get(r.status, 0) + 1
        except aiohttp.ClientError:
            tally["error"] = tally.get("error", 0) + 1
            await asyncio.sleep(0.05)


async def load(stack: Stack, seconds: float, tally: dict) -> None:
    config = stack.config
    stop_at = time.monotonic() + seconds
    base = f"http://{config.host}"
    async with aiohttp.ClientSession(headers=stack.auth_headers(), timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(
            [client(session, f"{base}:{config.http_port}/v1/chat/completions", stop_at, {}, tally)
             for _ in range(4)]
            + [client(session, f"{base}:{config.llm_port}/v1/chat/completions", stop_at, {}, tally)
               for _ in range(4)]
            + [client(session, f"{base}:{config.llm_port}/v1/chat/completions", stop_at,
                      {"x-gateway-inference-objective": "batch"}, tally) for _ in range(2)]))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    run_root = tmp_path_factory.mktemp("observe")
    tally: dict = {}
    with local_prometheus.observed_stack(
            "observe", run_root, groups=3, speedup=100.0, seed=3,
            profile=str(sheddable_profile(run_root / "shed-early.yaml")),
            sim_args=["--max-num-seqs", "2"], picker_args=["--scrape-interval", "0.2"]) as (stack, prom):
        asyncio.run(load(stack, LOAD_SECONDS, tally))
        stack.stop_process(f"sim-{stack.topology.sims[-1].port}")
        asyncio.run(load(stack, LOAD_SECONDS, tally))
        time.sleep(3)   # two more scrapes of everything
        during_load = time.time()
        # The whole pool down: the picker has no ready endpoint and answers 503.
        for sim in stack.topology.sims[:-1]:
            stack.stop_process(f"sim-{sim.port}")
        time.sleep(2)   # > the picker's staleness (1 s)
        asyncio.run(load(stack, 2.0, tally))
        time.sleep(3)
        yield prom, during_load, time.time(), tally


def test_load_reached_both_listeners_and_was_shed(live):
    tally = live[-1]
    assert tally.get(200, 0) > 20 and tally.get(429, 0) > 0 and tally.get(503, 0) > 0, tally


@pytest.mark.parametrize("name,expr", dashboard_queries(), ids=lambda v: v if " " not in v else None)
def test_dashboard_query_returns_series(live, name, expr):
    prom, during_load, _, _ = live
    assert prom.query(expr, during_load), f"{name}: no series for {expr}"


@pytest.mark.parametrize("name,expr", alert_expressions(), ids=lambda v: v if " " not in v else None)
def test_alert_expression_evaluates_on_present_series(live, name, expr):
    prom, _, at, _ = live
    prom.query(expr, at)   # raises on a PromQL error
    for metric, selector in selectors(expr):
        assert prom.query(f"last_over_time({selector}[5m])", at), f"{name}: {selector} matches no series"


def test_every_metric_named_is_exported(live):
    exported = live[0].metric_names()
    named = {metric for _, expr in dashboard_queries() + alert_expressions()
             for metric, _ in selectors(expr)}
    assert named and named - exported == set()


def test_prometheus_evaluates_the_alert_rules(live):
    """The simulator stopped first has been down longest: Prometheus' InferenceGroupDown is
    pending for it (its `for` is 2 minutes, longer than the run)."""
    prom, during_load, _, _ = live
    down = prom.query('ALERTS{alertname="InferenceGroupDown", alertstate="pending"}', during_load)
    assert {s["metric"]["pod"] for s in down} == {"qwq-dist-v1-2"}


def test_picker_series_keep_the_endpoint_they_describe(live):
    """`endpoint` on the picker's series is a leader's address, not the scrape's port name."""
    prom, during_load, _, _ = live
    ready = prom.query('picker_endpoint_ready{job="picker"}', during_load)
    assert ready and all(re.fullmatch(r"127\.0\.0\.1:\d+", s["metric"]["endpoint"]) for s in ready), ready


def family(sample: str) -> str:
    return re.sub(r"_(total|bucket|sum|count|created)$", "", sample)


def test_vllm_metrics_the_queries_read_are_current_vllm_names():
    """Each vllm: family a query names appears on a real vLLM (or vLLM-compatible) /metrics page,
    and none is a name vLLM has deprecated (gpu_cache_usage_perc, gpu_prefix_cache_*, TPOT)."""
    if not SAMPLES.is_dir():
        pytest.skip(f"{SAMPLES} not present")
    real = set()
    for page in SAMPLES.glob("*.prom"):
        real |= {family(m) for m in re.findall(r"^(vllm:[a-zA-Z0-9_:]+)[{ ]", page.read_text(), re.M)}
    named = {family(m) for _, e in dashboard_queries() + alert_expressions()
             for m, _ in selectors(e) if m.startswith("vllm:")}
    assert len(named) >= 10 and named - real == set()
    assert not {n for n in named if "gpu_" in n or "time_per_output_token" in n}


def autoscaler_query() -> str:
    """The Prometheus query of components/autoscaling's ScaledObject, as KEDA sends it."""
    so = yaml.safe_load((REPO / "components/autoscaling/scaledobject.yaml").read_text())
    return next(t for t in so["spec"]["triggers"] if t["type"] == "prometheus")["metadata"]["query"]


def test_the_autoscaler_query_reads_the_pool_and_is_empty_when_it_is_gone(live):
    """KEDA's Prometheus trigger takes exactly one series with a finite value; here it is the sum
    of every leader's running + waiting requests. With the whole pool down the answer is empty,
    which the ScaledObject (ignoreNullValues "false") turns into an error, so the count holds."""
    prom, during_load, after, _ = live
    result = prom.query(autoscaler_query(), during_load)
    assert len(result) == 1, result
    value = float(result[0]["value"][1])
    parts = prom.query('{__name__=~"vllm:num_requests_(running|waiting)",job="vllm",namespace="llm"}', during_load)
    assert len(parts) == 2 * 2                       # 2 gauges x the 2 simulators still up
    assert value == sum(float(p["value"][1]) for p in parts) and value >= 0
    assert prom.query(autoscaler_query(), after) == []
