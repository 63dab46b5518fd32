"""Active-passive pickers (`python -m picker --leader-election`) on a real API server, each with a
ServiceAccount token bound to exactly the Role in base/picker: exactly one is ready; the others
are warm (they scrape the endpoint) but not ready; SIGTERM of the leader hands over within the
retry period (the Lease is released), SIGKILL within the lease duration (it expires), or at once
when the replicas are linked (--peers, as base/picker runs them: the standby sees the dead leader's
link close); linked standbys never take a live leader's Lease; without the Role's Lease rule
nobody leads."""
from __future__ import annotations

import copy
import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.apiserver.test_picker_rbac import apply_role, deployed, picker_token  # noqa: F401 (fixtures)
from tests.helpers.kube import NAMESPACE, PICKER, ROOT, STARTUP, end_process, wait_until
from validation.apiserver import free_port

LEASE = "reasoning-pool-picker"     # the default: <pool-name>-picker
LEASE_DURATION, RETRY_PERIOD = 4.0, 0.5  # the picker's defaults (picker/src/picker/leader.py)
SLACK = 1.5   # seconds: process wake-ups and API calls on a busy 2-core machine
SERVICE = "readiness"


class Engine:
    """One vLLM-like /metrics page on loopback (the pickers' static endpoint)."""

    PAGE = ('# TYPE vllm:num_requests_waiting gauge\n'
            'vllm:num_requests_waiting{model_name="qwq"} 2\n'
            '# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{model_name="qwq"} 1\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{model_name="qwq"} 0.25\n').encode()

    def __init__(self):
        page = self.PAGE

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = (200, page) if self.path == "/metrics" else (404, b"")
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # a picker killed mid-scrape
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()


