"""Render kustomizations with `kubectl kustomize` and parse their output into objects."""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from validation.canary import includes_canary, split_problems
from validation.problems import Problem

try:  # the C loader is ~10x faster on the multi-MB CRD files
    _Loader = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML without libyaml
    _Loader = yaml.SafeLoader

CRDS_KUSTOMIZATION = "base/crds"


@dataclass
class Rendered:
    target: str                       # repo-relative directory, e.g. overlays/a10
    objects: list = field(default_factory=list)
    text: str = ""                    # kustomize output (YAML stream)
    problems: list = field(default_factory=list)
    files: list = field(default_factory=list)  # source files when not rendered by kustomize


def load_yaml_stream(text: str, where: str) -> tuple[list, list]:
    """Parse a YAML stream; a syntax error becomes a Problem naming `where` and the line."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        reason = getattr(err, "problem", None) or str(err)
        return [], [Problem(where, f"invalid YAML{line}: {reason}", source="yaml")]
    problems = [Problem(where, f"document {i} is not a mapping", source="yaml")
                for i, d in enumerate(docs) if not isinstance(d, dict)]
    return [d for d in docs if isinstance(d, dict)], problems


def load_yaml_file(path: Path, where: str | None = None) -> tuple[list, list]:
    where = where or str(path)
    try:
        text = path.read_text()
    except OSError as err:
        return [], [Problem(where, f"cannot read {path}: {err.strerror}", source="yaml")]
    return load_yaml_stream(text, where)


_KLOG_PREFIX = re.compile(r'^E\d{4} [\d:.]+\s+\d+ \S+\] "command failed" err=')


def _kustomize_reason(stderr: str) -> str:
    """kubectl's error line, without the klog prefix and quoting."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    if not lines:
        return "kubectl kustomize failed without a message"
    reason = lines[-1]
    m = _KLOG_PREFIX.match(reason)
    if m:
        reason = reason[m.end():].strip('"').replace('\\"', '"').replace("\\'", "'")
    return reason.removeprefix("error: ")


def kustomize(root: Path, target: str) -> Rendered:
    """`kubectl kustomize <target>`; failures become a Problem with kustomize's reason."""
    result = Rendered(target)
    directory = root / target
    if not (directory / "kustomization.yaml").is_file() and not (directory / "kustomization.yml").is_file():
        result.problems.append(Problem(target, "no kustomization.yaml in this directory", source="kustomize"))
        return result
    if includes_canary(root, target):
        # checked first: kustomize's own error for a bad weight does not name the file
        result.problems.extend(split_problems(root))
        if result.problems:
            return result
    try:
        proc = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True,
                              timeout=120)
    except FileNotFoundError:
        result.problems.append(Problem(target, "kubectl not found on PATH (prerequisite)", source="kustomize"))
        return result
    if proc.returncode != 0:
        result.problems.append(Problem(target, _kustomize_reason(proc.stderr), source="kustomize"))
        return result
    result.text = proc.stdout
    result.objects, problems = load_yaml_stream(proc.stdout, target)
    result.problems.extend(problems)
    return result


def find_crd_copy(crds_dir: Path, url: str) -> Path | None:
    """The file in the CRD directory with the URL's file name (the offline copy of that URL)."""
    name = url.rstrip("/").rsplit("/", 1)[-1]
    matches = sorted(crds_dir.rglob(name))
    return matches[0] if matches else None


def render_crds(root: Path, target: str, crds_dir: Path) -> Rendered:
    """base/crds lists pinned upstream URLs; offline, each maps to its copy in the CRD directory."""
    result = Rendered(target)
    kfile = root / target / "kustomization.yaml"
    docs, problems = load_yaml_file(kfile, f"{target}/kustomization.yaml")
    result.problems.extend(problems)
    if not docs:
        return result
    resources = docs[0].get("resources") or []
    if not resources:
        result.problems.append(Problem(target, "kustomization lists no resources", source="crds"))
    for url in resources:
        if not re.match(r"^https://", str(url)):
            result.problems.append(Problem(target, f"resource {url!r} is not a pinned https URL", source="crds"))
            continue
        if not re.search(r"/v\d+\.\d+\.\d+[^/]*/", url):
            result.problems.append(Problem(target, f"URL {url} is not pinned to a release tag", source="crds"))
        copy = find_crd_copy(crds_dir, url)
        if copy is None:
            result.problems.append(Problem(target, f"no copy of {url} in {crds_dir}", source="crds"))
            continue
        objects, problems = load_yaml_file(copy)
        result.objects.extend(objects)
        result.problems.extend(problems)
        result.files.append(copy)
    return result


def render(root: Path, target: str, crds_dir: Path) -> Rendered:
    if target == CRDS_KUSTOMIZATION:
        return render_crds(root, target, crds_dir)
    return kustomize(root, target)


def discover_targets(root: Path) -> list[str]:
    """Every directory that is deployed or rendered on its own: bases, overlays, Argo CD folders,
    and the in-cluster load test when it exists. Components are rendered through overlays."""
    targets = []
    for parent in ("base", "overlays", "argocd"):
        for kfile in sorted((root / parent).glob("*/kustomization.yaml")):
            targets.append(kfile.parent.relative_to(root).as_posix())
    if (root / "loadtest/kustomization.yaml").is_file():
        targets.append("loadtest")
    return targets


def chart_name(source: dict) -> str | None:
    """The Helm chart an Argo CD source fetches from a chart repository or OCI registry
    (`chart`, or the last segment of an `oci://` repoURL), None for a Git source."""
    if source.get("chart"):
        return str(source["chart"])
    url = str(source.get("repoURL", ""))
    return url.rstrip("/").rsplit("/", 1)[-1] if url.startswith("oci://") else None


def argo_app_sources(objects: list) -> list[tuple[str, dict]]:
    """(app name, source) for every source of every Argo CD Application in `objects`."""
    out = []
    for obj in objects:
        if obj.get("kind") != "Application" or not str(obj.get("apiVersion", "")).startswith("argoproj.io/"):
            continue
        spec = obj.get("spec") or {}
        sources = spec.get("sources") or ([spec["source"]] if spec.get("source") else [])
        for src in sources:
            out.append(((obj.get("metadata") or {}).get("name", "?"), src))
    return out
