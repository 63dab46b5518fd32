"""`python -m validation.crds --dest DIR`: download the pinned upstream CRDs for offline validation.

The layout matches the shared test copies (`<project>-<tag>/<file>`), so CRDS_DIR can point at
either. base/crds/kustomization.yaml lists a subset of these URLs (tests/policy checks that).

`python -m validation.crds --go-modules --dest DIR` fetches the second source: CRDs that no
kustomization here installs (the Prometheus Operator's, for components/monitoring: the operator
comes with the cluster's monitoring stack; KEDA's ScaledObject, for components/autoscaling) but
that ship inside a pinned Go module, which the Go module proxy serves. They land in `DIR/<folder>/` the same way.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

from validation import pins

RAW = "https://raw.githubusercontent.com"
# Envoy Gateway's and LWS's versions are those of their Argo CD apps (validation/pins.py).
EG = f"{RAW}/envoyproxy/gateway/{pins.envoy_gateway()}/charts/gateway-helm/charts/crds/crds"
EG_KINDS = ["backends", "backendtrafficpolicies", "clienttrafficpolicies", "envoyextensionpolicies",
            "envoypatchpolicies", "envoyproxies", "httproutefilters", "securitypolicies"]

PINNED: dict[str, list[str]] = {
    f"argo-cd-{pins.ARGO_CD}": [f"{RAW}/argoproj/argo-cd/{pins.ARGO_CD}/manifests/crds/{name}-crd.yaml"
                                for name in ("application", "applicationset", "appproject")],
    f"envoy-gateway-{pins.envoy_gateway()}": [f"{EG}/gatewayapi-crds.yaml"]
    + [f"{EG}/generated/gateway.envoyproxy.io_{kind}.yaml" for kind in EG_KINDS],
    "gateway-api-inference-extension-v1.6.0": [
        f"{RAW}/kubernetes-sigs/gateway-api-inference-extension/v1.6.0/config/crd/bases/"
        "inference.networking.k8s.io_inferencepools.yaml"],
    "llm-d-router-v0.10.0": [f"{RAW}/llm-d/llm-d-router/v0.10.0/config/crd/bases/llm-d.ai_{kind}.yaml"
                             for kind in ("inferenceobjectives", "inferencemodelrewrites")],
    f"lws-{pins.lws()}": [f"{RAW}/kubernetes-sigs/lws/{pins.lws()}/config/crd/bases/"
                          "leaderworkerset.x-k8s.io_leaderworkersets.yaml"],
}


# folder -> (Go module, version, CRD files inside the module). Only the kinds the repo uses: the
# operator's AlertmanagerConfig CRD has a bare `=` enum value that PyYAML cannot load.
PROM_OPERATOR_CRDS = "example/prometheus-operator-crd/monitoring.coreos.com_{}.yaml"
GO_MODULE_CRDS: dict[str, tuple[str, str, list[str]]] = {
    "prometheus-operator-v0.85.0": ("github.com/prometheus-operator/prometheus-operator", "v0.85.0",
                                    [PROM_OPERATOR_CRDS.format(kind) for kind in
                                     ("podmonitors", "servicemonitors", "prometheusrules")]),
    # KEDA's ScaledObject, for components/autoscaling (KEDA itself is installed with the cluster).
    "keda-v2.20.2": ("github.com/kedacore/keda/v2", "v2.20.2",
                     ["config/crd/bases/keda.sh_scaledobjects.yaml"]),
}


def all_urls() -> list[str]:
    return [url for urls in PINNED.values() for url in urls]


def download(dest: Path, force: bool = False) -> int:
    failures = 0
    for folder, urls in PINNED.items():
        for url in urls:
            target = dest / folder / url.rsplit("/", 1)[-1]
            if target.is_file() and not force:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with urllib.request.urlopen(url, timeout=60) as response:
                    data = response.read()
            except OSError as err:
                print(f"ERROR {url}: {err}", file=sys.stderr)
                failures += 1
                continue
            tmp = target.with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(target)
            print(f"{target} ({len(data)} bytes)")
    return failures


def download_go_modules(dest: Path) -> int:
    """Copy each pinned module's CRD files into dest/<folder> (`go mod download` fetches the zip)."""
    failures = 0
    for folder, (module, version, paths) in GO_MODULE_CRDS.items():
        target = dest / folder
        if target.is_dir() and any(target.glob("*.yaml")):
            continue
        proc = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"],
                              capture_output=True, text=True)
        info = json.loads(proc.stdout or "{}")
        if proc.returncode != 0 or "Dir" not in info:
            print(f"ERROR {module}@{version}: {info.get('Error') or proc.stderr.strip()}", file=sys.stderr)
            failures += 1
            continue
        files = [Path(info["Dir"]) / path for path in paths]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            print(f"ERROR {module}@{version} has no {', '.join(missing)}", file=sys.stderr)
            failures += 1
            continue
        tmp = target.with_name(target.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        print(f"{target} ({len(files)} CRD files from {module}@{version})")
    return failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.crds", description=__doc__)
    p.add_argument("--dest", type=Path, default=Path(".cache/crds"))
    p.add_argument("--force", action="store_true", help="download again even if a file exists")
    p.add_argument("--go-modules", action="store_true",
                   help="fetch the CRDs shipped in pinned Go modules (GO_MODULE_CRDS) instead")
    args = p.parse_args(argv)
    if args.go_modules:
        return 1 if download_go_modules(args.dest) else 0
    return 1 if download(args.dest, args.force) else 0


if __name__ == "__main__":
    sys.exit(main())
