"""Shared helpers: where results go, machine facts, running a command and timing it, saving and
reading the JSON summaries."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from local.stack.processes import python_env

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results" / "bench"
PY = sys.executable


def machine() -> dict:
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gb = int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": cpu_model or platform.processor(),
            "memory_gb": round(mem_gb, 1) if mem_gb else None, "python": platform.python_version(),
            "kernel": platform.release()}


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def run(cmd: list[str], log: Path | None = None, check: bool = True, env: dict[str, str] | None = None) -> float:
    """Run cmd from the repo root (output to log, or inherited; `env` added to the environment);
    returns its wall seconds."""
    print("$ " + shlex.join(cmd), flush=True)
    started = time.monotonic()
    env = python_env() | (env or {})
    if log is None:
        rc = subprocess.call(cmd, cwd=REPO, env=env)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            rc = subprocess.call(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    if check and rc != 0:
        where = f"; output in {log}" if log else ""
        raise RuntimeError(f"{shlex.join(cmd)} exited with {rc}{where}")
    return wall


def shown(cmd: list[str]) -> str:
    """cmd as a reader would type it: `python` for this interpreter, paths relative to the repo."""
    return " ".join(["python", *cmd[1:]]).replace(str(REPO) + "/", "")


def save(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path.relative_to(REPO)}", flush=True)
    return path


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def stamp() -> dict:
    return {"finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average_end": load_average()}


def run_suite(name: str, cmd: list[str], loader, log: Path | None = None, command: str | None = None,
              env: dict[str, str] | None = None, **fields) -> dict:
    """Run `cmd` once, timed (output to `log`, or shown), and save results/bench/<name>.json: the
    command (`command`, else as typed), `fields`, the wall time, the load average before and after,
    and what `loader()` reads from the run's output (a dict). `env`: added to the environment."""
    load_start = load_average()
    wall = run(cmd, log=log, env=env)
    data = {"command": command or shown(cmd), **fields, "wall_s": wall, "load_average_start": load_start,
            **loader(), **stamp()}
    save(name, data)
    return data


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def run_suites(name: str, runs: dict[str, tuple[list[str], Path]]) -> dict:
    """Several commands timed one after the other (`runs`: key -> (command, the JSON it writes);
    output to results/bench/<name>-<key>.log), saved as results/bench/<name>.json: each command and
    result by key, the total wall time, the load average before and after."""
    load_start = load_average()
    results, commands, wall = {}, {}, 0.0
    for key, (cmd, result) in runs.items():
        wall += run(cmd, log=RESULTS / f"{name}-{key}.log")
        results[key] = read_json(result)
        commands[key] = shown(cmd)
    data = {"commands": commands, "wall_s": wall, "load_average_start": load_start, "runs": results,
            **stamp()}
    save(name, data)
    return data


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
