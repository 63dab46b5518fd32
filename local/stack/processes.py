"""The stack's processes: starting one (each in its own session, output to its log), health
checks, stopping process groups, CPU accounting, and RunState, the run's record in state.json."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from local.stack.config import REPO, StackConfig, StackError

HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
STATE_FILE = "state.json"


def python_env() -> dict[str, str]:
    """This environment with the repo and picker/src on PYTHONPATH, unbuffered output."""
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "picker" / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_holders(ports: list[int]) -> dict[int, int]:
    """port -> the pid listening on it (TCP, any address), for the ports some process of this
    machine listens on and psutil can see (all of them as root)."""
    import psutil

    wanted, held = set(ports), {}
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return {}
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted and c.pid:
            held.setdefault(c.laddr.port, c.pid)
    return held


def describe_holders(ports: list[int]) -> str:
    """Who holds `ports`, and for leftovers of a local stack of this checkout (a process the
    launcher started: its own session, working directory the repo) the command that frees them."""
    import psutil

    lines, groups = [], []
    for port, pid in sorted(port_holders(ports).items()):
        try:
            proc = psutil.Process(pid)
            cmd, cwd, pgid = " ".join(proc.cmdline())[:120], proc.cwd(), os.getpgid(pid)
        except (psutil.Error, OSError):
            continue
        ours = Path(cwd) == REPO and pgid != os.getpgid(0)
        lines.append(f"  {port}: pid {pid} (process group {pgid}) {cmd}"
                     + (" <- started by a local stack of this checkout" if ours else ""))
        if ours and pgid not in groups:
            groups.append(pgid)
    if groups:
        lines.append("if `make down` (or `python -m local.stack down --name <name>`) finds no stack, these "
                     "are leftovers of one whose record is gone; free the ports with: kill -TERM -- "
                     + " ".join(f"-{g}" for g in groups))
    return "\n".join(lines)


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICK_SPAN = 12000      # ports below the ephemeral range to pick from


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports nobody listens on now (all bound at once, then released).

    Picked at random below the kernel's ephemeral range when there is room there: a stack binds
    its ports seconds after picking them, and a port of the ephemeral range (what binding port 0
    returns) can meanwhile become the local port of any outgoing connection on the machine
    ("address already in use" at the stack's start, seen under parallel test lanes)."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    # SystemRandom: a test that seeds the module RNG must not make parallel lanes pick alike
    candidates = random.SystemRandom().sample(range(low - PICK_SPAN, low), PICK_SPAN) if low - PICK_SPAN >= 1024 else []
    socks: list[socket.socket] = []
    try:
        for port in candidates:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
                socks.append(s)
            except OSError:
                s.close()
        while len(socks) < n:          # no room below the range: any port the kernel gives
            s = socket.socket()
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_ok(url: str, timeout: float = 1.0, headers: dict[str, str] | None = None, cafile: str | None = None) -> bool:
    """GET url answers 200; an https url is verified against `cafile` (the run's CA)."""
    try:
        # the CA file may not exist yet (kube-apiserver writes its certificate as it starts)
        context = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
    except OSError:
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout,
                                    context=context) as r:
            return r.status == 200
    except OSError:
        return False


