"""`python -m monitoring.dashboards [--check]`: generate the Grafana dashboards (Grafana Foundation SDK).

Writes components/monitoring/dashboards/<uid>.json; the component's kustomization turns each
into a ConfigMap labelled `grafana_dashboard: "1"` for Grafana's dashboard sidecar. `--check`
fails when a committed file differs from what this generator produces.

Panels select on the `job` labels the PodMonitors set (vllm, picker, envoy). A vLLM leader pod
is named after its group, so `pod` names the group; Envoy's listener label comes from the
envoy-proxy PodMonitor's metric relabeling.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import DataSourceRef

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "components/monitoring/dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"


@dataclass
class Query:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    description: str
    unit: str
    queries: list[Query]
    width: int = 12


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    rows: list[Row]


def quantiles(metric: str, by: str, selector: str, qs=(0.5, 0.9), legend: str = "") -> list[Query]:
    return [Query(f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) "
                  f"(rate({metric}_bucket{{{selector}}}[{RATE}])))",
                  f"{legend}p{int(q * 100)}".strip()) for q in qs]


VLLM = 'job="vllm"'
PICKER = 'job="picker"'


def pool() -> Dashboard:
    per_group = "{{pod}}"
    return Dashboard("inference-pool", "Inference pool (vLLM groups)",
                     "Load and latency of every vLLM group, from the leaders' /metrics.", [
        Row("Load", [
            Panel("Running requests", "Requests in the group's running batch "
                  "(vllm:num_requests_running).", "short",
                  [Query(f"sum by (pod) (vllm:num_requests_running{{{VLLM}}})", per_group)], 8),
            Panel("Waiting requests", "Requests queued for a batch slot (vllm:num_requests_waiting).",
                  "short", [Query(f"sum by (pod) (vllm:num_requests_waiting{{{VLLM}}})", per_group)], 8),
            Panel("KV cache usage", "Share of the KV cache in use (vllm:kv_cache_usage_perc); "
                  "near 100 % vLLM preempts and queues.", "percentunit",
                  [Query(f"max by (pod) (vllm:kv_cache_usage_perc{{{VLLM}}})", per_group)], 8),
        ]),
        Row("Cache and throughput", [
            Panel("Prefix cache hit rate", "Prompt tokens found in the prefix cache / tokens looked "
                  "up (vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total).",
                  "percentunit",
                  [Query(f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{VLLM}}}[{RATE}])) / "
                         f"sum by (pod) (rate(vllm:prefix_cache_queries_total{{{VLLM}}}[{RATE}]))",
                         per_group)], 8),
            Panel("Generated tokens/s", "Output tokens per second (vllm:generation_tokens_total).",
                  "short", [Query(f"sum by (pod) (rate(vllm:generation_tokens_total{{{VLLM}}}[{RATE}]))",
                                  per_group)], 8),
            Panel("Prompt tokens/s", "Prefill tokens per second (vllm:prompt_tokens_total).", "short",
                  [Query(f"sum by (pod) (rate(vllm:prompt_tokens_total{{{VLLM}}}[{RATE}]))",
                         per_group)], 8),
        ]),
        Row("Latency (vLLM histograms)", [
            Panel("Time to first token", "p50 and p90 per group "
                  "(vllm:time_to_first_token_seconds).", "s",
                  quantiles("vllm:time_to_first_token_seconds", "pod", VLLM, legend="{{pod}} "), 8),
            Panel("Inter-token latency", "p50 and p90 per group (vllm:inter_token_latency_seconds).",
                  "s", quantiles("vllm:inter_token_latency_seconds", "pod", VLLM, legend="{{pod}} "), 8),
            Panel("End-to-end request latency", "p50 and p90 per group "
                  "(vllm:e2e_request_latency_seconds).", "s",
                  quantiles("vllm:e2e_request_latency_seconds", "pod", VLLM, legend="{{pod}} "), 8),
        ]),
    ])


def listener_panels(listener: str, what: str) -> list[Panel]:
    sel = f'job="envoy", listener="{listener}"'
    return [
        Panel(f"{listener}: requests/s by status class", f"{what}. Envoy's downstream requests "
              "per second by response class (envoy_http_downstream_rq_xx).", "reqps",
              [Query(f"sum by (envoy_response_code_class) "
                     f"(rate(envoy_http_downstream_rq_xx{{{sel}}}[{RATE}]))",
                     "{{envoy_response_code_class}}xx")], 12),
        Panel(f"{listener}: request duration", f"{what}. Whole request as Envoy sees it, to the "
              "last streamed byte (envoy_http_downstream_rq_time).", "ms",
              quantiles("envoy_http_downstream_rq_time", "", sel, (0.5, 0.9, 0.99)), 12),
    ]


def routing() -> Dashboard:
    return Dashboard("inference-routing", "Inference routing: 8080 vs 8081",
                     "The two listeners side by side (Envoy), the servers' time to first token, "
                     "and what the picker decides.", [
        Row("8080 (least request) | 8081 (picker)", [
            *[p for pair in zip(listener_panels("8080", "Plain least request"),
                                listener_panels("8081", "Through the picker")) for p in pair],
            Panel("5xx share by listener", "Share of requests answered 5xx "
                  "(envoy_http_downstream_rq_xx / envoy_http_downstream_rq_total); 503 when no "
                  "endpoint is ready or, on 8081, the picker is unreachable.", "percentunit",
                  [Query(f'sum by (listener) (rate(envoy_http_downstream_rq_xx{{job="envoy", '
                         f'listener=~"808[01]", envoy_response_code_class="5"}}[{RATE}])) / '
                         f'sum by (listener) (rate(envoy_http_downstream_rq_total{{job="envoy", '
                         f'listener=~"808[01]"}}[{RATE}]))', "{{listener}}")], 12),
            Panel("Time to first token (all servers)", "p50 and p90 over the pool "
                  "(vllm:time_to_first_token_seconds). vLLM does not know the listener: compare "
                  "periods when one listener carries the load (as `make compare` runs them).", "s",
                  quantiles("vllm:time_to_first_token_seconds", "", VLLM), 12),
        ]),
        Row("Picker", [
            Panel("Decisions by outcome", "Requests the picker answered per second, by status code "
                  "(picker_requests_total): 200 routed, 429 shed, 503 no ready endpoint.", "reqps",
                  [Query(f"sum by (code) (rate(picker_requests_total{{{PICKER}}}[{RATE}]))",
                         "{{code}}")], 8),
            Panel("Requests served per group", "Requests each group finished per second "
                  "(vllm:request_success_total). While only 8081 carries load, this is where the "
                  "picker's decisions went; with 8080 alone, where least request sent them.", "reqps",
                  [Query(f"sum by (pod) (rate(vllm:request_success_total{{{VLLM}}}[{RATE}]))",
                         "{{pod}}")], 8),
            Panel("Shed requests/s", "Sheddable requests refused with 429 because the pool was "
                  "saturated (picker_shed_requests_total).", "reqps",
                  [Query(f"sum by (model) (rate(picker_shed_requests_total{{{PICKER}}}[{RATE}]))",
                         "{{model}}")], 8),
            Panel("Decision latency", "Time to decide one request: parse, rewrite, schedule "
                  "(picker_decision_duration_seconds).", "s",
                  quantiles("picker_decision_duration_seconds", "", PICKER, (0.5, 0.99)), 8),
            Panel("Scrape errors/s", "Failed /metrics scrapes of each endpoint by the picker "
                  "(picker_scrape_errors_total).", "short",
                  [Query(f"sum by (endpoint) (rate(picker_scrape_errors_total{{{PICKER}}}[{RATE}]))",
                         "{{endpoint}}")], 8),
            Panel("Endpoint ready and pool saturation", "1 when the picker may pick the endpoint "
                  "(picker_endpoint_ready); the pool's saturation, >= 1 sheds "
                  "(picker_pool_saturation).", "short",
                  [Query(f"min by (endpoint) (picker_endpoint_ready{{{PICKER}}})", "{{endpoint}} ready"),
                   Query(f"max(picker_pool_saturation{{{PICKER}}})", "saturation")], 8),
        ]),
    ])


DASHBOARDS = (pool, routing)


def build(d: Dashboard) -> dict:
    b = (gd.Dashboard(d.title).uid(d.uid).description(d.description)
         .tags(["inference", "vllm"]).refresh("30s").time("now-1h", "now")
         .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus")))
    ids = iter(range(1, 1000))
    for row in d.rows:
        b = b.with_row(gd.Row(row.title).id(next(ids)))
        for p in row.panels:
            panel = (timeseries.Panel().id(next(ids)).title(p.title).description(p.description)
                     .unit(p.unit).datasource(DATASOURCE).span(p.width).height(8)
                     .legend(gc.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                             .placement(LegendPlacement.BOTTOM))
                     .tooltip(gc.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)))
            for i, q in enumerate(p.queries):
                panel = panel.with_target(prometheus.Dataquery().expr(q.expr).legend_format(q.legend)
                                          .ref_id(chr(ord("A") + i)).datasource(DATASOURCE))
            b = b.with_panel(panel)
    return json.loads(json.dumps(b.build(), cls=JSONEncoder))


def render(d: Dashboard) -> str:
    return json.dumps(build(d), indent=2, sort_keys=True) + "\n"


def expressions(path: Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of a generated dashboard file."""
    doc = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in doc.get("panels", []) for t in p.get("targets", [])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m monitoring.dashboards", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    stale = []
    for make in DASHBOARDS:
        d = make()
        path = args.out / f"{d.uid}.json"
        text = render(d)
        if args.check:
            old = path.read_text() if path.is_file() else ""
            if old != text:
                stale.append(path)
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                           str(path), "generated", n=1))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(path)
    if stale:
        print(f"stale generated dashboards: {', '.join(map(str, stale))} "
              "(run `python -m monitoring.dashboards`)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
