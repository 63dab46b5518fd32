"""What a local stack is asked to be (StackConfig) and the error every part of the launcher raises."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_ROOT = REPO / "runs"
EDGE_SECURITY = "components/edge-security"
TOKEN_BUDGET = "components/token-budget"
# TLS on both listeners and the verified picker hop, with the run's throw-away CA (local/certs.py)
TLS = ("components/gateway-tls", "components/picker-tls")
# Client ids of the throw-away keys: `loadtest` has the load generators' rate limit (the demo, the
# load tests and the end-to-end tests use it), the others the limit of any other client: `user`,
# and the applications of the class-mix workloads (loadtest/workloads.py), which the picker tells
# apart by client id.
API_CLIENTS = ("loadtest", "user", "chat-app", "agent-app", "reasoner-app", "app")
API_KEYS_FILE = "api-keys.json"
ENGINES = ("sim", "vllm")
# Real vLLM's CPU build takes about a minute to start when the machine is idle, several when not.
VLLM_STARTUP_TIMEOUT = 600.0


class StackError(RuntimeError):
    pass


@dataclass
class StackConfig:
    name: str = "local"
    # What serves each group: "sim" (local.sim, A10 timing at `speedup`) or "vllm" (real vLLM's
    # CPU build with the tiny model, local.vllm_server; real time, so speedup does not apply).
    engine: str = "sim"
    groups: int = 3
    speedup: float = 20.0
    seed: int = 0
    # Request body mode of the EnvoyExtensionPolicy (None: as base/gateway has it). "buffered" adds
    # components/buffered-body to the render, as a cluster user would.
    body_mode: str | None = None
    canary: bool = False
    # The cluster's edge (components/edge-security) with throw-away API keys; False: no keys, no
    # rate limits, as overlays/a10-open-gateway alone.
    edge_security: bool = True
    # components/token-budget: per-client token budgets through Envoy Gateway's global rate limit;
    # starts Redis and the Envoy rate limit service (local/ratelimit.py). Needs edge_security.
    token_budget: bool = False
    redis_port: int = 16379
    ratelimit_grpc_port: int = 18091
    ratelimit_http_port: int = 18090
    ratelimit_debug_port: int = 18092
    # TLS on both listeners (certificates from a CA made at start) and the picker hop verified
    # against that CA, as overlays/a10 has them.
    tls: bool = False
    host: str = "127.0.0.1"
    sim_base_port: int = 8101
    sim_ports: list[int] | None = None  # explicit ports; else sim_base_port, +1, ...
    # Listener ports; None: the cluster port + dataplane.LISTENER_PORT_OFFSET (18080, 18081).
    http_port: int | None = None
    llm_port: int | None = None
    picker_grpc_port: int = 9002
    picker_health_port: int = 9003
    picker_metrics_port: int = 9090
    picker_outcomes_port: int = 9004  # Envoy's access log service (the picker's --outcomes-port)
    picker_peer_port: int = 9005     # the replicas' direct link (only with pickers > 1)
    # Picker replicas, as base/picker runs them: with 2 or more, active-passive on a real Lease
    # (etcd and the project's kube-apiserver start with the stack, control_plane.py), the
    # replicas linked (--peers) and every one of them in the gateway's picker Backend, health-
    # checked by Envoy. Replica i > 0 listens on replica_ports[i - 1] (gRPC, health, metrics,
    # peer, outcomes), else on the first replica's ports + 10 x i.
    pickers: int = 1
    replica_ports: list[list[int]] | None = None
    profile: str = "default"
    # The picker's scrape interval and staleness in MODEL seconds (None: the picker's own defaults,
    # which are meant for real time). The launcher divides them by the speedup, so the picker sees
    # the simulated engines as often, in model time, as it would see real ones (plan.picker_timing).
    picker_scrape_interval: float | None = None
    picker_staleness: float | None = None
    kv_scale: int = 1  # simulators get the engine model's KV capacity / kv_scale (the demo: DEMO_SCALE)
    # Precise prefix routing: the simulators publish KV-cache events (ZMQ on the stack's host; group
    # i's publisher on kv_events_base_port + 2i, its replay socket on the next port) and the picker
    # follows them; False: no events, the picker's approximate index (--no-precise-prefix).
    precise_prefix: bool = True
    kv_events_base_port: int = 18101
    # The model's tokenizer, read by the simulators and the picker (None: the tiny model's, built
    # into local.tinymodel.DEFAULT_DIR on start).
    tokenizer: Path | None = None
    sim_args: list[str] = field(default_factory=list)
    picker_args: list[str] = field(default_factory=list)
    run_root: Path = RUN_ROOT
    startup_timeout: float = 90.0

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise StackError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.pickers < 1 or (self.replica_ports is not None
                                and len(self.replica_ports) < self.pickers - 1):
            raise StackError(f"{self.pickers} pickers: at least one, and ports for each")

    def picker_ports(self, i: int) -> tuple[int, int, int, int, int]:
        """(gRPC, health, metrics, peer, outcomes) of picker replica i."""
        if i > 0 and self.replica_ports:
            grpc, health, metrics, peer, outcomes = self.replica_ports[i - 1]
            return grpc, health, metrics, peer, outcomes
        step = 10 * i
        return (self.picker_grpc_port + step, self.picker_health_port + step,
                self.picker_metrics_port + step, self.picker_peer_port + step,
                self.picker_outcomes_port + step)

    def picker_name(self, i: int) -> str:
        """The process name (and Lease identity) of picker replica i: `picker` for the first."""
        return "picker" if i == 0 else f"picker-{i}"

    @property
    def leader_election(self) -> bool:
        """Several pickers run as base/picker runs them: active-passive on a Lease."""
        return self.pickers > 1
    @property
    def run_dir(self) -> Path:
        return Path(self.run_root) / self.name

    @property
    def overlay(self) -> str:
        return "overlays/a10-canary-open-gateway" if self.canary else "overlays/a10-open-gateway"

    @property
    def components(self) -> list[str]:
        if self.token_budget and not self.edge_security:
            raise StackError("a token budget needs the edge (the client id comes from the API key)")
        return ((["components/buffered-body"] if self.body_mode == "buffered" else [])
                + ([EDGE_SECURITY] if self.edge_security else [])
                + ([TOKEN_BUDGET] if self.token_budget else []) + (list(TLS) if self.tls else []))

    @property
    def certs_dir(self) -> Path:
        return self.run_dir / "tls"

    @property
    def ratelimit_ports(self):
        from local.ratelimit import Ports
        return Ports(self.redis_port, self.ratelimit_grpc_port, self.ratelimit_http_port, self.ratelimit_debug_port)

    @property
    def api_keys_file(self) -> Path:
        return self.run_dir / API_KEYS_FILE

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, raw: dict, run_root: Path) -> "StackConfig":
        """The config a running stack recorded (fields this version does not know are left out),
        under `run_root` (where its state was found)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known and k != "run_root"}, run_root=Path(run_root))
