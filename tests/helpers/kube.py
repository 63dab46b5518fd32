"""The real control plane's pieces the API server and autoscaling tests share: where the binaries
are (built by `make tools`; etcd from Debian), polling with a bound, kube-controller-manager
running only its HPA controller, and the picker as deployed (`--discovery kubernetes`) on a
kubeconfig."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from validation.apiserver import free_port

ROOT = Path(__file__).resolve().parents[2]
KUBE_APISERVER = Path(os.environ.get("KUBE_APISERVER", ROOT / ".tools" / "bin" / "kube-apiserver"))
KUBE_CONTROLLER_MANAGER = Path(os.environ.get("KUBE_CONTROLLER_MANAGER",
                                              ROOT / ".tools" / "bin" / "kube-controller-manager"))
ETCD = os.environ.get("ETCD", "etcd")

NAMESPACE = "llm"
POOL = "reasoning-pool"
PICKER = "inference-gateway-ext-proc"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
STARTUP = 60.0   # seconds for the picker process to start (imports; slow on a busy machine)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll until predicate() is truthy; returns the seconds it took, fails after `timeout`."""
    started = time.monotonic()
    while True:
        value = predicate()
        if value:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            pytest.fail(f"not within {timeout}s: {what}")
        time.sleep(interval)


def start_hpa_controller(kubeconfig: Path, workdir: Path, sync_s: float) -> subprocess.Popen:
    """kube-controller-manager running only its HPA controller, every `sync_s` seconds."""
    return subprocess.Popen([str(KUBE_CONTROLLER_MANAGER), f"--kubeconfig={kubeconfig}",
                             "--controllers=horizontalpodautoscaling", "--leader-elect=false",
                             "--secure-port=0", f"--horizontal-pod-autoscaler-sync-period={sync_s}s"],
                            stdout=(workdir / "kube-controller-manager.log").open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


class Picker:
    def __init__(self, kubeconfig, log_path, ports: tuple[int, int, int] | None = None):
        """`ports` (gRPC, health, metrics): a restarted picker keeps its predecessor's."""
        self.kubeconfig = kubeconfig
        self.grpc_port, self.health_port, self.metrics_port = ports or (free_port(), free_port(), free_port())
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        env["KUBECONFIG"] = str(kubeconfig)
        self.log_path, self.log_file = log_path, log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "picker", "--discovery", "kubernetes", "--pool-name", POOL,
             "--pool-namespace", NAMESPACE, "--no-secure-serving", "--bind", "127.0.0.1",
             "--grpc-port", str(self.grpc_port), "--health-port", str(self.health_port),
             "--metrics-port", str(self.metrics_port), "--outcomes-port", "0"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log_file)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.health_port}")
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def serving(self) -> bool | None:
        """True/False from the gRPC health check; None while the server is not up."""
        assert self.proc.poll() is None, self.log_path.read_text()[-2000:]
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=1)
        except grpc.RpcError:
            return None
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def endpoints(self) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
            text = r.read().decode()
        return sorted(re.findall(r'^picker_endpoint_ready\{endpoint="([^"]+)"\}', text, re.M))

    def log(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def stop(self):
        self.channel.close()
        end_process(self.proc)
        self.log_file.close()


def end_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after `timeout` s; nothing to do for a process already gone."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
