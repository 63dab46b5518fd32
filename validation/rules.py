"""Which cross-object rules apply to which render target; `python -m validation` runs them all
(tests/policy tests each rule with broken fixtures).

- every overlay (a deployable whole): the policy rules (validation/policy.py), GPU fit on the A10
  node, Secret references in the workload namespace, isolation (validation/isolation.py) and
  autoscaling (validation/autoscaling.py: rules only a ScaledObject triggers);
- overlays with the edge components (`overlays/*-secure`): the edge rules (validation/edge.py);
- Argo CD folders: every Helm chart source resolves without undeclared repository Secrets.
"""
from __future__ import annotations

from functools import partial

from validation import autoscaling, edge, isolation, policy
from validation.problems import Problem

WORKLOAD_NAMESPACE = "llm"


def rules_for(target: str) -> list:
    if target.startswith("overlays/"):
        rules = [*policy.ALL_CHECKS, policy.gpu_pods_fit_node, *isolation.ISOLATION_CHECKS, *edge.HEALTH_CHECKS,
                 partial(policy.secret_refs_in_namespace, namespace=WORKLOAD_NAMESPACE),
                 *autoscaling.AUTOSCALING_CHECKS]
        if target.endswith("-secure"):
            rules += edge.EDGE_CHECKS
        return rules
    if target.startswith("argocd/"):
        return [policy.chart_sources_resolve]
    return []


def rule_problems(rendered) -> list[Problem]:
    """Every applicable rule over every render target that rendered."""
    problems = []
    for r in rendered:
        if not r.objects:
            continue
        for rule in rules_for(r.target):
            name = getattr(rule, "__name__", None) or rule.func.__name__
            problems += [Problem(r.target, message, source=f"policy {name}") for message in rule(r.objects)]
    return problems
