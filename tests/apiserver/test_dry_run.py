"""Every render target passes server-side apply with dryRun=All on a real kube-apiserver: defaulting,
built-in validation, the CRDs' structural schemas and CEL rules, name and namespace rules, as the
cluster applies them. A rejection names the target, the object and the field."""
from __future__ import annotations

import copy
import time

import pytest

from tests.helpers.kube import ROOT
from validation.apiserver import ServerSideApply, dry_run_all, render_targets
from validation.cli import default_crds_dir
from validation.render import Rendered


@pytest.fixture(scope="module")
def targets():
    results = render_targets(ROOT, default_crds_dir(ROOT).resolve())
    assert {"overlays/a10", "overlays/a10-canary", "argocd/apps", "argocd/bootstrap", "base/crds"} <= set(results)
    return results


def test_every_render_target_passes_server_side_dry_run(admin, targets):
    started = time.monotonic()
    problems = dry_run_all(admin, targets)
    n = sum(len(r.objects) for r in targets.values())
    print(f"\n{len(targets)} targets, {n} objects dry-run in {time.monotonic() - started:.1f}s")
    assert [str(p) for p in problems] == []


def find(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def test_rejections_name_target_object_and_field(admin, targets):
    """Mistakes the offline schemas cannot see: a selector that does not select the Deployment's
    own pods (built-in validation) and duplicate pool ports (the InferencePool CRD's CEL rule)."""
    objs = copy.deepcopy(targets["overlays/a10"].objects)
    picker = find(objs, "Deployment", "inference-gateway-ext-proc")
    picker["spec"]["selector"]["matchLabels"] = {"app": "someone-else"}
    pool = find(objs, "InferencePool", "reasoning-pool")
    pool["spec"]["targetPorts"] = [{"number": 8000}, {"number": 8000}]
    problems = ServerSideApply(admin).dry_run(Rendered("overlays/a10", objs))
    by_object = {(p.obj, p.path): p for p in problems}
    assert len(problems) == 2, [str(p) for p in problems]
    selector = by_object[("Deployment llm/inference-gateway-ext-proc", "spec.template.metadata.labels")]
    assert selector.target == "overlays/a10" and "`selector` does not match template `labels`" in selector.message
    ports = by_object[("InferencePool llm/reasoning-pool", "spec.targetPorts")]
    assert "port number must be unique" in ports.message
    assert str(selector).startswith("[apiserver] overlays/a10: Deployment llm/inference-gateway-ext-proc: "
                                    "spec.template.metadata.labels: Invalid: ")


def test_unknown_kind_is_reported(admin):
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "default"}}
    problems = ServerSideApply(admin).dry_run(Rendered("overlays/x", [obj]))
    assert [str(p) for p in problems] == [
        "[apiserver] overlays/x: Widget default/w: the API server serves no example.com/v1 Widget "
        "(built-in or from the CRD directory)"]
