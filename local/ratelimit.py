"""The Envoy rate limit service on the local stack (the per-client token budgets of
components/token-budget), with Redis, as Envoy Gateway runs it in a cluster.

In a cluster Envoy Gateway starts the rate limit service itself (Deployment `envoy-ratelimit`) and
points Envoy at `envoy-ratelimit.envoy-gateway-system.svc.cluster.local:8081`. Its Host
infrastructure (standalone mode) does not: v1.9.0 logs "create/update ratelimit infrastructure is
not supported yet for host infrastructure" and changes nothing else. Everything else runs as in a
cluster: Envoy Gateway translates the budget, serves the rate limit configuration over xDS (port
18001, TLS with the certificates `certgen --local` writes) and generates Envoy's `ratelimit_cluster`.
So the launcher starts the two processes Envoy Gateway would have deployed, configured the way it
configures them (its own environment variables and certificates), and one local swap makes the
cluster reachable: an EnvoyPatchPolicy (an Envoy Gateway API) that points `ratelimit_cluster` at
127.0.0.1 and at the certificates' files, since the cluster DNS name and the in-pod certificate path
`/certs` do not exist here.

The rate limit service is the Go module github.com/envoyproxy/ratelimit at RATELIMIT_VERSION, built
by `make tools` into .tools/bin/ratelimit; Redis is Debian's redis-server.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# github.com/envoyproxy/ratelimit has no release tags since 2019; this is the pseudo-version of
# commit 3fb702589d36 (2026-01-22), the newest on the Go module proxy when it was pinned.
RATELIMIT_VERSION = "v1.4.1-0.20260122083618-3fb702589d36"
XDS_PORT = 18001          # Envoy Gateway's rate limit configuration server (fixed in v1.9.0)
NODE_ID = "envoy-ratelimit"  # the node id Envoy Gateway serves the configuration to
SERVER_NAME = "envoy-gateway"  # a SAN of Envoy Gateway's certificate
CLUSTER = "ratelimit_cluster"  # the cluster Envoy Gateway generates for the service


class RateLimitError(RuntimeError):
    pass


@dataclass(frozen=True)
class Ports:
    redis: int = 16379
    grpc: int = 18091
    http: int = 18090
    debug: int = 18092


def binary() -> Path:
    path = REPO / ".tools" / "bin" / "ratelimit"
    if not path.is_file():
        raise RateLimitError(f"{path} is missing: `make tools` builds the Envoy rate limit service "
                             f"({RATELIMIT_VERSION}, about 2 minutes the first time)")
    return path


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise RateLimitError("redis-server is missing (Debian package redis-server; `make tools` installs it)")
    return found


def redis_command(ports: Ports) -> list[str]:
    """In memory only, loopback only: the counts live for a budget window."""
    return [redis_binary(), "--port", str(ports.redis), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no"]


def service_env(certs: Path, ports: Ports) -> dict[str, str]:
    """The environment Envoy Gateway gives its rate limit Deployment (internal/infrastructure/
    kubernetes/ratelimit/resource.go), with this machine's addresses and certificate files."""
    own = certs / "envoy-rate-limit"
    return {
        "LOG_LEVEL": "info", "USE_STATSD": "false", "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        "CONFIG_TYPE": "GRPC_XDS_SOTW", "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{XDS_PORT}",
        "CONFIG_GRPC_XDS_NODE_ID": NODE_ID, "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": str(own / "tls.crt"),
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": str(own / "tls.key"),
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": str(own / "ca.crt"),
        "CONFIG_GRPC_XDS_SERVER_TLS_SAN": SERVER_NAME,
        "GRPC_SERVER_USE_TLS": "true", "GRPC_SERVER_TLS_CERT": str(own / "tls.crt"),
        "GRPC_SERVER_TLS_KEY": str(own / "tls.key"), "GRPC_CLIENT_TLS_CACERT": str(own / "ca.crt"),
        "REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": f"127.0.0.1:{ports.redis}",
        "HOST": "127.0.0.1", "PORT": str(ports.http), "GRPC_HOST": "127.0.0.1", "GRPC_PORT": str(ports.grpc),
        "DEBUG_HOST": "127.0.0.1", "DEBUG_PORT": str(ports.debug),
    }


def service_command() -> list[str]:
    """The service reads its settings from its environment (service_env)."""
    return [str(binary())]


def envoy_gateway_settings(ports: Ports) -> dict:
    """EnvoyGateway config: global rate limiting on (it then translates the budget and serves the
    service's configuration). The URL is what a cluster would name; the Host provider never uses it
    (the service gets REDIS_URL above) but Envoy Gateway requires a parseable one."""
    return {"rateLimit": {"backend": {"type": "Redis", "redis": {"url": f"localhost:{ports.redis}"}},
                          "failClosed": True, "timeout": cluster_settings()["timeout"]}}


def cluster_settings() -> dict:
    """The rate limit settings argocd/apps/envoy-gateway.yaml gives Envoy Gateway in the cluster."""
    import yaml
    app = yaml.safe_load((REPO / "argocd" / "apps" / "envoy-gateway.yaml").read_text())
    return app["spec"]["source"]["helm"]["valuesObject"]["config"]["envoyGateway"]["rateLimit"]


def cluster_patch(gateway: dict, certs: Path, ports: Ports) -> dict:
    """EnvoyPatchPolicy: Envoy's rate limit cluster at the local service, over mutual TLS with the
    certificates `certgen --local` wrote (the service checks Envoy's, Envoy checks the service's)."""
    envoy = certs / "envoy"
    tls = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": f"{NODE_ID}.envoy-gateway-system",
        "common_tls_context": {
            "tls_certificates": [{"certificate_chain": {"filename": str(envoy / "tls.crt")},
                                  "private_key": {"filename": str(envoy / "tls.key")}}],
            "validation_context": {"trusted_ca": {"filename": str(envoy / "ca.crt")}}}}}
    cluster = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    meta = gateway.get("metadata") or {}
    return {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyPatchPolicy",
            "metadata": {"name": "local-ratelimit-service", **({"namespace": meta["namespace"]}
                                                                if meta.get("namespace") else {})},
            "spec": {"targetRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": meta["name"]},
                     "type": "JSONPatch",
                     "jsonPatches": [
                         {"type": cluster, "name": CLUSTER, "operation": {
                             "op": "replace",
                             "path": "/load_assignment/endpoints/0/lb_endpoints/0/endpoint/address/socket_address",
                             "value": {"address": "127.0.0.1", "port_value": ports.grpc}}},
                         {"type": cluster, "name": CLUSTER, "operation": {
                             "op": "replace", "path": "/transport_socket", "value": tls}}]}}
