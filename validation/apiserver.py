"""A real Kubernetes API server for tests: etcd and the upstream kube-apiserver on 127.0.0.1,
and server-side dry-run of every render target against it.

`python -m validation.apiserver` starts both, installs the pinned CRDs, applies every target
with `dryRun=All` server-side apply (as Argo CD's ServerSideApply sync would, without persisting)
and prints each rejection by target, object and field. There is no kubelet, scheduler or
controller: objects are stored and validated, nothing runs them.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from validation.problems import Problem, describe
from validation.render import Rendered, load_yaml_file

FIELD_MANAGER = "qwq-serving"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


class ControlPlaneError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(check, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise ControlPlaneError(f"{what} exited with {proc.returncode}:\n{tail}")
        if check():
            return
        time.sleep(0.1)
    raise ControlPlaneError(f"{what} not ready after {timeout:.0f}s (log: {log})")


def _http_ok(url: str, token: str | None = None, context=None) -> bool:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _service_account_key(path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def etcd_argv(etcd: str, data: Path, client_port: int, peer_port: int) -> list[str]:
    """A single-member etcd on 127.0.0.1 with a fresh data directory."""
    shutil.rmtree(data, ignore_errors=True)
    url = f"http://127.0.0.1:{client_port}"
    return [etcd, "--name", "test", "--data-dir", str(data),
            "--listen-client-urls", url, "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}", "--log-level", "warn"]


def apiserver_argv(binary: Path, workdir: Path, etcd_url: str, port: int, admin_token: str,
                   authorization_mode: str = "RBAC", service_cidr: str = "10.96.0.0/16",
                   extra_args: tuple = ()) -> list[str]:
    """kube-apiserver on 127.0.0.1:port over etcd_url; writes its token file (admin_token in
    system:masters) and service-account key into workdir; its certificate lands in
    workdir/certs (ControlPlane.ca_file)."""
    (workdir / "tokens.csv").write_text(f'{admin_token},admin,admin,"system:masters"\n')
    sa_key = workdir / "sa.key"
    if not sa_key.exists():
        _service_account_key(sa_key)
    return [str(binary), f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={workdir / 'certs'}", f"--token-auth-file={workdir / 'tokens.csv'}",
            f"--authorization-mode={authorization_mode}",
            f"--service-account-issuer={SA_ISSUER}", f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}", f"--service-cluster-ip-range={service_cidr}",
            # Watches are served straight from etcd, so compacting etcd makes an old
            # resourceVersion answer 410 Gone (a production server's watch cache does the same
            # after a restart or a long disconnect).
            "--watch-cache=false", "--enable-priority-and-fairness=false", "--profiling=false",
            *extra_args]


@dataclass
class ControlPlane:
    """etcd + kube-apiserver in `workdir`; `admin_token` is in group system:masters."""
    workdir: Path
    kube_apiserver: Path
    etcd: str = "etcd"
    authorization_mode: str = "RBAC"
    # Service ClusterIPs come from here. tests/apiserver/test_hpa.py uses a loopback range, so the
    # aggregator (routing to the ClusterIP) reaches an extension API server on this machine.
    service_cidr: str = "10.96.0.0/16"
    extra_args: tuple = ()
    url: str = ""
    etcd_url: str = ""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    started_in: float = 0.0
    processes: list = field(default_factory=list)

    @property
    def ca_file(self) -> Path:
        # kube-apiserver writes its self-signed serving certificate (with its CA) here.
        return self.workdir / "certs" / "apiserver.crt"

    def start(self, timeout: float = 60.0) -> "ControlPlane":
        started = time.monotonic()
        for attempt in range(3):   # a free port may be taken between probing and binding
            try:
                self._start_etcd(timeout)
                self._start_apiserver(timeout)
                break
            except ControlPlaneError:
                self.stop()
                if attempt == 2:
                    raise
        self.started_in = time.monotonic() - started
        return self

    def _spawn(self, name: str, argv: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / f"{name}.log"
        proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes.append(proc)
        return proc, log

    def _start_etcd(self, timeout: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc, log = self._spawn("etcd", etcd_argv(self.etcd, self.workdir / "etcd", client, peer))
        _wait(lambda: _http_ok(f"{self.etcd_url}/health"), timeout, "etcd", proc, log)

    def _start_apiserver(self, timeout: float) -> None:
        import ssl
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        proc, log = self._spawn("kube-apiserver", apiserver_argv(
            self.kube_apiserver, self.workdir, self.etcd_url, port, self.admin_token,
            self.authorization_mode, self.service_cidr, self.extra_args))
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        _wait(lambda: _http_ok(f"{self.url}/readyz", self.admin_token, insecure), timeout,
              "kube-apiserver", proc, log)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()

    # ---- clients -------------------------------------------------------------------------

    def kubeconfig(self, path: Path, token: str | None = None, namespace: str = "default") -> Path:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "test", "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                      "namespace": namespace}}]}))
        return path

    def api_client(self, token: str | None = None):
        from kubernetes import client
        config = client.Configuration()
        config.host = self.url
        config.ssl_ca_cert = str(self.ca_file)
        config.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return client.ApiClient(config)

    def etcd_revision(self) -> int:
        reply = self._etcd("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})
        return int(reply["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision; returns that revision."""
        revision = self.etcd_revision()
        self._etcd("/v3/kv/compaction", {"revision": revision, "physical": True})
        return revision

    def _etcd(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.etcd_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())


