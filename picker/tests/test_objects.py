"""Static objects: the same YAML shapes as base/inference, files or directories, other kinds ignored."""
import subprocess
from pathlib import Path

import pytest

from picker.discovery.objects import ObjectError, load_objects

REPO = Path(__file__).resolve().parents[2]

OBJECTS = """\
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: reasoning-pool}
spec: {selector: {matchLabels: {app: x}}, targetPorts: [{number: 8000}]}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -10, poolRef: {name: reasoning-pool}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceModelRewrite
metadata: {name: qwq, creationTimestamp: "2025-01-01T00:00:00Z"}
spec:
  poolRef: {name: reasoning-pool}
  rules:
    - matches: [{model: {type: Exact, value: qwq}}]
      targets: [{modelRewrite: qwq, weight: 90}, {modelRewrite: qwq-canary, weight: 10}]
"""


def test_multi_document_file_and_directory(tmp_path):
    f = tmp_path / "sub" / "objects.yaml"
    f.parent.mkdir()
    f.write_text(OBJECTS)
    for source in (f, tmp_path):
        objectives, rewrites = load_objects([source])
        assert [(o.name, o.priority, o.pool) for o in objectives] == [("batch", -10, "reasoning-pool")]
        (rw,) = rewrites
        assert rw.rules[0].models == ("qwq",)
        assert rw.rules[0].targets == (("qwq", 90.0), ("qwq-canary", 10.0))


@pytest.mark.parametrize("bad,field", [
    ("spec: {priority: high}", "spec.priority"),
    ("spec: {rules: []}", "spec.rules"),
    ("spec: {rules: [{targets: [{modelRewrite: a, weight: 0}]}]}", "targets[0].weight"),
    ("spec: {rules: [{targets: [{modelRewrite: a, weight: 1}, {modelRewrite: b}]}]}", "weight on all"),
    ("spec: {rules: [{matches: [{model: {value: 3}}], targets: [{modelRewrite: a}]}]}", "matches[0].model"),
])
def test_errors_name_file_object_and_field(tmp_path, bad, field):
    kind = "InferenceObjective" if "priority" in bad else "InferenceModelRewrite"
    f = tmp_path / "bad.yaml"
    f.write_text(f"apiVersion: llm-d.ai/v1alpha2\nkind: {kind}\nmetadata: {{name: broken}}\n{bad}\n")
    with pytest.raises(ObjectError) as e:
        load_objects([f])
    assert str(f) in str(e.value) and "'broken'" in str(e.value) and field in str(e.value)


def test_missing_path_and_bad_yaml(tmp_path):
    with pytest.raises(ObjectError, match="no such file"):
        load_objects([tmp_path / "nope.yaml"])
    f = tmp_path / "x.yaml"
    f.write_text("a: [\n")
    with pytest.raises(ObjectError, match="invalid YAML"):
        load_objects([f])


@pytest.mark.skipif(not (REPO / "base/inference/kustomization.yaml").exists(), reason="no base/inference")
def test_reads_the_repository_base_inference(tmp_path):
    objectives, rewrites = load_objects([REPO / "base/inference"])
    assert {o.name for o in objectives} and rewrites
    try:
        rendered = subprocess.run(["kubectl", "kustomize", str(REPO / "base/inference")],
                                  capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("kubectl not available")
    (tmp_path / "rendered.yaml").write_text(rendered)
    got_objectives, got_rewrites = load_objects([tmp_path / "rendered.yaml"])
    assert sorted(got_objectives, key=lambda o: o.name) == sorted(objectives, key=lambda o: o.name)
    assert got_rewrites == rewrites
