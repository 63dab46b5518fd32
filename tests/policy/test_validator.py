"""`python -m validation` reports broken manifests with target, object and field path."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.policy.conftest import CACHE, ROOT
from validation.cli import default_crds_dir, main

LWS = """
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {name: qwq}
spec:
  replicas: 1
  leaderWorkerTemplate:
    sizee: 2
    restartPolicy: RecreateGroupSometimes
    workerTemplate:
      spec:
        containers: [{name: vllm, image: "vllm/vllm-openai:v0.11.0"}]
"""
ROUTE = """
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: r}
spec:
  parentRefs: [{name: inference-gateway}]
  rules:
    - matches: [{path: {type: Exact, value: "v1/completions"}}]
      backendRefs: [{name: svc, port: 8000}]
"""
POOL = """
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: pool}
spec:
  selector: {matchLabels: {role: leader}}
  targetPorts: [{number: 8000}]
  endpointPickerRef: {name: picker}
"""
EEP = """
apiVersion: gateway.envoyproxy.io/v1alpha1
kind: EnvoyExtensionPolicy
metadata: {name: e}
spec:
  targetRefs: [{group: gateway.networking.k8s.io, kind: HTTPRoute, name: r}]
  extProc:
    - backendRefs: [{name: picker, port: 9002}]
      failOpen: true
      processingMode: {request: {body: FullDuplexStreamed}}
"""
DEPLOYMENT = """
apiVersion: apps/v1
kind: Deployment
metadata: {name: d}
spec:
  replicas: two
  selector: {matchLabels: {app: d}}
  template:
    metadata: {labels: {app: d}}
    spec:
      containers: [{name: c, image: "busybox:1.37", imagePullPolicyy: Always}]
