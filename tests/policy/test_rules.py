"""`python -m validation` runs the cross-object rules on the targets they apply to."""
from __future__ import annotations

import shutil

from tests.policy.conftest import CACHE, ROOT, find, rendered
from validation import edge, policy, rules
from validation.render import Rendered


def test_overlays_get_every_workload_rule_and_the_secure_one_the_edge_rules():
    a10 = rules.rules_for("overlays/a10")
    assert set(policy.ALL_CHECKS) <= set(a10) and policy.gpu_pods_fit_node in a10
    assert not set(edge.EDGE_CHECKS) & set(a10) and set(edge.HEALTH_CHECKS) <= set(a10)
    assert set(edge.EDGE_CHECKS) <= set(rules.rules_for("overlays/a10-secure"))
    assert rules.rules_for("argocd/apps") == [policy.chart_sources_resolve]
    assert rules.rules_for("base/gateway") == []  # a base alone is not a deployable whole


def test_a_broken_rule_is_reported_with_target_rule_and_object():
    objs = rendered("overlays/a10")
    mounts = find(objs, "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    mounts["containers"][0]["volumeMounts"][0]["name"] = "llm-models"
    found = [str(p) for p in rules.rule_problems([Rendered("overlays/a10", objects=objs)])]
    assert any(p.startswith("[policy volume_mounts_have_volumes] overlays/a10: LeaderWorkerSet")
               and "llm-models" in p for p in found), found


def test_validate_cli_runs_the_rules(tmp_path, capsys):
    from validation.cli import main

    root = tmp_path / "repo"
    for folder in ("base", "components", "overlays"):
        shutil.copytree(ROOT / folder, root / folder)
    lws = root / "base" / "vllm" / "group" / "leaderworkerset.yaml"
    text = lws.read_text()
    broken = text.replace('- --tensor-parallel-size\n              - "2"', '- --tensor-parallel-size\n              - "3"', 1)
    assert broken != text
    lws.write_text(broken)
    code = main(["--root", str(root), "overlays/a10", "--skip-workflows", "--skip-kubeconform",
                 "--skip-gateway", "--cache-dir", str(CACHE)])
    out = capsys.readouterr().out
    assert code == 1 and "[policy parallelism_matches_resources] overlays/a10:" in out, out
