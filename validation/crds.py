"""`python -m validation.crds --dest DIR`: download the pinned upstream CRDs for offline validation.

The layout matches the shared test copies (`<project>-<tag>/<file>`), so CRDS_DIR can point at
either. base/crds/kustomization.yaml lists a subset of these URLs (tests/policy checks that).
"""
from __future__ import annotations

import argparse
import sys
import urllib.request
from pathlib import Path

RAW = "https://raw.githubusercontent.com"
EG = f"{RAW}/envoyproxy/gateway/v1.9.0/charts/gateway-helm/charts/crds/crds"
EG_KINDS = ["backends", "backendtrafficpolicies", "clienttrafficpolicies", "envoyextensionpolicies",
            "envoypatchpolicies", "envoyproxies", "httproutefilters", "securitypolicies"]

PINNED: dict[str, list[str]] = {
    "argo-cd-v3.5.1": [f"{RAW}/argoproj/argo-cd/v3.5.1/manifests/crds/{name}-crd.yaml"
                       for name in ("application", "applicationset", "appproject")],
    "envoy-gateway-v1.9.0": [f"{EG}/gatewayapi-crds.yaml"]
    + [f"{EG}/generated/gateway.envoyproxy.io_{kind}.yaml" for kind in EG_KINDS],
    "gateway-api-inference-extension-v1.6.0": [
        f"{RAW}/kubernetes-sigs/gateway-api-inference-extension/v1.6.0/config/crd/bases/"
        "inference.networking.k8s.io_inferencepools.yaml"],
    "llm-d-router-v0.10.0": [f"{RAW}/llm-d/llm-d-router/v0.10.0/config/crd/bases/llm-d.ai_{kind}.yaml"
                             for kind in ("inferenceobjectives", "inferencemodelrewrites")],
    "lws-v0.10.0": [f"{RAW}/kubernetes-sigs/lws/v0.10.0/config/crd/bases/"
                    "leaderworkerset.x-k8s.io_leaderworkersets.yaml"],
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.crds", description=__doc__)
    p.add_argument("--dest", type=Path, default=Path(".cache/crds"))
    p.add_argument("--force", action="store_true", help="download again even if a file exists")
    args = p.parse_args(argv)
    return 1 if download(args.dest, args.force) else 0


if __name__ == "__main__":
    sys.exit(main())
