"""`python -m validation`: render, validate (schemas, CRDs + CEL, kubeconform), check workflows."""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from validation import cel_rules, gateway, kubeconform, rules, workflows
from validation.builtin import OBJECT_META, BuiltinSchemas
from validation.crdschema import CRDStore
from validation.problems import Problem, describe, format_path
from validation.render import CRDS_KUSTOMIZATION, Rendered, argo_app_sources, discover_targets, render
from validation.render import chart_name

DEFAULT_K8S_VERSION = "1.33.0"   # oldest Kubernetes that Envoy Gateway v1.9 supports
_UNPINNED = re.compile(r"^(HEAD|latest|main|master|\*|)$|[*^~x]")


def default_crds_dir(root: Path) -> Path:
    env = os.environ.get("CRDS_DIR")
    if env:
        return Path(env)
    shared = root.parent / "shared" / "crds"
    return shared if (shared / "README.md").is_file() else root / ".cache" / "crds"


def default_extra_crds_dirs(root: Path) -> list[Path]:
    """CRDs from other sources than base/crds (the Prometheus Operator's: `make crds`)."""
    return [p for p in [root / ".cache" / "crds-extra"] if p.is_dir()]


def parse_args(argv):
    root = Path.cwd()
    p = argparse.ArgumentParser(prog="python -m validation", description=__doc__)
    p.add_argument("targets", nargs="*", help="directories to render (default: every base, overlay, "
                   "Argo CD folder and app path, loadtest)")
    p.add_argument("--root", type=Path, default=root, help="repository root (default: current directory)")
    p.add_argument("--crds-dir", type=Path, default=None, help="pinned CRD copies (default: $CRDS_DIR, "
                   "../shared/crds, .cache/crds)")
    p.add_argument("--extra-crds-dir", type=Path, action="append", default=None,
                   help="another CRD folder, repeatable (default: .cache/crds-extra when it exists)")
    p.add_argument("--kubeconform", type=Path, default=None, help="kubeconform binary (default .tools/bin/kubeconform)")
    p.add_argument("--cache-dir", type=Path, default=None, help="schema cache (default .cache/validation)")
    p.add_argument("--kubernetes-version", default=DEFAULT_K8S_VERSION)
    p.add_argument("--egctl", type=Path, default=None, help="Envoy Gateway's egctl (default .tools/bin/egctl)")
    p.add_argument("--skip-kubeconform", action="store_true")
    p.add_argument("--skip-gateway", action="store_true", help="skip Envoy Gateway's translation")
    p.add_argument("--skip-workflows", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="list rendered targets and CEL statistics")
    args = p.parse_args(argv)
    args.root = args.root.resolve()
    args.crds_dir = (args.crds_dir or default_crds_dir(args.root)).resolve()
    extra = args.extra_crds_dir or default_extra_crds_dirs(args.root)
    args.extra_crds_dir = tuple(p.resolve() for p in extra)
    args.kubeconform = args.kubeconform or args.root / ".tools" / "bin" / "kubeconform"
    args.egctl = args.egctl or args.root / ".tools" / "bin" / "egctl"
    args.cache_dir = args.cache_dir or args.root / ".cache" / "validation"
    return args


def app_path_problems(rendered: Rendered, root: Path) -> tuple[list[Problem], list[str]]:
    """Check Argo CD sources: Helm charts pinned, Git paths present. Returns (problems, paths)."""
    problems, paths = [], []
    for app, src in argo_app_sources(rendered.objects):
        where = f"Application {app}"
        chart = chart_name(src)
        if chart:
            if _UNPINNED.search(str(src.get("targetRevision", ""))):
                problems.append(Problem(rendered.target, f"chart {chart} is not pinned to a version",
                                        where, "spec.source.targetRevision", source="argocd"))
            continue
        path = src.get("path")
        if path is None:
            continue
        clean = Path(path).as_posix().strip("/")
        if not (root / clean).is_dir():
            problems.append(Problem(rendered.target, f"path {path!r} does not exist in the repository",
                                    where, "spec.source.path", source="argocd"))
        elif not (root / clean / "kustomization.yaml").is_file():
            problems.append(Problem(rendered.target, f"path {path!r} has no kustomization.yaml",
                                    where, "spec.source.path", source="argocd"))
        else:
            paths.append(clean)
    return problems, paths


