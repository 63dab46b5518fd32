"""Repository-level rules: no Secret data in git; the canary split is written once and propagates."""
from __future__ import annotations

import shutil
import subprocess

import yaml

from validation import policy
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
    """The numbers 90/10 appear in the canary component only in split.yaml."""
    texts = {p.name: p.read_text() for p in (ROOT / "components/canary").rglob("*.yaml")}
    split = yaml.safe_load(texts.pop("split.yaml"))["spec"]
    assert split == {"stableWeight": 90, "canaryWeight": 10}
    for name, text in texts.items():
        assert "weight: 90" not in text and "weight: 10" not in text, name


def test_editing_the_split_moves_both_ports(tmp_path):
    """8080: route weights; 8081: InferenceModelRewrite weights (the picker applies them)."""
    for folder in ("base", "components", "overlays"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    split = tmp_path / "components/canary/split.yaml"
    split.write_text(split.read_text().replace("stableWeight: 90", "stableWeight: 70")
                     .replace("canaryWeight: 10", "canaryWeight: 30"))
    result = kustomize(tmp_path, "overlays/a10-canary")
    assert result.problems == []
    objs = result.objects
    refs = find(objs, "HTTPRoute", "reasoning-backend")["spec"]["rules"][0]["backendRefs"]
    assert {r["name"]: r["weight"] for r in refs} == {"qwq-dist-v1": 70, "qwq-dist-v2": 30}
    # 8081: one backend with every leader; the picker splits by the rewrite weights.
    assert [r["name"] for r in find(objs, "HTTPRoute", "reasoning-inference")["spec"]["rules"][0]["backendRefs"]] \
        == ["qwq-leaders"]
    targets = find(objs, "InferenceModelRewrite", "qwq")["spec"]["rules"][0]["targets"]
    assert {t["modelRewrite"]: t["weight"] for t in targets} == {"qwq": 70, "qwq-canary": 30}
    assert policy.canary_weights_agree(objs) == []
    assert not [o for o in objs if o["kind"] == "CanarySplit"]   # build-time only


def test_base_inference_renders_for_the_local_stack():
    """The local stack feeds `kubectl kustomize base/inference` to the picker in static mode."""
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "base/inference")], capture_output=True, text=True,
                         check=True).stdout
    objs = list(yaml.safe_load_all(out))
    priorities = {o["metadata"]["name"]: o["spec"].get("priority", 0) for o in objs if o["kind"] == "InferenceObjective"}
    assert priorities["interactive"] >= 0 and priorities["batch"] < 0
    assert find(objs, "InferenceModelRewrite", "qwq")["spec"]["rules"][0]["matches"][0]["model"]["value"] == "qwq"
    assert find(objs, "InferencePool", "reasoning-pool")["spec"]["targetPorts"] == [{"number": 8000}]