def grpc_serving(address: str, timeout: float = 1.0, service: str = HEALTH_SERVICE) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat field 22): with the pid,
    it names one process for good, whatever the process later runs or calls itself (vLLM renames
    its processes, and `env ...` execs what it runs)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def group_members(pgid: int, since: int | None = None) -> list[int]:
    """The live processes of process group `pgid` (started at or after `since`, in clock ticks: a
    group whose leader is gone keeps its id, and only processes as old as it can be its members)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields and fields[0] != "Z" and int(fields[2]) == pgid and (since is None or int(fields[19]) >= since):
            members.append(int(entry))
    return members


def is_ours(pid: int, cmd: list[str]) -> bool:
    """The pid still runs the command we started (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return True  # no /proc: trust the state file
    if args[:3] == [c.encode() for c in cmd[:3]]:
        return True
    # a process that rewrote its title into argv[0] (redis-server: "<path> <address>")
    return args[0].startswith(cmd[0].encode() + b" ") and not any(args[1:])


def stop_group(pid: int, timeout: float = 5.0) -> None:
    stop_groups([pid], timeout)


def stop_groups(pids: list[int], timeout: float = 5.0) -> None:
    """SIGTERM the process groups led by pids, then SIGKILL what is left after `timeout`. A group
    counts as stopped when none of its processes is left, its leader's children included (vLLM's
    engine core outlives a killed API server otherwise)."""
    pending = list(pids)
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 2.0)):
        for pid in list(pending):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pending.remove(pid)
        deadline = time.monotonic() + wait
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if alive(p) or group_members(p)]
            if pending:
                time.sleep(0.05)
        if not pending:
            return


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: str
    # "http:<url>", "https:<url>#<CA file>", "https-anonymous:<url>#<CA file>" (without the
    # listeners' API key: kube-apiserver refuses a token it does not know), "grpc:<address>" (the
    # ext_proc service SERVING) or "grpc:<address>#<service>"; several separated by spaces must
    # all pass
    health: str
    pid: int | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    started: int | None = None  # start_time(pid) when spawned: tells our process from a reused pid

    def to_json(self) -> dict:
        return {"name": self.name, "cmd": self.cmd, "log": self.log, "health": self.health, "pid": self.pid,
                "env": self.env, "started": self.started}

    @classmethod
    def from_json(cls, raw: dict) -> "Proc":
        return cls(raw["name"], raw["cmd"], raw["log"], raw["health"], raw.get("pid"), env=raw.get("env") or {},
                   started=raw.get("started"))

    def fresh(self) -> "Proc":
        """The same process, not started."""
        return Proc(self.name, self.cmd, self.log, self.health, env=self.env)

    def running(self) -> bool:
        """Started and still alive: the same process (its start time), or, for a record without
        one, a process still running our command."""
        if not self.pid or not alive(self.pid):
            return False
        if self.started is not None:
            return start_time(self.pid) == self.started
        return is_ours(self.pid, self.cmd)

    def leftovers(self) -> list[int]:
        """What is left of the process group we started: the leader if it runs, else the members
        that outlived it."""
        if not self.pid:
            return []
        if self.running():
            return [self.pid]
        return group_members(self.pid, self.started) if self.started is not None else []

    def healthy(self, headers: dict[str, str] | None = None) -> bool:
        """headers: sent with the http checks (the API key when the listeners need one)."""
        for check in self.health.split():
            kind, _, target = check.partition(":")
            if kind in ("https", "https-anonymous"):
                url, _, cafile = target.partition("#")
                ok = http_ok(url, headers=headers if kind == "https" else None, cafile=cafile)
            elif kind == "http":
                ok = http_ok(target, headers=headers)
            else:
                address, _, service = target.partition("#")
                ok = grpc_serving(address, service=service or HEALTH_SERVICE)
            if not ok:
                return False
        return True


def spawn(p: Proc) -> Proc:
    """Start `p` in its own session (so its whole group can be stopped), output appended to its log."""
    with open(p.log, "ab") as log:
        p.popen = subprocess.Popen(p.cmd, cwd=REPO, env={**python_env(), **p.env}, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    p.pid = p.popen.pid
    p.started = start_time(p.pid)
    return p


def tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_healthy(procs: list[Proc], timeout: float, headers: dict[str, str] | None = None,
                 logs: Path | None = None) -> None:
    """Until every process passes its health check; StackError if one exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen is not None and p.popen.poll() is not None:
                raise StackError(f"{p.name} exited with {p.popen.returncode} while starting; "
                                 f"log {p.log}:\n{tail(p.log)}")
            if p.healthy(headers):
                pending.remove(p)
        if pending and time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise StackError(f"not healthy after {timeout}s: {names}; logs in {logs or Path(pending[0].log).parent}:"
                             f"\n{tail(pending[0].log)}")
        if pending:
            time.sleep(0.1)


def process_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of a process and its children (nan if it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(proc.cpu_times()[:2]) + sum(sum(c.cpu_times()[:2]) for c in proc.children(recursive=True))
    except psutil.Error:
        return float("nan")


def children_cpu_seconds() -> float:
    """user+system CPU seconds of this process's waited-for children so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class RunState:
    """What a stack started, in <run_dir>/state.json, so that `down`, `status` and `reset` from another
    shell find its processes. The only reader and writer of that file in the launcher (loadtest's
    targets.py reads the `config` part to find a stack's ports and speedup)."""

    name: str
    config: StackConfig | None
    procs: list[Proc]
    # CPU seconds of processes `reset` replaced, by name: a demo's CPU table covers every run
    retired_cpu_s: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def file(run_dir: Path) -> Path:
        return Path(run_dir) / STATE_FILE

    @classmethod
    def read(cls, run_dir: Path) -> "RunState | None":
        """The state of the stack in run_dir, None if none was recorded (or it was stopped)."""
        path = cls.file(run_dir)
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        config = StackConfig.from_json(raw["config"], Path(run_dir).parent) if raw.get("config") else None
        return cls(raw.get("name", Path(run_dir).name), config, [Proc.from_json(p) for p in raw["procs"]],
                   dict(raw.get("retired_cpu_s", {})))

    def write(self, run_dir: Path) -> None:
        state = {"name": self.name, **({"config": self.config.to_json()} if self.config else {}),
                 "procs": [p.to_json() for p in self.procs]}
        if self.retired_cpu_s:
            state["retired_cpu_s"] = self.retired_cpu_s
        self.file(run_dir).write_text(json.dumps(state, indent=2))

    @classmethod
    def remove(cls, run_dir: Path) -> None:
        cls.file(run_dir).unlink(missing_ok=True)

    def retire(self, p: Proc) -> None:
        """Stop `p` (a process of this run), keeping the CPU it used."""
        used = process_cpu_seconds(p.pid)
        self.retired_cpu_s[p.name] = self.retired_cpu_s.get(p.name, 0.0) + (0.0 if used != used else used)
        stop_group(p.pid)