# ---- server-side dry-run ---------------------------------------------------------------------

def _status_problems(target: str, obj: dict, exc) -> list[Problem]:
    """A rejected request's Status as problems: one per cause (with its field), else the message."""
    try:
        status = json.loads(exc.body)
    except (TypeError, ValueError):
        status = {"message": str(getattr(exc, "body", None) or exc)}
    causes = (status.get("details") or {}).get("causes") or []
    reason = status.get("reason") or getattr(exc, "reason", "") or ""
    if not causes:
        return [Problem(target, f"{reason}: {status.get('message')}", describe(obj), source="apiserver")]
    return [Problem(target, f"{reason}: {c.get('message')}", describe(obj), c.get("field", ""),
                    source="apiserver") for c in causes]


class ServerSideApply:
    """Server-side apply through the dynamic client (discovery is cached per instance)."""

    def __init__(self, api_client):
        from kubernetes.dynamic import DynamicClient
        self.dynamic = DynamicClient(api_client)

    def resource(self, obj: dict):
        return self.dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])

    def apply(self, obj: dict, dry_run: bool, namespace: str = "default"):
        resource = self.resource(obj)
        ns = ((obj.get("metadata") or {}).get("namespace") or namespace) if resource.namespaced else None
        return self.dynamic.server_side_apply(resource, body=obj, namespace=ns, field_manager=FIELD_MANAGER,
                                              force_conflicts=True, dry_run="All" if dry_run else None)

    def dry_run(self, rendered: Rendered) -> list[Problem]:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError
        problems = []
        for obj in rendered.objects:
            try:
                self.apply(obj, dry_run=True)
            except ResourceNotFoundError:
                problems.append(Problem(rendered.target, f"the API server serves no {obj.get('apiVersion')} "
                                        f"{obj.get('kind')} (built-in or from the CRD directory)",
                                        describe(obj), source="apiserver"))
            except (DynamicApiError, ApiException) as exc:
                problems.extend(_status_problems(rendered.target, obj, exc))
        return problems


