"""Command line (DESIGN.md "Interfaces")."""
from __future__ import annotations

import argparse

from picker import defaults, leader
from picker.flowcontrol.controller import AT_BOUND, FlowSettings
from picker.flowcontrol.queue import QueueLimits
from picker.flowcontrol.room import RoomRule
from picker.protocol.limits import ServerLimits


def _endpoints(text: str) -> list[str]:
    out = [e.strip() for e in text.split(",") if e.strip()]
    for e in out:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"endpoint {e!r} is not host:port")
    return out


def _peers(text: str) -> list[tuple[str, int]]:
    from picker.peer_link import parse_peers
    try:
        return parse_peers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m picker",
                                description="Envoy ext_proc endpoint picker for vLLM leaders")
    p.add_argument("--grpc-port", type=int, default=defaults.GRPC_PORT, help="ext_proc gRPC port")
    p.add_argument("--health-port", type=int, default=defaults.HEALTH_PORT, help="gRPC health port")
    p.add_argument("--metrics-port", type=int, default=defaults.METRICS_PORT, help="Prometheus /metrics port")
    p.add_argument("--outcomes-port", type=int, default=defaults.OUTCOMES_PORT,
                   help="Envoy's gRPC access log service (the outcome of every routed request: "
                        "endpoint, tokens, timings), served with the ext_proc port's TLS; 0: off")
    p.add_argument("--secure-serving", action=argparse.BooleanOptionalAction, default=True,
                   help="serve ext_proc over TLS (default; self-signed unless --cert-path)")
    p.add_argument("--cert-path", help="directory with tls.crt and tls.key")
    p.add_argument("--discovery", choices=["kubernetes", "static"], required=True)
    p.add_argument("--pool-name", default="reasoning-pool")
    p.add_argument("--pool-namespace", default="default")
    p.add_argument("--endpoints", type=_endpoints, default=[],
                   help="static: comma-separated ip:port list")
    p.add_argument("--objects", nargs="+", action="extend", default=[],
                   help="static: InferenceObjective/InferenceModelRewrite YAML files or directories")
    p.add_argument("--profile", default="default",
                   help="scheduling profile: built-in name (default, upstream-default) or YAML path")
    p.add_argument("--scrape-interval", type=float, default=defaults.SCRAPE_INTERVAL,
                   help="seconds between /metrics scrapes of each endpoint (grows with large "
                        "pools, see README)")
    p.add_argument("--staleness", type=float, default=defaults.STALENESS,
                   help="seconds after which metrics count as unknown-and-saturated")
    p.add_argument("--max-body-bytes", type=int, default=defaults.MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--max-streams", type=int, default=defaults.MAX_STREAMS,
                   help="concurrent requests (ext_proc streams) one replica handles; more get 503")
    p.add_argument("--max-buffered-bytes", type=int, default=defaults.MAX_BUFFERED_BYTES,
                   help="request body bytes buffered across all requests; more get 503")
    p.add_argument("--grpc-max-concurrent-streams", type=int,
                   help="HTTP/2 streams per gRPC connection (default: 2 x --max-streams)")
    p.add_argument("--grpc-max-pending-requests", type=int,
                   help="calls the gRPC core queues before the server takes them (its own "
                        "default is 1,000; default here: 2 x --max-streams)")
    p.add_argument("--grpc-max-concurrent-rpcs", type=int,
                   help="hard ceiling of calls in progress; beyond it gRPC rejects them without "
                        "a reason (default: 2 x --max-streams)")
    p.add_argument("--inflight-timeout", type=float, default=defaults.INFLIGHT_TIMEOUT,
                   help="seconds after which an unfinished request stops counting as in flight")
    p.add_argument("--default-objective", help="InferenceObjective for requests without the header")
    p.add_argument("--ext-proc-server", choices=["native", "python"], default=defaults.EXT_PROC_SERVER,
                   help="the ext_proc gRPC server: native (the compiled transport in front of the "
                        "Python decision) or python (grpc.aio, the fallback); both answer alike")
    p.add_argument("--request-body-mode", choices=["full-duplex", "buffered"], default="full-duplex",
                   help="body mode assumed when Envoy sends no protocol_config")
    p.add_argument("--workers", type=int, default=defaults.WORKERS,
                   help="ext_proc worker processes behind the one gRPC port (one per core)")
    p.add_argument("--peer-store", metavar="URL",
                   help="redis://HOST:PORT[/DB]: share in-flight counts and the prefix index "
                        "with the pool's other picker replicas")
    p.add_argument("--flow-control", action=argparse.BooleanOptionalAction,
                   default=defaults.FLOW_CONTROL,
                   help="hold requests no endpoint can start now in the picker (see README)")
    p.add_argument("--flow-max-requests", type=int, default=defaults.FLOW_MAX_REQUESTS,
                   help="requests held at once per worker; more: 429 (sheddable) or 503")
    p.add_argument("--flow-max-wait", type=float, default=defaults.FLOW_MAX_WAIT,
                   help="seconds a request of priority >= 0 may be held; then 503 queue_timeout "
                        "(keep below the gateway's ext_proc messageTimeout)")
    p.add_argument("--flow-max-wait-sheddable", type=float,
                   default=defaults.FLOW_MAX_WAIT_SHEDDABLE,
                   help="seconds a sheddable request (priority < 0) may be held; then 429")
    p.add_argument("--flow-at-bound", choices=list(AT_BOUND), default=defaults.FLOW_AT_BOUND,
                   help="a request of priority >= 0 at --flow-max-wait: refused (503), sent to "
                        "the best endpoint as without flow control, or sent only if no other band "
                        "or client is active (dispatch-uncontested; sheddable ones: always 429)")
    p.add_argument("--flow-strict-turns", type=int, default=defaults.FLOW_STRICT_TURNS,
                   help="higher-priority dispatches in a row before a waiting lower-priority "
                        "request goes (the starvation bound)")
    p.add_argument("--flow-max-engine-waiting", type=int, default=defaults.FLOW_MAX_ENGINE_WAITING,
                   help="an endpoint whose engine has more requests waiting has no room")
    p.add_argument("--flow-output-reserve", type=int, default=defaults.FLOW_OUTPUT_RESERVE,
                   help="KV tokens an endpoint must have free beyond the prompt to have room")
    p.add_argument("--flow-affinity-tokens", type=int, default=defaults.FLOW_AFFINITY_TOKENS,
                   help="an endpoint without room stays a candidate when its prefix cache holds "
                        "this many more of the prompt's tokens than any endpoint with room")
    p.add_argument("--flow-holdback", type=float, default=defaults.FLOW_HOLDBACK,
                   help="fraction of an endpoint's KV a request that holds back (lower band while "
                        "a higher one is active; client over its share while the pool is "
                        "saturated) must leave free")
    p.add_argument("--flow-activity-window", type=float, default=defaults.FLOW_ACTIVITY_WINDOW,
                   help="seconds of arrivals that make a band or client active for holdback, and "
                        "how long a refused request keeps the pool saturated")
    p.add_argument("--flow-stale-hold", type=float, default=defaults.FLOW_STALE_HOLD,
                   help="seconds beyond --staleness that requests are held while every "
                        "candidate's metrics are stale; then nothing is held until they are fresh")
    p.add_argument("--lengths", action=argparse.BooleanOptionalAction, default=True,
                   help="learn output lengths from the outcomes Envoy's access log reports "
                        "(--outcomes-port) and forecast every request's; the `lengths` profile "
                        "routes on them (see README, \"Output lengths\")")
    p.add_argument("--precise-prefix", action=argparse.BooleanOptionalAction,
                   default=defaults.PRECISE_PREFIX,
                   help="route on the engines' KV-cache events (needs --tokenizer); off: the "
                        "approximate prefix index only")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the model's tokenizer: a directory with tokenizer.json and "
                        "tokenizer_config.json (the model volume)")
    p.add_argument("--kv-events-port", type=int, default=defaults.KV_EVENTS_PORT,
                   help="each leader's KV-events publisher port, where its /kv_event_sources "
                        "does not say")
    p.add_argument("--kv-replay-port", type=int, default=defaults.KV_REPLAY_PORT,
                   help="each leader's KV-events replay port (0: none)")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=False,
                   help="active-passive replicas: only the holder of a coordination.k8s.io Lease "
                        "is ready (serves Envoy); the others stay warm standbys (see README)")
    p.add_argument("--leader-election-lease-name",
                   help="the Lease's name (default: <pool-name>-picker)")
    p.add_argument("--leader-election-namespace",
                   help="the Lease's namespace (default: --pool-namespace)")
    p.add_argument("--leader-election-lease-duration", type=int, default=leader.LEASE_DURATION,
                   help="seconds a standby waits after the Lease last changed before it takes "
                        "it from a leader that stopped renewing (a killed or cut-off leader: "
                        "the failover time)")
    p.add_argument("--leader-election-renew-deadline", type=float,
                   default=leader.RENEW_DEADLINE,
                   help="seconds a leader goes on without a successful renew before it turns "
                        "not-ready (below the lease duration: it gives up before anyone takes "
                        "over)")
    p.add_argument("--leader-election-retry-period", type=float, default=leader.RETRY_PERIOD,
                   help="seconds between a leader's renews and a standby's tries (a released "
                        "Lease is taken within this)")
    p.add_argument("--end-answered-streams", action=argparse.BooleanOptionalAction,
                   default=defaults.END_ANSWERED_STREAMS,
                   help="end each ext_proc stream as soon as its request is answered, so a "
                        "request Envoy is already serving does not fail if this replica dies "
                        "(default); off: keep it open until Envoy closes it, for a policy that "
                        "also sends the response phase (usage counting)")
    p.add_argument("--peers", type=_peers, default=[], metavar="HOST:PORT[,...]",
                   help="the other replicas' peer ports (names are resolved every second, to "
                        "every address; a headless Service lists every replica): a direct link "
                        "that shares in-flight counts and prefix additions, and tells a standby "
                        "at once that the leader left, died or hangs (see README)")
    p.add_argument("--peer-port", type=int, default=defaults.PEER_PORT,
                   help="where this replica accepts the other replicas' links (with --peers)")
    p.add_argument("--drain-seconds", type=float, default=defaults.DRAIN_SECONDS,
                   help="on SIGTERM, after handing over and reporting NOT_SERVING: how long the "
                        "replica still answers the streams Envoy sends before its health check "
                        "sees that (at least its interval + timeout)")
    p.add_argument("--bind", default="[::]", help="address the servers listen on")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.discovery == "static" and not args.endpoints:
        p.error("--discovery static needs --endpoints")
    if args.discovery == "kubernetes" and (args.endpoints or args.objects):
        p.error("--endpoints/--objects are for --discovery static")
    if args.scrape_interval <= 0 or args.staleness <= 0:
        p.error("--scrape-interval and --staleness must be positive")
    if not 0 < args.kv_events_port < 65536 or not 0 <= args.kv_replay_port < 65536:
        p.error("--kv-events-port must be a port, --kv-replay-port a port or 0")
    if not 0 <= args.outcomes_port < 65536:
        p.error("--outcomes-port must be a port, or 0 (off)")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.peer_store and not args.peer_store.startswith(("redis://", "rediss://", "unix://")):
        p.error("--peer-store must be a redis://, rediss:// or unix:// URL")
    if args.peer_store and args.peers:
        p.error("--peer-store (Redis, active-active) and --peers (the direct link) exclude each "
                "other")
    if args.drain_seconds < 0 or not 0 <= args.peer_port < 65536:
        p.error("--drain-seconds must be >= 0 and --peer-port a port")
    try:
        server_limits(args)
        flow_settings(args)
        lease_settings(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def flow_settings(args: argparse.Namespace) -> FlowSettings | None:
    """The flow-control settings of the command line, None when it is off."""
    if not getattr(args, "flow_control", False):
        return None
    if min(args.flow_max_engine_waiting, args.flow_output_reserve, args.flow_affinity_tokens) < 0:
        raise ValueError("--flow-max-engine-waiting, --flow-output-reserve and "
                         "--flow-affinity-tokens must be >= 0")
    return FlowSettings(
        QueueLimits(max_requests=args.flow_max_requests, max_wait=args.flow_max_wait,
                    max_wait_sheddable=args.flow_max_wait_sheddable,
                    strict_turns=args.flow_strict_turns),
        RoomRule(max_engine_waiting=args.flow_max_engine_waiting,
                 output_reserve_tokens=args.flow_output_reserve,
                 affinity_tokens=args.flow_affinity_tokens,
                 holdback_fraction=args.flow_holdback),
        at_bound=args.flow_at_bound, activity_window=args.flow_activity_window,
        stale_hold=args.flow_stale_hold)


def server_limits(args: argparse.Namespace) -> ServerLimits:
    if args.max_buffered_bytes < args.max_body_bytes:
        raise ValueError("--max-buffered-bytes must hold at least one --max-body-bytes body")
    for flag in ("grpc_max_concurrent_streams", "grpc_max_pending_requests",
                 "grpc_max_concurrent_rpcs"):
        value = getattr(args, flag)
        if value is not None and value < args.max_streams:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least --max-streams, so that "
                             f"requests over the limit get the picker's 503 with a reason")
    return ServerLimits(max_streams=args.max_streams, max_buffered_bytes=args.max_buffered_bytes,
                        max_body_bytes=args.max_body_bytes,
                        grpc_max_concurrent_streams=args.grpc_max_concurrent_streams,
                        grpc_max_pending_requests=args.grpc_max_pending_requests,
                        grpc_max_concurrent_rpcs=args.grpc_max_concurrent_rpcs)


def lease_settings(args: argparse.Namespace) -> leader.LeaseSettings | None:
    """The Lease this replica competes for, None without --leader-election."""
    if not getattr(args, "leader_election", False):
        return None
    settings = leader.LeaseSettings(
        name=args.leader_election_lease_name or f"{args.pool_name}-picker",
        namespace=args.leader_election_namespace or args.pool_namespace,
        identity=leader.default_identity(),
        lease_duration=args.leader_election_lease_duration,
        renew_deadline=args.leader_election_renew_deadline,
        retry_period=args.leader_election_retry_period)
    settings.check()
    return settings