class Candidate:
    """One picker process with --leader-election, identity `name` (POD_NAME)."""

    def __init__(self, name, kubeconfig, endpoint, log_path, extra=()):
        self.name = name
        self.health_port, self.metrics_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env.update(KUBECONFIG=str(kubeconfig), POD_NAME=name)
        self.log_path, self.log_file = log_path, log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "picker", "--discovery", "static", "--endpoints", endpoint,
             "--pool-namespace", NAMESPACE, "--no-secure-serving", "--bind", "127.0.0.1",
             "--grpc-port", str(free_port()), "--health-port", str(self.health_port),
             "--metrics-port", str(self.metrics_port), "--outcomes-port", "0", "--scrape-interval", "0.1",
             "--leader-election", *extra],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log_file)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.health_port}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def status(self, service=SERVICE):
        """SERVING/NOT_SERVING, None while its health server is not up (or it is gone)."""
        if not self.alive():
            return None
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
        except grpc.RpcError:
            return None

    def ready(self) -> bool:
        return self.status() == health_pb2.HealthCheckResponse.SERVING

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            return r.read().decode()

    def gauge(self, name: str) -> float | None:
        m = re.search(rf"^{re.escape(name)} (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else None

    def warm(self, endpoint: str) -> bool:
        """Its metrics show the endpoint scraped (queue 2, ready)."""
        try:
            return (self.gauge(f'picker_endpoint_queue{{endpoint="{endpoint}"}}') == 2.0
                    and self.gauge(f'picker_endpoint_ready{{endpoint="{endpoint}"}}') == 1.0)
        except OSError:
            return False

    def stop(self):
        self.channel.close()
        end_process(self.proc)
        self.log_file.close()


@pytest.fixture
def pool(control_plane, deployed, picker_token, tmp_path):  # noqa: F811
    """Start n candidates with the rendered Role; yields a starter; stops them and the engine."""
    from kubernetes import client
    admin = control_plane.api_client()
    apply_role(admin, deployed[("Role", PICKER)])
    coordination = client.CoordinationV1Api(admin)
    try:
        coordination.delete_namespaced_lease(LEASE, NAMESPACE)
    except client.exceptions.ApiException:
        pass
    engine = Engine()
    kubeconfig = control_plane.kubeconfig(tmp_path / "kubeconfig", picker_token, NAMESPACE)
    started: list[Candidate] = []

    def start(n: int, extra=(), linked: bool = False) -> list[Candidate]:
        """linked: with the peer link (--peers naming every candidate, as base/picker)."""
        ports = [free_port() for _ in range(n)]
        peers = ["--peers", ",".join(f"127.0.0.1:{p}" for p in ports)] if linked else []
        for i in range(n):
            link = [*peers, "--peer-port", str(ports[i])] if linked else []
            started.append(Candidate(f"picker-{len(started)}", kubeconfig, engine.address,
                                     tmp_path / f"picker-{len(started)}.log", [*extra, *link]))
        return started[-n:]

    start.engine, start.coordination = engine, coordination
    yield start
    for c in started:
        c.stop()
    engine.stop()


def holder(coordination) -> str:
    return coordination.read_namespaced_lease(LEASE, NAMESPACE).spec.holder_identity


def exactly_one_ready(candidates) -> Candidate | None:
    ready = [c for c in candidates if c.alive() and c.ready()]
    return ready[0] if len(ready) == 1 else None


def settle(candidates, engine) -> Candidate:
    """Every candidate warm and exactly one ready; returns the leader."""
    wait_until(lambda: all(c.status() is not None for c in candidates), STARTUP, "health servers up")
    wait_until(lambda: all(c.warm(engine.address) for c in candidates), STARTUP, "all warm")
    wait_until(lambda: exactly_one_ready(candidates), STARTUP, "one leader")
    return exactly_one_ready(candidates)


@pytest.mark.parametrize("n,workers", [(2, 2), (3, 1)])
def test_exactly_one_is_ready_and_the_standbys_are_warm(pool, n, workers):
    """2 as base/picker runs them (2 worker processes each: /metrics sums the workers), and 3."""
    candidates = pool(n, ["--workers", str(workers)])
    leader = settle(candidates, pool.engine)
    assert holder(pool.coordination) == leader.name
    # For three lease durations (renews every retry period): the same one, the only one.
    end = time.monotonic() + 3 * LEASE_DURATION
    while time.monotonic() < end:
        assert [c.name for c in candidates if c.ready()] == [leader.name]
        time.sleep(0.1)
    for c in candidates:
        is_leader = c is leader
        assert c.gauge("picker_leader") == (1.0 if is_leader else 0.0)
        assert c.status("liveness") == health_pb2.HealthCheckResponse.SERVING
        assert c.warm(pool.engine.address), f"{c.name} is not following the endpoint"
        assert c.gauge('picker_leader_transitions_total{change="acquired"}') == (1.0 if is_leader else 0.0)


def failover(pool, n: int, sig: int, linked: bool = False) -> tuple[float, Candidate, Candidate]:
    """Seconds from `sig` to the leader until another candidate is ready (polled every 20 ms)."""
    candidates = pool(n, linked=linked)
    old = settle(candidates, pool.engine)
    os.kill(old.proc.pid, sig)
    sent = time.monotonic()
    wait_until(lambda: any(c.ready() for c in candidates if c is not old), LEASE_DURATION + 10,
               "a new leader")
    took = time.monotonic() - sent
    new = exactly_one_ready([c for c in candidates if c is not old])
    assert new is not None
    # with the link it acts before the dead leader's Lease expires, then takes it
    wait_until(lambda: holder(pool.coordination) == new.name, LEASE_DURATION + SLACK + 1,
               "the Lease taken over")
    return took, old, new


def test_sigterm_hands_over_within_the_retry_period(pool):
    took, old, new = failover(pool, 2, signal.SIGTERM)
    print(f"\nSIGTERM of the leader -> standby ready in {took:.3f}s (retry period {RETRY_PERIOD}s)")
    assert took < RETRY_PERIOD + SLACK
    assert old.proc.wait(timeout=15) == 0
    assert any(r.get("msg") == "leadership released" for r in _log(old))
    assert new.gauge('picker_leader_transitions_total{change="acquired"}') == 1.0


def test_sigkill_hands_over_within_the_lease_duration(pool):
    took, old, new = failover(pool, 2, signal.SIGKILL)
    print(f"\nSIGKILL of the leader -> standby ready in {took:.3f}s (lease duration {LEASE_DURATION}s)")
    # Not before the Lease expired (the standby saw its last renew at most one retry period
    # before the kill), and not much later.
    assert LEASE_DURATION - RETRY_PERIOD - 0.1 < took < LEASE_DURATION + RETRY_PERIOD + SLACK


def test_with_the_link_sigkill_hands_over_at_once(pool):
    """base/picker's shape (--peers): the standby sees the dead leader's link close and acts at
    once, without waiting for the Lease to expire (it takes the Lease after)."""
    took, old, new = failover(pool, 2, signal.SIGKILL, linked=True)
    print(f"\nSIGKILL of the linked leader -> standby ready in {took:.3f}s")
    assert took < RETRY_PERIOD + SLACK
    assert new.gauge('picker_failovers_total{reason="leader_gone"}') == 1.0
    assert new.gauge("picker_acting_leader") == 1.0


def test_with_the_link_a_standby_never_takes_the_lease_of_a_live_leader(pool):
    """Three linked replicas for three lease durations: one acts, the Lease never moves."""
    candidates = pool(3, linked=True)
    leader = settle(candidates, pool.engine)
    transitions = pool.coordination.read_namespaced_lease(LEASE, NAMESPACE).spec.lease_transitions
    end = time.monotonic() + 3 * LEASE_DURATION
    while time.monotonic() < end:
        assert [c.name for c in candidates if c.ready()] == [leader.name]
        time.sleep(0.1)
    lease = pool.coordination.read_namespaced_lease(LEASE, NAMESPACE).spec
    assert (lease.holder_identity, lease.lease_transitions) == (leader.name, transitions)
    assert all(c.gauge('picker_peers{state="live"}') == 2.0 for c in candidates)


def test_without_the_lease_rule_nobody_leads(pool, control_plane, deployed):  # noqa: F811
    role = copy.deepcopy(deployed[("Role", PICKER)])
    role["rules"] = [r for r in role["rules"] if "leases" not in r["resources"]]
    assert len(role["rules"]) < len(deployed[("Role", PICKER)]["rules"])
    apply_role(control_plane.api_client(), role)
    try:
        candidates = pool(2)
        wait_until(lambda: all(c.warm(pool.engine.address) for c in candidates), STARTUP, "all warm")
        wait_until(lambda: all(any(r.get("status") == 403 for r in _log(c)) for c in candidates),
                   STARTUP, "the Lease requests are forbidden")
        assert not any(c.ready() for c in candidates)
    finally:
        apply_role(control_plane.api_client(), deployed[("Role", PICKER)])


def _log(candidate) -> list[dict]:
    import json
    candidate.log_file.flush()
    return [json.loads(line) for line in candidate.log_path.read_text().splitlines()
            if line.startswith("{")]
