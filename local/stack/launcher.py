"""The launcher: `Stack` writes what a configuration's processes read, starts its plan, waits until
every process is healthy, records the run in RunState and stops it all on any failure; `down`,
`status` and `reset` act on a stack started from another shell."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from local import certs, dataplane, ratelimit
from local.stack import control_plane
from local.stack.api_keys import api_keys_secret, bearer, new_api_keys, read_api_keys
from local.stack.config import API_KEYS_FILE, RUN_ROOT, StackConfig, StackError
from local.stack.plan import kv_event_ports, objects_file, picker_timing, plan, tokenizer_dir
from local.stack.processes import (Proc, RunState, alive, describe_holders, port_free, process_cpu_seconds, spawn,
                                   stop_group, stop_groups, wait_healthy)
from local.stack.topology import Topology, listener_ports, picker_tls, topology
from local.tinymodel.tokenizer import ensure_tokenizer

COLD_START = ("sim-", "picker")  # the processes that hold state between runs (caches, prefix index)


class Stack:
    """The whole local stack. Use as a context manager or call start() / stop()."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.procs: list[Proc] = []
        self.topology: Topology | None = None
        self.api_keys: dict[str, str] = read_api_keys(config.api_keys_file) if config.edge_security else {}

    @property
    def state_file(self) -> Path:
        return RunState.file(self.config.run_dir)

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def proc(self, name: str) -> Proc:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def api_key(self, client: str = "loadtest") -> str | None:
        """The throw-away API key of `client` (None without edge security)."""
        return self.api_keys.get(client)

    def auth_headers(self, client: str = "loadtest") -> dict[str, str]:
        """What an OpenAI client sends with its api_key: `Authorization: Bearer <key>`."""
        return bearer(self.api_key(client))

    def listener_ports(self) -> dict[str, int]:
        """Listener name -> local port: the config's, else the cluster port + the local offset."""
        return listener_ports(self.topology, self.config)

    @property
    def http_port(self) -> int:
        return self.listener_ports()["http"]

    @property
    def llm_port(self) -> int:
        return self.listener_ports()["llm-gw"]

    @property
    def picker_tls(self) -> bool:
        return picker_tls(self.topology)

    @property
    def layout(self) -> dataplane.Layout:
        return dataplane.Layout(self.config.run_dir)

    def envoy_admin(self) -> str:
        """Envoy's admin address (http://ip:port); the Host provider lets Envoy choose the port."""
        address = dataplane.admin_address(self.layout)
        if not address:
            raise StackError(f"Envoy's admin address is not known yet (no admin-address.txt under {self.layout.root})")
        return f"http://{address}"

    # -- start -----------------------------------------------------------------------------

    def start(self) -> "Stack":
        c = self.config
        state = RunState.read(c.run_dir)
        live = [p.pid for p in state.procs if p.pid and alive(p.pid)] if state else []
        if live:
            raise StackError(f"stack {c.name!r} is already running (pids {live}); "
                             f"stop it with `python -m local.stack down --name {c.name}`")
        self.check_no_other_data_plane()
        self.topology = topology(c)
        # every replica's ports; the peer port (the 4th) only with several
        pickers = [port for i in range(c.pickers) for j, port in enumerate(c.picker_ports(i))
                   if j != 3 or c.leader_election]
        ports = [s.port for s in self.topology.sims] + [*self.listener_ports().values(), *pickers,
                                                       *kv_event_ports(c, self.topology)]
        if c.token_budget:
            ports += [*dataclasses.astuple(c.ratelimit_ports), ratelimit.XDS_PORT]
        busy = [p for p in ports if not port_free(c.host, p)]
        if busy:
            holders = describe_holders(busy)
            raise StackError(f"ports already in use on {c.host}: {busy} (another stack? `make down`)"
                             + (f"; held by:\n{holders}" if holders else ""))
        try:
            ensure_tokenizer(tokenizer_dir(c))          # the tiny model's: built once, offline
            election = self._start_control_plane() if c.leader_election else None
            procs = plan(c, self.topology, election)
            self._write_inputs()
            if c.leader_election:
                # The picker replicas first: Envoy health-checks each one as soon as it learns of
                # it, and after a check that fails before any traffic has flowed it waits its
                # no-traffic interval (60 s) for the next, meanwhile spreading streams over
                # every replica (panic). base/picker's replicas outlive the Envoy pods; here
                # they would start together.
                first = [p for p in procs if p.name != "envoy-gateway"]
                wait_healthy([self._start(p) for p in first], c.startup_timeout, self.auth_headers(),
                             c.run_dir)
                procs = [p for p in procs if p not in first]
            for p in procs:
                self._start(p)
            wait_healthy(self.procs, c.startup_timeout, self.auth_headers(), c.run_dir)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_control_plane(self) -> tuple[Path, str]:
        """etcd and kube-apiserver for the picker replicas' Lease, healthy, with the picker's RBAC
        objects of the render; the replicas' kubeconfig and the Lease's namespace."""
        c = self.config
        c.run_dir.mkdir(parents=True, exist_ok=True)
        cp = control_plane.layout(c)
        started = [self._start(p) for p in control_plane.procs(c, cp)]
        wait_healthy(started, c.startup_timeout, None, c.run_dir)
        return control_plane.bootstrap(c, cp, self.topology.docs)

    def check_no_other_data_plane(self) -> None:
        """Standalone Envoy Gateway binds fixed ports and Envoy its hot-restart socket: one data plane
        per machine (network namespace). Fail before anything starts, naming the cause."""
        busy = dataplane.busy_ports()
        if busy or dataplane.envoy_running():
            what = f"ports {busy} are in use" if busy else "an Envoy already runs (its hot-restart socket exists)"
            raise StackError(f"another Envoy Gateway or Envoy runs on this machine: {what}. Only one local "
                             "stack can run at a time: stop the other one (`make down`, or "
                             "`python -m local.stack down --name <name>`)")

    def _write_inputs(self) -> None:
        """What the plan's processes read: the picker's objects; Envoy Gateway's folders, certificates
        and the rendered gateway objects, localized, with the API keys' Secret."""
        c, topo, layout = self.config, self.topology, self.layout
        c.run_dir.mkdir(parents=True, exist_ok=True)
        objects_file(c).write_text(yaml.safe_dump_all(topo.objects, sort_keys=False))
        dataplane.prepare(layout, self.envoy_gateway_settings())
        certgen = subprocess.run([str(dataplane.envoy_gateway_binary()), "certgen", "--local", "--config-home",
                                  str(layout.config_home)], capture_output=True, text=True)
        if certgen.returncode != 0:
            raise StackError(f"envoy-gateway certgen failed: {certgen.stderr.strip()[-2000:]}")
        resources = dataplane.localize(
            topo.gateway,
            {name: [(a.split(":")[0], int(a.split(":")[1])) for a in addresses]
             for name, addresses in topo.services.items()},
            [(c.host, c.picker_ports(i)[0]) for i in range(c.pickers)], self.listener_ports(),
            outcomes=[(c.host, c.picker_ports(i)[4]) for i in range(c.pickers)])
        if c.edge_security:
            self.api_keys = new_api_keys(c.api_keys_file)
            resources += [api_keys_secret(topo.gateway, self.api_keys)]
        if c.tls:
            resources += certs.secrets_for(topo.gateway, certs.write_run_certs(c.certs_dir))
        if c.token_budget:
            gateway = next(d for d in topo.gateway if d.get("kind") == "Gateway")
            resources += [ratelimit.cluster_patch(gateway, layout.config_home / "certs", c.ratelimit_ports)]
        dataplane.write_atomically(layout.resources / "gateway.yaml", dataplane.dump(resources))

    def envoy_gateway_settings(self) -> dict:
        """Envoy Gateway's config beyond the data plane's own: Lua, EnvoyPatchPolicy and the global
        rate limit for the token budget."""
        if not self.config.token_budget:
            return {}
        return {"extensionApis": {"enableLua": True, "enableEnvoyPatchPolicy": True},
                **ratelimit.envoy_gateway_settings(self.config.ratelimit_ports)}

    def _start(self, p: Proc) -> Proc:
        self.procs.append(spawn(p))
        RunState(self.config.name, self.config, self.procs).write(self.config.run_dir)
        return p

    # -- stop ------------------------------------------------------------------------------

    def stop_process(self, name: str) -> None:
        p = self.proc(name)
        if p.pid is not None:
            stop_group(p.pid)
        if p.popen is not None:
            p.popen.wait(timeout=10)

    def restart_process(self, *names: str) -> None:
        """Start stopped processes again with the same commands and wait until they are healthy."""
        fresh = []
        for name in names:
            p = self.proc(name)
            self.procs.remove(p)
            fresh.append(p.fresh())
            self._start(fresh[-1])
        wait_healthy(fresh, self.config.startup_timeout, self.auth_headers(), self.config.run_dir)

    def kill_process(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send sig to the process's group and wait for it to exit."""
        p = self.proc(name)
        os.killpg(p.pid, sig)
        if p.popen is not None:
            p.popen.wait(timeout=10)

    def signal_process(self, name: str, sig: int, group: bool = True) -> None:
        """Send sig to the process (group: and its children, as a container's whole cgroup gets
        SIGKILL or is frozen; else the main process only, as Kubernetes sends SIGTERM to PID 1)
        without waiting."""
        p = self.proc(name)
        (os.killpg if group else os.kill)(p.pid, sig)

    def stop(self) -> None:
        live = [p.pid for p in self.procs if p.pid is not None]
        state = RunState.read(self.config.run_dir)
        if state:  # `reset` from another process may have restarted some
            live += [p.pid for p in state.procs if p.pid not in live and p.running()]
        stop_groups(live)
        for p in self.procs:
            if p.popen is not None:
                try:
                    p.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        RunState.remove(self.config.run_dir)

    # -- measurement -------------------------------------------------------------------------

    def cpu_seconds(self) -> dict[str, float]:
        """user+system CPU seconds so far, per process name (with its children), including what
        the processes `reset` replaced used before they were stopped."""
        state = RunState.read(self.config.run_dir)
        retired = state.retired_cpu_s if state else {}
        pids = ({p.name: p.pid for p in state.procs} if state else {}) or {p.name: p.pid for p in self.procs}
        return {name: process_cpu_seconds(pid) + retired.get(name, 0.0) for name, pid in pids.items()}


def describe(stack: Stack) -> str:
    c = stack.config
    lines = [f"local stack {c.name!r} is up (logs and state in {c.run_dir}):"]
    kind = "vLLM 0.32 CPU" if c.engine == "vllm" else "simulator"
    for s in stack.topology.sims:
        lines.append(f"  {kind:<14} {s.address}  serves {' '.join(s.served_model_names)}  ({s.lws})")
    for i in range(c.pickers):
        grpc, health, metrics, peer, outcomes = c.picker_ports(i)
        lines.append(f"  {c.picker_name(i):<14} ext_proc {c.host}:{grpc} ({'TLS' if stack.picker_tls else 'plaintext'}, "
                     f"{stack.topology.body_mode}), health {health}, metrics http://{c.host}:{metrics}/metrics, "
                     f"outcomes {outcomes}" + (f", peer link {peer}" if c.leader_election else ""))
    if c.leader_election:
        lines.append(f"                 active-passive on the Lease reasoning-pool-picker of kube-apiserver "
                     f"(log {c.run_dir / 'kube-apiserver.log'}); the acting one answers `readiness` SERVING")
    timing = picker_timing(c)
    if timing is not None:
        lines.append(f"                 scrapes every {timing.scrape_interval * 1000:.0f} ms wall = "
                     f"{timing.model_scrape_interval:g} s model time (speedup {c.speedup:g}), "
                     f"staleness {timing.model_staleness:g} s model time")
    lines.append(f"  envoy-gateway  {dataplane.EG_VERSION} standalone, Envoy {dataplane.ENVOY_VERSION}: "
                 f"http://{c.host}:{stack.http_port} (listener http, least request), "
                 f"http://{c.host}:{stack.llm_port} (listener llm-gw, picker)")
    try:
        lines.append(f"                 Envoy admin and stats {stack.envoy_admin()}/stats")
    except StackError:
        pass
    if stack.api_keys:
        lines.append(f"  API keys       {', '.join(stack.api_keys)} in {c.api_keys_file} (both listeners need one):")
        lines.append(f"                 export OPENAI_API_KEY=$(python -m local.stack key --name {c.name} --client user)")
    else:
        lines.append("  API keys       none (--no-edge-security): both listeners are open")
    return "\n".join(lines)


# -- a stack started from another shell -------------------------------------------------------

def _recorded(name: str, run_root: Path) -> tuple[Path, RunState | None]:
    """The run folder of stack `name` and what it recorded (None: no such stack runs)."""
    run_dir = Path(run_root) / name
    return run_dir, RunState.read(run_dir)


def down(name: str, run_root: Path = RUN_ROOT) -> int:
    run_dir, state = _recorded(name, run_root)
    if state is None:
        print(f"no running stack {name!r} ({RunState.file(run_dir)} not found)")
        return 0
    ours = [p for p in state.procs if p.leftovers()]
    stop_groups([p.pid for p in ours])
    for p in ours:
        print(f"stopped {p.name} (pid {p.pid})")
    left = {p.name: p.leftovers() for p in state.procs}
    left = {name: pids for name, pids in left.items() if pids}
    if left:  # keep the record: it is what finds them next time
        print(f"still running after SIGKILL: {left}; state kept in {RunState.file(run_dir)}", file=sys.stderr)
        return 1
    RunState.remove(run_dir)
    return 0


def reset(name: str, run_root: Path = RUN_ROOT, timeout: float = 60.0) -> int:
    """Restart the simulators and the picker of a running stack, so the next run starts cold:
    empty KV and prefix caches, no prefix index, no in-flight counts. Envoy keeps running."""
    run_dir, state = _recorded(name, run_root)
    if state is None:
        print(f"no running stack {name!r} ({RunState.file(run_dir)} not found)", file=sys.stderr)
        return 1
    fresh = []
    for i, p in enumerate(state.procs):
        if not p.name.startswith(COLD_START):
            continue
        if p.running():
            state.retire(p)
        state.procs[i] = spawn(p.fresh())
        fresh.append(state.procs[i])
    state.write(run_dir)
    deadline = time.monotonic() + timeout
    while not all(p.healthy() for p in fresh):
        if time.monotonic() > deadline:
            print(f"not healthy {timeout:.0f}s after the restart: "
                  f"{', '.join(p.name for p in fresh if not p.healthy())}", file=sys.stderr)
            return 1
        time.sleep(0.1)
    return 0


def status(name: str, run_root: Path = RUN_ROOT) -> int:
    run_dir, state = _recorded(name, run_root)
    if state is None:
        print(f"no running stack {name!r}")
        return 1
    bad = 0
    headers = bearer(read_api_keys(run_dir / API_KEYS_FILE).get("loadtest"))
    for p in state.procs:
        running = bool(p.pid) and alive(p.pid)
        healthy = running and p.healthy(headers)
        bad += not healthy
        print(f"{p.name:<12} pid {p.pid:<8} {'healthy' if healthy else 'DOWN' if not running else 'unhealthy'}"
              f"  log {p.log}")
    return 1 if bad else 0
