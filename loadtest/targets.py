"""The Gateway ports a load test targets, what routing each one means, and a check that they answer.

CLUSTER_PORTS is the one place in loadtest/ that names the listener ports (the Makefile's
LT_PORTS says the same); the local stack serves them LOCAL_PORT_OFFSET higher (local/dataplane.py
takes the offset from here). Everything else takes ports from options.
No locust/gevent imports (and no import of local/: the in-cluster locust ships loadtest/ only).
"""
from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

# Gateway listeners in the order the comparisons use them: the baseline first.
LISTENERS = (("http", "least request"), ("llm-gw", "picker"))
CLUSTER_PORTS = (8080, 8081)
LOCAL_PORT_OFFSET = 10000
LOCAL_PORTS = tuple(p + LOCAL_PORT_OFFSET for p in CLUSTER_PORTS)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def default_ports(host: str) -> list[int]:
    """The local stack's listeners for a loopback host, else the cluster Gateway's."""
    return list(LOCAL_PORTS if host_parts(host)[1] in LOOPBACK else CLUSTER_PORTS)


def routing(port: int | str | None, ports=None) -> str:
    """'8080/http = least request' style label (the listener at that position of `ports`, or of
    the cluster's or the local stack's listener ports)."""
    if port in (None, ""):
        return "the host's own port"
    for known_ports in ([ports] if ports else [CLUSTER_PORTS, LOCAL_PORTS]):
        for known, (listener, policy) in zip(known_ports, LISTENERS):
            if known is not None and int(port) == int(known):
                return f"{port}/{listener} = {policy}"
    return f"{port}"


def describe_ports(ports) -> str:
    return ", ".join(routing(p) for p in ports) if ports else "the host's own port"


def host_parts(host: str) -> tuple[str, str, int | None]:
    """'http://gw:8080' or 'gw' -> (scheme, hostname, port or None)."""
    parts = urlsplit(host if "://" in host else f"http://{host}")
    return parts.scheme or "http", parts.hostname or "127.0.0.1", parts.port


def target_url(host: str, port: int | None, path: str = "") -> str:
    scheme, hostname, own_port = host_parts(host)
    port = port if port is not None else own_port
    return f"{scheme}://{hostname}{f':{port}' if port else ''}{path}"


def probe(host: str, port: int | None, timeout: float = 3.0) -> str:
    """'' when something answers HTTP on host:port (any status), else the reason."""
    scheme, hostname, own_port = host_parts(host)
    port = port if port is not None else own_port
    cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = cls(hostname, port, timeout=timeout)
    key = api_key(host, [port] if port else [])
    try:  # with the key the load will send, so the Gateway counts the probe as a normal request
        conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
        conn.getresponse().read()
        return ""
    except (OSError, http.client.HTTPException) as err:
        return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    finally:
        conn.close()


def unreachable(host: str, ports) -> str:
    """'' if every port answers, else one message naming each silent port and what to run."""
    silent = [(p, reason) for p in (list(ports) or [None]) if (reason := probe(host, p))]
    if not silent:
        return ""
    where = "; ".join(f"{target_url(host, p)} ({reason})" for p, reason in silent)
    return (f"nothing answers at {where}. Start the local stack with `make up` (and stop it "
            "later with `make down`), or point --host at a Gateway that is running.")


REPO = Path(__file__).resolve().parents[1]


def local_stack(host: str, ports, run_root: Path | None = None) -> dict | None:
    """The running local stack (runs/<name>/state.json) whose listeners are `ports` on `host`.

    Returns {'name', 'speedup', 'sims': ['http://127.0.0.1:8101', ...], 'state'} or None."""
    _, hostname, _ = host_parts(host)
    if hostname not in LOOPBACK:
        return None
    wanted = {int(p) for p in ports}
    for state_file in sorted((run_root or REPO / "runs").glob("*/state.json")):
        try:
            config = json.loads(state_file.read_text())["config"]
        except (OSError, ValueError, KeyError):
            continue
        # listener ports: the config's, else (None) the cluster's + the local offset
        listeners = tuple(config.get(key) or LOCAL_PORTS[i]
                          for i, key in enumerate(("http_port", "llm_port")))
        if not wanted or not wanted <= set(listeners):
            continue
        sims = config.get("sim_ports") or [config.get("sim_base_port", 8101) + i
                                           for i in range(config.get("groups", 0))]
        return {"name": config.get("name"), "speedup": float(config.get("speedup", 1.0)),
                "listeners": listeners,
                "sims": [f"http://{config.get('host', '127.0.0.1')}:{p}" for p in sims],
                "state": str(state_file)}
    return None


API_KEY_ENV = "OPENAI_API_KEY"  # what the OpenAI clients read


def api_key(host: str, ports, run_root: Path | None = None) -> str | None:
    """The API key to send (`Authorization: Bearer`): $OPENAI_API_KEY, else the throw-away key of
    the load generators (client id `loadtest`) of the local stack serving `ports`, else none."""
    if os.environ.get(API_KEY_ENV):
        return os.environ[API_KEY_ENV]
    stack = local_stack(host, ports, run_root)
    if stack is None:
        return None
    try:
        return json.loads((Path(stack["state"]).parent / "api-keys.json").read_text()).get("loadtest")
    except (OSError, ValueError):
        return None


API_KEYS_ENV = "LOADTEST_API_KEYS"  # a JSON file {client id: key} for workloads with client ids


def client_keys(host: str, ports, run_root: Path | None = None) -> dict[str, str]:
    """API keys by client id, for workloads whose requests name their client (PromptSpec.client):
    the JSON file $LOADTEST_API_KEYS names, else the local stack's throw-away keys, else none."""
    path = os.environ.get(API_KEYS_ENV)
    if not path:
        stack = local_stack(host, ports, run_root)
        if stack is None:
            return {}
        path = Path(stack["state"]).parent / "api-keys.json"
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"${API_KEYS_ENV} ({path}): not a readable JSON file: {err}") from None
    if not isinstance(keys, dict) or not all(isinstance(v, str) for v in keys.values()):
        raise ValueError(f"{path}: expected a JSON object of client id -> API key")
    return keys


def routing_names(host: str, ports) -> dict[str, str]:
    """{port: routing label}: by the local stack's listeners when one serves `ports`, else by
    the cluster's or the default local ports."""
    stack = local_stack(host, ports)
    listeners = stack["listeners"] if stack else None
    return {str(p): routing(p, listeners) for p in ports}


def clock_note(speedup: float | None) -> str:
    """How to read the times: wall clock, and what that is in model time."""
    if speedup is None:
        return "times are wall clock (simulator speedup unknown: pass --speedup)"
    if speedup == 1:
        return "times are wall clock (= model time: speedup 1)"
    return (f"times are wall clock at simulator speedup {speedup:g} "
            f"(model time = {speedup:g} x wall clock)")
