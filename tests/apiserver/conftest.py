"""A real control plane for the tests: etcd + the upstream kube-apiserver on free loopback ports
(built by `make tools` into .tools/bin; etcd from Debian's etcd-server), RBAC authorization, the
pinned CRDs installed. One per test session; stopped at the end."""
from __future__ import annotations

import itertools
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.kube import ETCD, KUBE_APISERVER, ROOT, wait_until  # noqa: F401 (the tests' imports)
from validation.apiserver import ControlPlane, install_crds
from validation.cli import default_crds_dir, default_extra_crds_dirs

_namespaces = itertools.count()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    if not KUBE_APISERVER.is_file():
        pytest.fail(f"{KUBE_APISERVER} is missing: `make tools` builds it (tools/kube-apiserver)")
    if shutil.which(ETCD) is None:
        pytest.fail(f"{ETCD} is not on PATH: `make tools` installs Debian's etcd-server")
    plane = ControlPlane(tmp_path_factory.mktemp("apiserver"), KUBE_APISERVER, ETCD)
    plane.start()
    try:
        crds_dir = Path(os.environ["CRDS_DIR"]) if os.environ.get("CRDS_DIR") else default_crds_dir(ROOT)
        started = time.monotonic()
        plane.crds = install_crds(plane.api_client(), crds_dir.resolve())
        for extra in default_extra_crds_dirs(ROOT):
            plane.crds += install_crds(plane.api_client(), extra.resolve())
        plane.crds_installed_in = time.monotonic() - started
        print(f"\nkube-apiserver ready in {plane.started_in:.1f}s, {len(plane.crds)} CRDs installed in "
              f"{plane.crds_installed_in:.1f}s")
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def admin(control_plane):
    return control_plane.api_client()


@pytest.fixture
def namespace(control_plane, admin):
    """A fresh namespace with its `default` ServiceAccount (the controller that makes it does not
    run here, and the ServiceAccount admission plugin requires it for pods)."""
    from kubernetes import client
    name = f"test-{next(_namespaces)}"
    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "default"}})
    return name