def render_all(args) -> dict[str, Rendered]:
    """Render the targets, then every Git path the rendered Applications point at (repeatedly)."""
    targets = list(dict.fromkeys(args.targets or discover_targets(args.root)))
    results: dict[str, Rendered] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        while targets:
            new = list(pool.map(lambda t: render(args.root, t, args.crds_dir), targets))
            follow = []
            for r in new:
                results[r.target] = r
                problems, paths = app_path_problems(r, args.root)
                r.problems.extend(problems)
                follow.extend(p for p in paths if p not in results and p not in follow and p not in targets)
            targets = [p for p in follow if p not in results]
    return results


def validate_objects(rendered: Rendered, builtin: BuiltinSchemas, crds: CRDStore) -> list[Problem]:
    problems = []
    for obj in rendered.objects:
        name = describe(obj)
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if not isinstance(api_version, str) or not isinstance(kind, str):
            problems.append(Problem(rendered.target, "object has no apiVersion/kind", name))
            continue
        definition = builtin.definition_for(api_version, kind)
        if definition:
            errors = builtin.validator(definition).iter_errors(obj)
        elif crds.has(api_version, kind):
            errors = list(crds.validate(obj))
            meta = obj.get("metadata")
            if not isinstance(meta, dict) or not meta.get("name"):
                problems.append(Problem(rendered.target, "metadata.name is required", name, "metadata"))
            else:
                for err in builtin.validator(OBJECT_META).iter_errors(meta):
                    err.path.appendleft("metadata")
                    errors.append(err)
        else:
            problems.append(Problem(rendered.target, f"no schema for {api_version} {kind} (not a built-in kind "
                                    f"and no CRD for it in the CRD directory)", name))
            continue
        for err in errors:
            problems.append(Problem(rendered.target, err.message, name, format_path(err.absolute_path)))
    return problems


def run_kubeconform(args, results, builtin, crds) -> list[Problem]:
    out_dir = args.cache_dir / "rendered"
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[Path, str] = {}
    objects = []
    for r in results.values():
        if r.problems and not r.objects:
            continue
        objects.extend(r.objects)
        if r.target == CRDS_KUSTOMIZATION:
            files.update({f: r.target for f in r.files})
        elif r.text:
            path = out_dir / (r.target.replace("/", "__") + ".yaml")
            path.write_text(r.text)
            files[path] = r.target
    schema_root = args.cache_dir / "kubeconform-schemas"
    kubeconform.write_schemas(schema_root, objects, builtin, crds)
    names = {(r.target, o.get("kind"), (o.get("metadata") or {}).get("name")): describe(o)
             for r in results.values() for o in r.objects}
    return kubeconform.run(args.kubeconform, files, schema_root, args.kubernetes_version, names)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as side, ThreadPoolExecutor(max_workers=1) as side_gateway:
        wf = None if args.skip_workflows else side.submit(workflows.check, args.root)
        results = render_all(args)
        builtin = BuiltinSchemas(args.kubernetes_version)
        crds = CRDStore(args.crds_dir, args.cache_dir, args.extra_crds_dir)
        problems = [Problem(str(args.crds_dir), msg, source="crds") for msg in crds.problems]
        for r in results.values():
            problems.extend(r.problems)
            problems.extend(validate_objects(r, builtin, crds))
        if not args.skip_gateway:
            gw = side_gateway.submit(gateway.check_all, args.egctl, list(results.values()))
        if not args.skip_kubeconform:
            problems.extend(run_kubeconform(args, results, builtin, crds))
        problems.extend(rules.rule_problems(results.values()))
        if not args.skip_gateway:
            problems.extend(gw.result())
        if wf is not None:
            problems.extend(wf.result())
    for problem in problems:
        print(f"ERROR {problem}")
    n_objects = sum(len(r.objects) for r in results.values())
    if args.verbose:
        for target, r in sorted(results.items()):
            print(f"  rendered {target}: {len(r.objects)} objects")
        print(f"  CEL: {dict(cel_rules.stats)}")
        for rule, why in sorted(cel_rules.skipped.items()):
            print(f"    skipped rule {rule!r}: {why}")
    status = "FAILED" if problems else "OK"
    print(f"validation {status}: {len(results)} targets, {n_objects} objects, {len(problems)} problems, "
          f"CRDs from {args.crds_dir}, {time.monotonic() - started:.1f}s")
    return 1 if problems else 0
