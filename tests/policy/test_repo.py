"""Repository-level rules: no Secret data in git; the canary split is written once and propagates."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from validation import policy
from validation.canary import split_problems, split_weights
from validation.render import kustomize
from tests.policy.conftest import ROOT, find

MANIFEST_DIRS = ["base", "overlays", "components", "argocd", "loadtest"]


def manifest_files(root):
    for folder in MANIFEST_DIRS:
        yield from sorted((root / folder).rglob("*.y*ml")) if (root / folder).is_dir() else []


def secrets_with_data(root):
    found = []
    for path in manifest_files(root):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and policy.no_secret_data([doc]):
                found.append(f"{path.relative_to(root)}: Secret {doc.get('metadata', {}).get('name')}")
    return found


def test_no_secret_data_in_any_manifest_file():
    assert secrets_with_data(ROOT) == []


def test_secret_file_is_caught(tmp_path):
    (tmp_path / "base/oss").mkdir(parents=True)
    (tmp_path / "base/oss/secret.yaml").write_text(
        "apiVersion: v1\nkind: Secret\nmetadata: {name: oss-secret}\ndata: {akId: eA==}\n")
    assert secrets_with_data(tmp_path) == ["base/oss/secret.yaml: Secret oss-secret"]


def test_split_is_written_once():
    """The split's numbers live in split.yaml only: every other weight in the component is the
    placeholder 1 that the replacements overwrite."""
    assert split_problems(ROOT) == []
    for path in (ROOT / "components/canary").rglob("*.yaml"):
        if path.name == "split.yaml":
            continue
        weights = re.findall(r"weight:\s*(\S+?)[,}\s]", path.read_text())
        assert set(weights) <= {"1"}, f"{path.name} writes weights {weights}"


def _copy_repo(tmp_path):
    for folder in ("base", "components", "overlays"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    return tmp_path / "components/canary/split.yaml"


def _write_split(split_file, stable, canary):
    text = re.sub(r"stableWeight:.*", f"stableWeight: {stable}", split_file.read_text())
    split_file.write_text(re.sub(r"canaryWeight:.*", f"canaryWeight: {canary}", text))


def test_rendered_weights_follow_the_split():
    """Both ports carry the split written in split.yaml, whatever it is."""
    split = split_weights(ROOT)
    _assert_ports_carry(kustomize(ROOT, "overlays/a10-canary"), split["stableWeight"], split["canaryWeight"])


def test_editing_the_split_moves_both_ports(tmp_path):
    """8080: route weights; 8081: InferenceModelRewrite weights (the picker applies them)."""
    split_file = _copy_repo(tmp_path)
    old = split_weights(tmp_path)
    stable, canary = old["stableWeight"] + 7, old["canaryWeight"] + 13   # a different ratio
    _write_split(split_file, stable, canary)
    _assert_ports_carry(kustomize(tmp_path, "overlays/a10-canary"), stable, canary)


def _assert_ports_carry(result, stable, canary):
    assert result.problems == []
    objs = result.objects
    refs = find(objs, "HTTPRoute", "reasoning-backend")["spec"]["rules"][0]["backendRefs"]
    assert {r["name"]: r["weight"] for r in refs} == {"qwq-dist-v1": stable, "qwq-dist-v2": canary}
    # 8081: one backend with every leader; the picker splits by the rewrite weights.
    assert [r["name"] for r in find(objs, "HTTPRoute", "reasoning-inference")["spec"]["rules"][0]["backendRefs"]] \
        == ["qwq-leaders"]
    targets = find(objs, "InferenceModelRewrite", "qwq")["spec"]["rules"][0]["targets"]
    assert {t["modelRewrite"]: t["weight"] for t in targets} == {"qwq": stable, "qwq-canary": canary}
    assert policy.canary_weights_agree(objs) == []
    assert not [o for o in objs if o["kind"] == "CanarySplit"]   # build-time only


@pytest.mark.parametrize("canary, says", [
    ("twenty", "without quotes"), ('"10"', "without quotes"), ("0", "from 1 to"),
    ("-5", "from 1 to"), ("10.5", "whole number"), ("", "whole number"),
])
def test_a_bad_split_value_is_one_error_naming_the_file_and_field(tmp_path, canary, says):
    split_file = _copy_repo(tmp_path)
    _write_split(split_file, 80, canary)
    result = kustomize(tmp_path, "overlays/a10-canary")
    assert len(result.problems) == 1, result.problems
    text = str(result.problems[0])
    assert "components/canary/split.yaml" in text and "spec.canaryWeight" in text and says in text
    # overlays without the component do not look at the file
    assert kustomize(tmp_path, "overlays/a10").problems == []


def test_base_inference_renders_for_the_local_stack():
    """The local stack feeds `kubectl kustomize base/inference` to the picker in static mode."""
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "base/inference")], capture_output=True, text=True,
                         check=True).stdout
    objs = list(yaml.safe_load_all(out))
    priorities = {o["metadata"]["name"]: o["spec"].get("priority", 0) for o in objs if o["kind"] == "InferenceObjective"}
    assert priorities["interactive"] >= 0 and priorities["batch"] < 0
    assert find(objs, "InferenceModelRewrite", "qwq")["spec"]["rules"][0]["matches"][0]["model"]["value"] == "qwq"
    assert find(objs, "InferencePool", "reasoning-pool")["spec"]["targetPorts"] == [{"number": 8000}]