def install_crds(api_client, crds_dir: Path, timeout: float = 120.0) -> list[str]:
    """Create every CRD in the CRD directory and wait until the server serves each of them."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    crds = []
    for path in sorted(crds_dir.rglob("*.yaml")):
        objects, problems = load_yaml_file(path)
        if problems:
            raise ControlPlaneError("; ".join(str(p) for p in problems))
        crds.extend(obj for obj in objects if obj.get("kind") == "CustomResourceDefinition")
    if not crds:
        raise ControlPlaneError(f"no CustomResourceDefinition in {crds_dir}")
    # A plain create, four at a time: each large CRD keeps the server busy for a while (schema and
    # CEL checks), and server-side apply of a 1 MB CRD costs it several times more.
    ext = client.ApiextensionsV1Api(api_client)
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(ext.create_custom_resource_definition, crds))
    # Served = Established; an empty list request is cheap, reading the CRD back is not.
    custom = client.CustomObjectsApi(api_client)
    end = time.monotonic() + timeout
    for crd in crds:
        spec = crd["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("served"))
        while True:
            try:
                custom.list_cluster_custom_object(spec["group"], version, spec["names"]["plural"], limit=1)
                break
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > end:
                    raise ControlPlaneError(f"CRD {crd['metadata']['name']} not served after {timeout:.0f}s: "
                                            f"{exc.status} {exc.reason}") from exc
                time.sleep(0.1)
    return [crd["metadata"]["name"] for crd in crds]


def ensure_namespaces(api_client, names) -> None:
    """Create the namespaces (Argo CD's CreateNamespace=true does this before a sync)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException
    core = client.CoreV1Api(api_client)
    for name in sorted(set(names)):
        try:
            core.create_namespace({"metadata": {"name": name}})
        except ApiException as exc:
            if exc.status != 409:
                raise


def namespaces_of(results) -> set[str]:
    out = set()
    for r in results:
        for obj in r.objects:
            meta = obj.get("metadata") or {}
            out.add(meta.get("namespace") or "default")
            if obj.get("kind") == "Namespace" and meta.get("name"):
                out.add(meta["name"])
    return out


def render_targets(root: Path, crds_dir: Path, targets: list[str] | None = None) -> dict[str, Rendered]:
    """Every render target, as `make validate` renders them."""
    from validation.cli import render_all
    return render_all(SimpleNamespace(root=root, crds_dir=crds_dir, targets=targets or []))


def dry_run_all(api_client, results: dict[str, Rendered]) -> list[Problem]:
    problems = []
    for r in results.values():
        problems.extend(r.problems)
    ensure_namespaces(api_client, namespaces_of(results.values()))
    sa = ServerSideApply(api_client)
    for target in sorted(results):
        problems.extend(sa.dry_run(results[target]))
    return problems


def main(argv=None) -> int:
    from validation.cli import default_crds_dir, default_extra_crds_dirs
    root = Path.cwd()
    p = argparse.ArgumentParser(prog="python -m validation.apiserver", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="*", help="directories to render (default: every target)")
    p.add_argument("--crds-dir", type=Path, default=None)
    p.add_argument("--kube-apiserver", type=Path, default=root / ".tools" / "bin" / "kube-apiserver")
    p.add_argument("--etcd", default=os.environ.get("ETCD", "etcd"))
    args = p.parse_args(argv)
    crds_dir = (args.crds_dir or default_crds_dir(root)).resolve()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="apiserver-") as tmp:
        plane = ControlPlane(Path(tmp), args.kube_apiserver, args.etcd).start()
        try:
            api = plane.api_client()
            install_crds(api, crds_dir)
            for extra in default_extra_crds_dirs(root):
                install_crds(api, extra.resolve())
            results = render_targets(root, crds_dir, args.targets)
            problems = dry_run_all(api, results)
        finally:
            plane.stop()
    for problem in problems:
        print(f"ERROR {problem}")
    n = sum(len(r.objects) for r in results.values())
    print(f"server-side dry-run {'FAILED' if problems else 'OK'}: {len(results)} targets, {n} objects, "
          f"{len(problems)} problems (API server ready in {plane.started_in:.1f}s, "
          f"{time.monotonic() - started:.1f}s in all)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
