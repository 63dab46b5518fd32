"""The versions of the upstream components a cluster runs, read from where they are pinned: the
Argo CD apps that install them (argocd/apps/<app>.yaml, `spec.source.targetRevision`). The
local data plane, the CRDs validation reads and `make tools` take their versions from here, so
that they cannot drift from what a cluster deploys (tests/policy/test_pins.py checks the rest).
Argo CD's own version, which no app installs, is pinned here (ARGO_CD)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


@cache
def chart_version(app: str) -> str:
    """The chart version the Argo CD app `app` installs (its targetRevision)."""
    path = REPO / "argocd" / "apps" / f"{app}.yaml"
    try:
        return str(yaml.safe_load(path.read_text())["spec"]["source"]["targetRevision"])
    except (OSError, KeyError, TypeError) as e:
        raise RuntimeError(f"{path}: no spec.source.targetRevision to read the {app} version from") from e


def envoy_gateway() -> str:
    """Envoy Gateway's release tag, e.g. v1.9.0 (its chart version is the release tag)."""
    return chart_version("envoy-gateway")


# Argo CD itself is installed by hand (docs/deploy.md, "Install Argo CD"), not by an app: its version
# is pinned here, and tests/policy/test_pins.py checks that docs/deploy.md installs this one.
ARGO_CD = "v3.5.1"


def lws() -> str:
    """LeaderWorkerSet's release tag, e.g. v0.10.0 (its chart version has no `v`)."""
    return "v" + chart_version("lws").removeprefix("v")
