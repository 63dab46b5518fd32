"""Which cross-object rules apply to which render target; `python -m validation` runs them all
(tests/policy tests each rule with broken fixtures).

- every overlay (a deployable whole): the policy rules (validation/policy.py), GPU fit on the A10
  node, Secret references in the workload namespace, isolation (validation/isolation.py), the
  KV-cache events' flags, ports and policies (validation/kv_events.py), every `vllm serve` flag
  known to the CLI of the pinned vLLM (validation/vllm_cli.py) and autoscaling
  (validation/autoscaling.py: rules only a ScaledObject triggers), picker replicas routing as
  one (validation/picker_ha.py: --leader-election with its Lease RBAC, rollout and budget, or the
  active-active annotation), the picker's outcome path (validation/outcomes.py: Envoy's access
  log reaches --outcomes-port, the entries carry the picker's metadata and the token counts);
- every overlay but the explicitly open ones (`overlays/*-open-gateway`): the edge rules
  (validation/edge.py: API keys, rate limits, TLS, the picker hop verified);
- Argo CD folders: every Helm chart source resolves without undeclared repository Secrets, and
  every Application's Git path authenticates and rate-limits its clients unless the Application
  opts in to an open Gateway with the annotation OPEN_GATEWAY_ANNOTATION (closed by default).
"""
from __future__ import annotations

from functools import partial

from validation import autoscaling, edge, isolation, kv_events, outcomes, picker_ha, policy, vllm_cli
from validation.problems import Problem
from validation.render import argo_app_sources

WORKLOAD_NAMESPACE = "llm"
OPEN_SUFFIX = "-open-gateway"
OPEN_GATEWAY_ANNOTATION = "llm-serving/open-gateway"


def rules_for(target: str) -> list:
    if target.startswith("overlays/"):
        rules = [*policy.ALL_CHECKS, policy.gpu_pods_fit_node, *isolation.ISOLATION_CHECKS,
                 *kv_events.KV_EVENTS_CHECKS, *vllm_cli.VLLM_CLI_CHECKS, *edge.HEALTH_CHECKS,
                 partial(policy.secret_refs_in_namespace, namespace=WORKLOAD_NAMESPACE),
                 *autoscaling.AUTOSCALING_CHECKS, *picker_ha.PICKER_HA_CHECKS,
                 *outcomes.OUTCOME_CHECKS]
        if not target.endswith(OPEN_SUFFIX):
            rules += edge.EDGE_CHECKS
        return rules
    if target.startswith("argocd/"):
        return [policy.chart_sources_resolve]
    return []


def app_paths_closed(rendered) -> list[Problem]:
    """Every Argo CD Application deploys a Gateway that authenticates and rate-limits clients, unless
    it says on itself that it opens the Gateway on purpose."""
    by_target = {r.target: r for r in rendered}
    problems = []
    for r in rendered:
        opted_in = {(o.get("metadata") or {}).get("name") for o in r.objects if o.get("kind") == "Application"
                    and ((o.get("metadata") or {}).get("annotations") or {}).get(OPEN_GATEWAY_ANNOTATION) == "true"}
        for app, src in argo_app_sources(r.objects):
            path = str(src.get("path") or "").strip("/")
            target = by_target.get(path)
            if not target or not target.objects or app in opted_in:
                continue
            for check in edge.CLOSED_CHECKS:
                for message in check(target.objects):
                    problems.append(Problem(r.target, f"Application {app} deploys {path} with an open "
                                            f"Gateway: {message}. Point spec.source.path at a closed overlay "
                                            f"(overlays/a10), or open it on purpose with the annotation "
                                            f"{OPEN_GATEWAY_ANNOTATION}: \"true\"",
                                            source=f"policy {check.__name__}"))
    return problems


def rule_problems(rendered) -> list[Problem]:
    """Every applicable rule over every render target that rendered."""
    rendered = list(rendered)
    problems = []
    for r in rendered:
        if not r.objects:
            continue
        for rule in rules_for(r.target):
            name = getattr(rule, "__name__", None) or rule.func.__name__
            problems += [Problem(r.target, message, source=f"policy {name}") for message in rule(r.objects)]
    return problems + app_paths_closed(rendered)