"""
UNKNOWN = """
apiVersion: example.com/v1
kind: Widget
metadata: {name: w}
"""


def write_overlay(root: Path, name: str, docs: dict[str, str], extra: str = "") -> str:
    folder = root / "overlays" / name
    folder.mkdir(parents=True)
    for file, text in docs.items():
        (folder / file).write_text(text)
    resources = "".join(f"  - {f}\n" for f in docs) + extra
    (folder / "kustomization.yaml").write_text(f"namespace: demo\nresources:\n{resources}")
    return f"overlays/{name}"


def run(root: Path, capsys, *extra) -> tuple[int, list[str]]:
    # The repo's cache: converted CRD schemas are keyed by content, so sharing them is safe.
    code = main(["--root", str(root), "--skip-workflows", "--cache-dir", str(CACHE),
                 "--crds-dir", str(default_crds_dir(ROOT)), *extra])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ERROR")]
    return code, lines


def test_schema_cel_and_defaults_errors_name_target_object_and_field(tmp_path, capsys):
    target = write_overlay(tmp_path, "bad", {"lws.yaml": LWS, "route.yaml": ROUTE, "pool.yaml": POOL,
                                             "eep.yaml": EEP, "deploy.yaml": DEPLOYMENT, "widget.yaml": UNKNOWN})
    code, lines = run(tmp_path, capsys, "--skip-kubeconform", target)
    assert code == 1
    text = "\n".join(lines)
    expected = [
        # strict CRD schema: unknown field, enum
        "overlays/bad: LeaderWorkerSet demo/qwq: spec.leaderWorkerTemplate: Additional properties are not allowed ('sizee'",
        "overlays/bad: LeaderWorkerSet demo/qwq: spec.leaderWorkerTemplate.restartPolicy: 'RecreateGroupSometimes' is not one of",
        # CEL rule of Gateway API
        "overlays/bad: HTTPRoute demo/r: spec.rules[0].matches[0].path: value must be an absolute path",
        # CEL rule that only fires after defaulting endpointPickerRef.kind to Service
        "overlays/bad: InferencePool demo/pool: spec.endpointPickerRef:",
        # CEL rule of Envoy Gateway
        "overlays/bad: EnvoyExtensionPolicy demo/e: spec.extProc[0]: If FullDuplexStreamed body processing mode is used, FailOpen must be false.",
        # built-in kinds, strict
        "overlays/bad: Deployment demo/d: spec.replicas: 'two' is not of type 'integer', 'null'",
        "overlays/bad: Deployment demo/d: spec.template.spec.containers[0]: Additional properties are not allowed ('imagePullPolicyy'",
        "overlays/bad: Widget demo/w: no schema for example.com/v1 Widget",
    ]
    for needle in expected:
        assert needle in text, needle
    pool_error = next(ln for ln in lines if "InferencePool" in ln)
    assert "port" in pool_error.lower()


def test_broken_yaml_names_the_file(tmp_path, capsys):
    target = write_overlay(tmp_path, "yaml", {"ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n   bad: [\n"})
    code, lines = run(tmp_path, capsys, "--skip-kubeconform", target)
    assert code == 1 and len(lines) == 1
    assert "[kustomize] overlays/yaml:" in lines[0] and "ns.yaml" in lines[0] and "yaml: line 5" in lines[0]


def test_broken_kustomization_names_the_missing_file(tmp_path, capsys):
    target = write_overlay(tmp_path, "missing", {"ns.yaml": "apiVersion: v1\nkind: Namespace\nmetadata: {name: x}\n"},
                           extra="  - nothere.yaml\n")
    code, lines = run(tmp_path, capsys, "--skip-kubeconform", target)
    assert code == 1 and len(lines) == 1 and "nothere.yaml" in lines[0] and "no such file" in lines[0]


def test_cli_exits_non_zero_without_traceback(tmp_path):
    folder = tmp_path / "overlays" / "x"
    folder.mkdir(parents=True)
    (folder / "kustomization.yaml").write_text("resources: [\n")
    proc = subprocess.run([sys.executable, "-m", "validation", "--root", str(tmp_path), "--skip-workflows",
                           "--skip-kubeconform", "--crds-dir", str(default_crds_dir(ROOT)), "overlays/x"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "ERROR [kustomize] overlays/x:" in proc.stdout


def test_kubeconform_runs_offline_and_reports_fields(tmp_path, capsys):
    kubeconform = ROOT / ".tools/bin/kubeconform"
    if not kubeconform.is_file():
        pytest.skip("kubeconform not installed (make tools)")
    target = write_overlay(tmp_path, "kc", {"lws.yaml": LWS, "deploy.yaml": DEPLOYMENT})
    code, lines = run(tmp_path, capsys, "--kubeconform", str(kubeconform), target)
    kc = [ln for ln in lines if ln.startswith("ERROR [kubeconform]")]
    assert code == 1
    assert any("overlays/kc: Deployment demo/d: spec.replicas:" in ln for ln in kc), kc
    assert any("overlays/kc: LeaderWorkerSet demo/qwq: spec.leaderWorkerTemplate:" in ln and "sizee" in ln for ln in kc), kc


def test_workflow_schema_violation_is_reported(tmp_path):
    from validation import workflows
    folder = tmp_path / ".github" / "workflows"
    folder.mkdir(parents=True)
    (folder / "bad.yaml").write_text("name: x\non: push\njobs:\n  a:\n    runs-onn: ubuntu-24.04\n    steps: []\n")
    problems = workflows.check(tmp_path)
    assert len(problems) == 1 and "bad.yaml" in problems[0].message
    assert workflows.check(ROOT) == []


@pytest.mark.parametrize("second_namespace,errors", [("a", 1), ("b", 0)])
def test_cel_sees_escaped_property_names(second_namespace, errors):
    """Gateway API rules read `p.__namespace__`: the CEL input must escape `namespace` like Kubernetes."""
    from validation.crdschema import CRDStore
    store = CRDStore(default_crds_dir(ROOT), CACHE)
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "r"},
             "spec": {"parentRefs": [{"name": "g", "namespace": "a"}, {"name": "g", "namespace": second_namespace}],
                      "rules": [{"backendRefs": [{"name": "s", "port": 80}]}]}}
    found = [e.message for e in store.validate(route)]
    assert len(found) == errors
    if errors:
        assert found[0].startswith("sectionName or port must be unique")
