"""One pin per upstream version: the Argo CD apps pin what a cluster runs (validation/pins.py reads
them); the local data plane, the tools `make tools` builds and the CRDs validation reads must be
those versions."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from local import dataplane
from tests.policy.conftest import ROOT, rendered
from validation import crds, pins
from validation.render import argo_app_sources, chart_name

CHARTS = {"oci://registry-1.docker.io/envoyproxy/gateway-helm": "envoy-gateway",
          "oci://registry.k8s.io/lws/charts/lws": "lws"}


def test_the_chart_apps_are_where_the_pins_are_read():
    apps = [o for o in rendered("argocd/apps") if o["kind"] == "Application"]
    charts = {s["repoURL"]: (app, s["targetRevision"]) for app, s in argo_app_sources(apps) if chart_name(s)}
    assert charts == {url: (app, pins.chart_version(app)) for url, app in CHARTS.items()}


def test_the_local_data_plane_and_make_tools_run_the_argo_cd_apps_envoy_gateway():
    assert dataplane.EG_VERSION == pins.envoy_gateway()
    make = subprocess.run(["make", "--no-print-directory", "-s", "--eval", "print-eg: ; @echo $(EG_VERSION)",
                           "print-eg"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert make.stdout.split()[-1] == pins.envoy_gateway()


def test_the_crds_validation_reads_are_the_pinned_releases():
    for project, tag in (("envoy-gateway", pins.envoy_gateway()), ("lws", pins.lws()), ("argo-cd", pins.ARGO_CD)):
        (folder,) = [f for f in crds.PINNED if f.startswith(f"{project}-")]
        assert folder == f"{project}-{tag}"
        assert all(f"/{tag}/" in url for url in crds.PINNED[folder]), folder


def test_the_built_envoy_gateway_is_the_pinned_one_and_runs_the_pinned_envoy():
    binary = ROOT / ".tools" / "bin" / "envoy-gateway"
    if not binary.is_file() or not shutil.which("go"):
        pytest.skip("Envoy Gateway not built (make tools) or no Go toolchain to read its module version")
    info = subprocess.run(["go", "version", "-m", str(binary)], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"^\s*mod\s+github.com/envoyproxy/gateway\s+{re.escape(pins.envoy_gateway())}\s", info, re.M), \
        f"{binary} is not Envoy Gateway {pins.envoy_gateway()}: rebuild it with `make tools`"
    version = subprocess.run([str(binary), "version"], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"ENVOY_PROXY_VERSION: \S*v{re.escape(dataplane.ENVOY_VERSION)}$", version, re.M), version


def test_the_deploy_doc_installs_the_pinned_argo_cd():
    readme = (ROOT / "docs" / "deploy.md").read_text()
    installed = set(re.findall(r"argoproj/argo-cd/(v[\d.]+)/manifests/install", readme))
    assert installed == {pins.ARGO_CD}
