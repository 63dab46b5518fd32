"""Argo CD: every app path exists and renders, charts are pinned, waves and sync options are set."""
from __future__ import annotations


import pytest

from validation.cli import app_path_problems
from validation import policy
from validation.render import Rendered, argo_app_sources, chart_name, render
from tests.policy.conftest import ROOT, find, rendered

APPS = "argocd/apps"


def applications():
    return [o for o in rendered(APPS) + rendered("argocd/bootstrap") if o["kind"] == "Application"]


def test_every_app_path_exists_and_renders():
    sources = argo_app_sources(applications())
    git_paths = [src["path"] for _, src in sources if "path" in src and not chart_name(src)]
    assert {"argocd/apps", "base/crds", "overlays/a10"} <= set(git_paths)
    for path in git_paths:
        assert rendered(path), path     # rendered() fails the test on any render problem


def test_app_paths_and_chart_versions_are_checked():
    apps = applications()
    problems, paths = app_path_problems(Rendered(APPS, apps), ROOT)
    assert problems == [] and set(paths) == {"argocd/apps", "base/crds", "overlays/a10", "argocd/platform/ratelimit-redis"}
    broken = find(apps, "Application", "qwq-serving")
    broken["spec"]["source"]["path"] = "overlays/a100"
    chart = find(apps, "Application", "lws")
    chart["spec"]["source"]["targetRevision"] = "0.10.*"
    problems, _ = app_path_problems(Rendered(APPS, apps), ROOT)
    messages = sorted(str(p) for p in problems)
    assert len(messages) == 2
    assert "Application lws: spec.source.targetRevision: chart lws is not pinned" in messages[0]
    assert "Application qwq-serving: spec.source.path: path 'overlays/a100' does not exist" in messages[1]


def test_chart_sources_are_in_a_form_argo_cd_fetches():
    assert policy.chart_sources_resolve(rendered(APPS) + rendered("argocd/bootstrap")) == []


CLASSIC_LWS = {"repoURL": "registry.k8s.io/lws/charts", "chart": "lws", "targetRevision": "0.10.0"}


def test_classic_oci_chart_source_without_repository_secret_is_rejected():
    objs = rendered(APPS) + rendered("argocd/bootstrap")
    find(objs, "Application", "lws")["spec"]["source"] = dict(CLASSIC_LWS)
    problems = policy.chart_sources_resolve(objs)
    assert len(problems) == 1
    assert problems[0].startswith("Application argocd/lws: spec.source.repoURL: 'registry.k8s.io/lws/charts' + chart 'lws'")
    assert "needs a repository Secret" in problems[0] and "oci://registry.k8s.io/lws/charts/lws" in problems[0]


@pytest.mark.parametrize("secret_type, url, data, ok", [
    ("repository", "registry.k8s.io/lws/charts", {"type": "helm", "enableOCI": "true"}, True),
    ("repo-creds", "registry.k8s.io", {"type": "helm", "enableOCI": "true"}, True),
    ("repository", "registry.k8s.io/lws/charts", {"type": "helm"}, False),        # no enableOCI
    ("repository", "registry.k8s.io/other", {"type": "helm", "enableOCI": "true"}, False),
])
def test_classic_oci_chart_source_resolves_only_with_a_matching_repository_secret(secret_type, url, data, ok):
    objs = rendered(APPS)
    find(objs, "Application", "lws")["spec"]["source"] = dict(CLASSIC_LWS)
    secret = {"apiVersion": "v1", "kind": "Secret",
              "metadata": {"name": "lws-charts", "namespace": "argocd",
                           "labels": {"argocd.argoproj.io/secret-type": secret_type}},
              "stringData": {"url": url, **data}}
    assert (policy.chart_sources_resolve(objs + [secret]) == []) is ok


def test_native_oci_source_with_chart_or_subpath_is_rejected():
    objs = rendered(APPS)
    eg = find(objs, "Application", "envoy-gateway")["spec"]["source"]
    eg["chart"] = "gateway-helm"
    lws = find(objs, "Application", "lws")["spec"]["source"]
    lws["path"] = "charts"
    problems = sorted(policy.chart_sources_resolve(objs))
    assert len(problems) == 2
    assert problems[0].startswith("Application argocd/envoy-gateway: spec.source.chart: an oci:// repoURL")
    assert problems[1].startswith("Application argocd/lws: spec.source.path: 'charts'")


def test_sync_waves_order_crds_platform_workload():
    waves = {o["metadata"]["name"]: int(o["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"])
             for o in rendered(APPS)}
    assert waves["inference-crds"] < waves["envoy-gateway"] == waves["lws"] < waves["qwq-serving"]


def test_crd_and_chart_apps_use_server_side_apply_and_crds_are_not_pruned():
    apps = {o["metadata"]["name"]: o for o in rendered(APPS)}
    for name in ("inference-crds", "envoy-gateway", "lws"):
        assert "ServerSideApply=true" in apps[name]["spec"]["syncPolicy"]["syncOptions"], name
    crds = apps["inference-crds"]["spec"]["syncPolicy"]
    assert crds["automated"]["prune"] is False and "Prune=false" in crds["syncOptions"]
    assert "SkipDryRunOnMissingResource=true" in apps["qwq-serving"]["spec"]["syncPolicy"]["syncOptions"]
    # the charts' versions: tests/policy/test_pins.py


def test_apps_stay_inside_their_project():
    projects = {o["metadata"]["name"]: o["spec"] for o in rendered("argocd/bootstrap") if o["kind"] == "AppProject"}
    for app in applications():
        spec = app["spec"]
        project = projects[spec["project"]]
        assert spec["source"]["repoURL"] in project["sourceRepos"], app["metadata"]["name"]
        allowed = {(d["server"], d["namespace"]) for d in project["destinations"]}
        assert (spec["destination"]["server"], spec["destination"]["namespace"]) in allowed


def test_workload_cluster_scoped_kinds_are_whitelisted():
    project = find(rendered("argocd/bootstrap"), "AppProject", "llm-serving")["spec"]
    allowed = {(k["group"], k["kind"]) for k in project["clusterResourceWhitelist"]}
    for obj in rendered("overlays/a10") + rendered("overlays/a10-canary"):
        if "namespace" not in obj["metadata"]:
            group = obj["apiVersion"].rpartition("/")[0]
            assert (group, obj["kind"]) in allowed, obj["kind"]


def test_base_crds_urls_are_the_pinned_ones_with_offline_copies(crds_dir):
    from validation.crds import all_urls
    import yaml
    urls = yaml.safe_load((ROOT / "base/crds/kustomization.yaml").read_text())["resources"]
    assert set(urls) <= set(all_urls())
    result = render(ROOT, "base/crds", crds_dir)
    assert result.problems == [] and sorted(o["spec"]["names"]["kind"] for o in result.objects) == \
        ["InferenceModelRewrite", "InferenceObjective", "InferencePool"]


def test_crd_url_without_copy_or_tag_is_caught(tmp_path, crds_dir):
    (tmp_path / "base/crds").mkdir(parents=True)
    (tmp_path / "base/crds/kustomization.yaml").write_text(
        "resources:\n"
        "  - https://raw.githubusercontent.com/llm-d/llm-d-router/main/config/crd/bases/llm-d.ai_inferenceobjectives.yaml\n"
        "  - https://example.com/v1.0.0/nothing.yaml\n")
    problems = [str(p) for p in render(tmp_path, "base/crds", crds_dir).problems]
    assert len(problems) == 2
    assert "not pinned to a release tag" in problems[0] and "no copy of https://example.com" in problems[1]
