"""The scale-down drain of components/autoscaling, executed: the leader's and the worker's preStop
commands exactly as overlays/a10-autoscaling renders them, run against a simulated vLLM.

The hooks address the pod's own vLLM at 127.0.0.1:8000 (the leader) and the leader's at
$LWS_LEADER_ADDRESS:8000 (the worker). Each test gets a network namespace of its own (`ip netns`,
root), so that port 8000 is the simulator's there and nothing on the machine is disturbed, and the
commands run unchanged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from validation.manifests import of_kind
from validation.render import kustomize

REPO = Path(__file__).resolve().parents[2]
OVERLAY = "overlays/a10-autoscaling"
SETTLE_S = 15.0          # what the leader's hook waits first, for the picker and Envoy to stop sending
POLL_S = 5.0             # how often both hooks look again
SLACK_S = 4.0            # process start and a busy 2-core machine


@pytest.fixture(scope="module")
def hooks() -> dict[str, list[str]]:
    rendered = kustomize(REPO, OVERLAY)
    assert not rendered.problems, rendered.problems
    (lws,) = of_kind(rendered.objects, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    return {role: template[f"{role}Template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
            for role in ("leader", "worker")}


class Namespace:
    """A network namespace with loopback up; `run`/`spawn` execute a command inside it."""

    def __init__(self) -> None:
        self.name = f"drain-{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.procs: list[subprocess.Popen] = []
        subprocess.run(self.inside(["ip", "link", "set", "lo", "up"]), check=True)

    def inside(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def spawn(self, cmd: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(self.inside(cmd), cwd=REPO, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        subprocess.run(["ip", "netns", "delete", self.name], check=False)


@pytest.fixture
def netns():
    ns = Namespace()
    yield ns
    ns.close()


def start_vllm(ns: Namespace) -> subprocess.Popen:
    sim = ns.spawn([sys.executable, "-m", "local.sim", "--host", "127.0.0.1", "--port", "8000",
                    "--engine-model", "a10-qwq32b"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = ("import urllib.request,time\n"
             "for _ in range(300):\n"
             "    try: urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=1); break\n"
             "    except OSError: time.sleep(0.1)\n"
             "else: raise SystemExit('the simulator did not start')\n")
    subprocess.run(ns.inside([sys.executable, "-c", probe]), check=True, timeout=60)
    return sim


def start_request(ns: Namespace, max_tokens: int) -> subprocess.Popen:
    """A completion in flight; it prints the time it ended."""
    body = json.dumps({"model": "qwq", "prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True})
    code = ("import time,urllib.request\n"
            f"req = urllib.request.Request('http://127.0.0.1:8000/v1/completions', data={body!r}.encode(),"
            " headers={'content-type': 'application/json'})\n"
            "urllib.request.urlopen(req, timeout=300).read()\n"
            "print(time.time())\n")
    return ns.spawn([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def run_hook(ns: Namespace, command: list[str], env: dict | None = None) -> subprocess.Popen:
    return ns.spawn(command, env={**os.environ, **(env or {})})


def until_running(ns: Namespace, n: int) -> None:
    probe = ("import re,time,urllib.request\n"
             "for _ in range(300):\n"
             "    page = urllib.request.urlopen('http://127.0.0.1:8000/metrics').read().decode()\n"
             "    if sum(float(v) for v in re.findall(r'^vllm:num_requests_running\\{[^}]*\\} (\\S+)$', page, re.M))"
             f" >= {n}: break\n"
             "    time.sleep(0.1)\n"
             "else: raise SystemExit('the request never started')\n")
    subprocess.run(ns.inside([sys.executable, "-c", probe]), check=True, timeout=60)


def test_the_leader_waits_until_vllm_has_finished_what_it_serves(netns, hooks):
    """Over 30 s: the hook as rendered waits its settling time (15 s) and polls every 5 s until the
    request it must let finish (~25 s of A10 time) has ended."""
    start_vllm(netns)
    request = start_request(netns, max_tokens=300)          # ~25 s on the A10 timings
    until_running(netns, 1)
    started = time.time()
    hook = run_hook(netns, hooks["leader"])
    hook.wait(timeout=600)
    hook_done = time.time()
    request_done = float(request.communicate(timeout=60)[0])
    assert hook.returncode == 0
    assert request_done - started > SETTLE_S, "the request ended before the hook looked; make it longer"
    assert hook_done >= request_done, "the hook let the pod stop while vLLM still served a request"
    assert hook_done - request_done <= POLL_S + SLACK_S


def test_the_leader_of_an_idle_vllm_stops_after_the_settling_time(netns, hooks):
    start_vllm(netns)
    started = time.time()
    hook = run_hook(netns, hooks["leader"])
    hook.wait(timeout=120)
    took = time.time() - started
    assert hook.returncode == 0
    assert SETTLE_S <= took <= SETTLE_S + SLACK_S


def test_the_leader_stops_at_once_when_its_vllm_is_gone(netns, hooks):
    started = time.time()
    hook = run_hook(netns, hooks["leader"])                   # nothing listens on 8000
    hook.wait(timeout=120)
    took = time.time() - started
    assert hook.returncode == 0
    assert SETTLE_S <= took <= SETTLE_S + SLACK_S


def test_the_worker_holds_its_stage_until_the_leaders_api_is_gone(netns, hooks):
    sim = start_vllm(netns)
    hook = run_hook(netns, hooks["worker"], env={"LWS_LEADER_ADDRESS": "127.0.0.1"})
    time.sleep(2 * POLL_S)
    assert hook.poll() is None, "the worker left while its leader still served"
    sim.kill()
    sim.wait()
    gone = time.time()
    hook.wait(timeout=60)
    assert hook.returncode == 0
    assert time.time() - gone <= POLL_S + SLACK_S
