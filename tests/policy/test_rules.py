"""`python -m validation` runs the cross-object rules on the targets they apply to."""
from __future__ import annotations

import copy
import shutil

from tests.policy.conftest import CACHE, ROOT, find, rendered
from validation import edge, policy, rules
from validation.render import Rendered


def test_overlays_get_every_workload_rule_and_all_but_the_open_ones_the_edge_rules():
    a10 = rules.rules_for("overlays/a10")
    assert set(policy.ALL_CHECKS) <= set(a10) and policy.gpu_pods_fit_node in a10
    assert set(edge.EDGE_CHECKS) <= set(a10) and set(edge.HEALTH_CHECKS) <= set(a10)
    open_gateway = rules.rules_for("overlays/a10-open-gateway")
    assert not set(edge.EDGE_CHECKS) & set(open_gateway) and set(policy.ALL_CHECKS) <= set(open_gateway)
    assert rules.rules_for("argocd/apps") == [policy.chart_sources_resolve]
    assert rules.rules_for("base/gateway") == []  # a base alone is not a deployable whole


def test_a_broken_rule_is_reported_with_target_rule_and_object():
    objs = rendered("overlays/a10")
    mounts = find(objs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    mounts["containers"][0]["volumeMounts"][0]["name"] = "llm-models"
    found = [str(p) for p in rules.rule_problems([Rendered("overlays/a10", objects=objs)])]
    assert any(p.startswith("[policy volume_mounts_have_volumes] overlays/a10: LeaderWorkerSet")
               and "llm-models" in p for p in found), found


def test_validate_cli_runs_the_rules(tmp_path, capsys, crds_dir):
    from validation.cli import main

    root = tmp_path / "repo"
    for folder in ("base", "components", "overlays"):
        shutil.copytree(ROOT / folder, root / folder)
    lws = root / "base" / "vllm" / "group" / "leaderworkerset.yaml"
    text = lws.read_text()
    broken = text.replace('- --tensor-parallel-size\n              - "2"', '- --tensor-parallel-size\n              - "3"', 1)
    assert broken != text
    lws.write_text(broken)
    # the copy has no ../shared/crds or .cache/crds of its own: the CRDs this checkout validates with
    code = main(["--root", str(root), "overlays/a10", "--skip-workflows", "--skip-kubeconform",
                 "--skip-gateway", "--cache-dir", str(CACHE), "--crds-dir", str(crds_dir)])
    out = capsys.readouterr().out
    assert code == 1 and "[policy parallelism_matches_resources] overlays/a10:" in out, out


def _apps_pointing_at(path, annotations=None):
    app = copy.deepcopy(find(rendered("argocd/apps"), "Application", "qwq-serving"))
    app["spec"]["source"]["path"] = path
    if annotations:
        app["metadata"].setdefault("annotations", {}).update(annotations)
    return Rendered("argocd/apps", objects=[app])


def test_default_app_path_is_closed():
    app = find(rendered("argocd/apps"), "Application", "qwq-serving")
    path = app["spec"]["source"]["path"]
    problems = rules.app_paths_closed([_apps_pointing_at(path), Rendered(path, objects=rendered(path))])
    assert problems == []


def test_app_on_an_open_gateway_is_caught_unless_it_opts_in():
    open_path = "overlays/a10-open-gateway"
    target = Rendered(open_path, objects=rendered(open_path))
    problems = [str(p) for p in rules.app_paths_closed([_apps_pointing_at(open_path), target])]
    # both listeners unauthenticated, both routes without a per-client limit
    assert len(problems) == 4 and all("Application qwq-serving deploys overlays/a10-open-gateway" in p
                                      for p in problems), problems
    assert any("listeners_authenticate" in p for p in problems) and any("routes_rate_limit" in p for p in problems)
    opted_in = _apps_pointing_at(open_path, {rules.OPEN_GATEWAY_ANNOTATION: "true"})
    assert rules.app_paths_closed([opted_in, target]) == []


def test_app_on_a_closed_overlay_without_rate_limits_is_caught():
    objs = rendered("overlays/a10")
    for btp in [o for o in objs if o.get("kind") == "BackendTrafficPolicy"]:
        btp["spec"].pop("rateLimit", None)
    problems = rules.app_paths_closed([_apps_pointing_at("overlays/a10"), Rendered("overlays/a10", objects=objs)])
    assert len(problems) == 2 and all("routes_rate_limit" in str(p) for p in problems)
