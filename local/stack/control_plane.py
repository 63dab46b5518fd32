"""The API server of the stack's picker replicas (only with `pickers` > 1): etcd and the project's
kube-apiserver (`make tools` builds it; tests/apiserver runs the same) on loopback, holding the
Lease the replicas compete for. The replicas reach it with a token of the picker's ServiceAccount,
bound to exactly the Role and RoleBinding of the rendered overlay (base/picker/rbac.yaml), so the
Lease rules are tested as deployed.

`procs` lists the two processes (the launcher starts them first and waits until both are healthy);
`bootstrap` then creates the namespace and the picker's RBAC objects, and writes the kubeconfig
the replicas read (KUBECONFIG)."""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from local.stack.config import REPO, StackConfig, StackError
from local.stack.processes import Proc, free_ports
from validation import manifests
from validation.apiserver import apiserver_argv, etcd_argv

KUBE_APISERVER = REPO / ".tools" / "bin" / "kube-apiserver"
PICKER_ACCOUNT = "inference-gateway-ext-proc"   # base/picker's ServiceAccount
KUBECONFIG = "picker-kubeconfig.json"
TOKEN_SECONDS = 24 * 3600


@dataclass(frozen=True)
class ControlPlaneLayout:
    root: Path
    etcd_port: int
    etcd_peer_port: int
    port: int

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.root / "certs" / "apiserver.crt"   # kube-apiserver's self-signed certificate

    @property
    def admin_token_file(self) -> Path:
        return self.root / "admin-token"


def layout(config: StackConfig) -> ControlPlaneLayout:
    etcd, peer, port = free_ports(3, config.host)
    return ControlPlaneLayout(config.run_dir / "apiserver", etcd, peer, port)


def procs(config: StackConfig, cp: ControlPlaneLayout) -> list[Proc]:
    if not KUBE_APISERVER.is_file():
        raise StackError(f"{KUBE_APISERVER} is missing: `make tools` builds it (several minutes the "
                         "first time); the picker replicas' Lease lives on it")
    etcd = shutil.which("etcd")
    if etcd is None:
        raise StackError("etcd is not on PATH: `make tools` installs Debian's etcd-server")
    cp.root.mkdir(parents=True, exist_ok=True)
    admin = secrets.token_hex(16)
    cp.admin_token_file.write_text(admin)
    cp.admin_token_file.chmod(0o600)
    etcd_url = f"http://127.0.0.1:{cp.etcd_port}"
    return [Proc("etcd", etcd_argv(etcd, cp.root / "etcd", cp.etcd_port, cp.etcd_peer_port),
                 str(config.run_dir / "etcd.log"), f"http:{etcd_url}/health"),
            Proc("kube-apiserver", apiserver_argv(KUBE_APISERVER, cp.root, etcd_url, cp.port, admin),
                 str(config.run_dir / "kube-apiserver.log"),
                 f"https-anonymous:{cp.url}/readyz#{cp.ca_file}")]


def picker_rbac(docs: list[dict]) -> list[dict]:
    """The picker's ServiceAccount, and every Role and RoleBinding bound to it, as rendered."""
    account = next((d for d in manifests.of_kind(docs, "ServiceAccount")
                    if manifests.name_of(d) == PICKER_ACCOUNT), None)
    if account is None:
        raise StackError(f"the rendered manifests have no ServiceAccount {PICKER_ACCOUNT}")
    bindings = [b for b in manifests.of_kind(docs, "RoleBinding")
                if any(s.get("kind") == "ServiceAccount" and s.get("name") == PICKER_ACCOUNT
                       for s in b.get("subjects") or [])]
    roles = {(b.get("roleRef") or {}).get("name") for b in bindings}
    return [account, *[r for r in manifests.of_kind(docs, "Role") if manifests.name_of(r) in roles],
            *bindings]


def bootstrap(config: StackConfig, cp: ControlPlaneLayout, docs: list[dict]) -> tuple[Path, str]:
    """The namespace and the picker's RBAC objects on the API server; returns the replicas'
    kubeconfig and the namespace of their Lease."""
    from kubernetes import client

    from validation.apiserver import ServerSideApply, ensure_namespaces
    rbac = picker_rbac(docs)
    namespace = manifests.ns_of(rbac[0]) or "default"
    api = _client(cp, cp.admin_token_file.read_text())
    ensure_namespaces(api, [namespace])
    apply = ServerSideApply(api)
    for obj in rbac:
        apply.apply(obj, dry_run=False, namespace=namespace)
    review = client.CoreV1Api(api).create_namespaced_service_account_token(
        PICKER_ACCOUNT, namespace, {"spec": {"expirationSeconds": TOKEN_SECONDS}})
    path = config.run_dir / KUBECONFIG
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "stack",
        "clusters": [{"name": "stack", "cluster": {"server": cp.url,
                                                   "certificate-authority": str(cp.ca_file)}}],
        "users": [{"name": "picker", "user": {"token": review.status.token}}],
        "contexts": [{"name": "stack", "context": {"cluster": "stack", "user": "picker",
                                                   "namespace": namespace}}]}))
    path.chmod(0o600)
    return path, namespace


def _client(cp: ControlPlaneLayout, token: str):
    from kubernetes import client
    configuration = client.Configuration()
    configuration.host = cp.url
    configuration.ssl_ca_cert = str(cp.ca_file)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(configuration)


def read_lease(config: StackConfig, name: str = "reasoning-pool-picker") -> dict | None:
    """The replicas' Lease as the API server holds it (holder, transitions), for tests and the
    failover bench; None if it does not exist yet."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    root = config.run_dir / "apiserver"
    kubeconfig = json.loads((config.run_dir / KUBECONFIG).read_text())
    url = kubeconfig["clusters"][0]["cluster"]["server"]
    cp = ControlPlaneLayout(root, 0, 0, int(url.rsplit(":", 1)[1]))
    namespace = kubeconfig["contexts"][0]["context"]["namespace"]
    try:
        lease = client.CoordinationV1Api(_client(cp, cp.admin_token_file.read_text())) \
            .read_namespaced_lease(name, namespace, _request_timeout=2)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return {"holder": lease.spec.holder_identity, "transitions": lease.spec.lease_transitions or 0}
