"""How long the project's own checks take: `make check` and `make test` warm (`test-time`), and a
fresh clone's `.ci/run` (`ci-time`: its own virtualenvs and tools, built from the pinned sources;
the machine's Go, pip and apt caches stay warm, so a new machine's downloads come on top).

    python -m bench test-time     # make check twice (the first fills the caches), then make test
    python -m bench ci-time       # git clone of HEAD beside the repo, then its .ci/run (~30 min)

Each run keeps its output (results/bench/<name>-*.log) and pytest's durations, read back for the
report: every pytest run's test count and time, and the slowest tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from bench.common import REPO, RESULTS, load_average, run, save, stamp
from bench.markdown import md_table, num

DURATIONS = "--durations=25 --durations-min=5"
# pytest's summary line, e.g. "753 passed, 3 skipped in 950.12s (0:15:50)"
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)
DURATION = re.compile(r"^(?P<seconds>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)", re.M)
TARGETS = {"make check": 120.0, "make test": 720.0, ".ci/run": 1500.0}  # the targets, seconds


def pytest_runs(log: str) -> list[dict]:
    """Each pytest run of a log: its counts (passed, skipped, ...) and seconds, in order."""
    runs = []
    for m in SUMMARY.finditer(log):
        counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (\w+)", m.group("counts"))}
        runs.append({"counts": counts, "seconds": float(m.group("seconds"))})
    return runs


def slowest(log: str, top: int = 12) -> list[dict]:
    """The slowest test phases pytest reported (setup, call or teardown), slowest first."""
    found = [{"test": m.group("test"), "phase": m.group("phase"), "seconds": float(m.group("seconds"))}
             for m in DURATION.finditer(log)]
    return sorted(found, key=lambda d: -d["seconds"])[:top]


def timed(name: str, key: str, cmd: list[str], cwd: Path | None = None) -> dict:
    """Run `cmd` (in `cwd`, default the repo) with pytest's durations on; its wall time and what
    its log says."""
    log = RESULTS / f"{name}-{key}.log"
    log.unlink(missing_ok=True)
    start_load = load_average()
    if cwd is None:
        wall, code = _run_in(cmd, REPO, log, {"PYTEST_ADDOPTS": DURATIONS, **_repo_path()})
    else:  # another checkout: its own code, not this one's PYTHONPATH
        wall, code = _run_in(cmd, cwd, log, {"PYTEST_ADDOPTS": DURATIONS})
    text = log.read_text(errors="replace")
    # a failing run is timed all the same, and says so: its time is what a developer waited
    return {"command": " ".join(cmd), "wall_s": wall, "exit_code": code, "load_average_start": start_load,
            "load_average_end": load_average(), "pytest": pytest_runs(text), "slowest": slowest(text)}


def _repo_path() -> dict[str, str]:
    from local.stack.processes import python_env
    return {"PYTHONPATH": python_env()["PYTHONPATH"]}


def _run_in(cmd: list[str], cwd: Path, log: Path, extra: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, exit code) of `cmd` in `cwd`, output to `log`."""
    import os
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | extra
    print(f"$ {' '.join(cmd)}  (in {cwd}, output in {log})", flush=True)
    started = time.monotonic()
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return time.monotonic() - started, code


def run_warm() -> dict:
    """`make check` once to fill its caches, then timed; then `make test`."""
    run(["make", "check"], log=RESULTS / "test-time-warmup.log", check=False)
    data = {"check": timed("test-time", "check", ["make", "check"]),
            "test": timed("test-time", "test", ["make", "test"]), **stamp()}
    data["load_average_start"] = data["check"]["load_average_start"]
    save("test-time", data)
    return data


def run_fresh() -> dict:
    """A fresh clone of HEAD beside the repo (so ../shared is where CI has it) and its .ci/run."""
    clone = REPO.parent / f"{REPO.name}-ci-time"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    try:
        data = {"ci": timed("ci-time", "run", ["bash", ".ci/run"], cwd=clone), **stamp()}
    finally:
        shutil.rmtree(clone, ignore_errors=True)
    data["load_average_start"] = data["ci"]["load_average_start"]
    save("ci-time", data)
    return data


def _rows(label: str, d: dict) -> list[list]:
    passed = sum(r["counts"].get("passed", 0) for r in d["pytest"])
    failed = sum(r["counts"].get("failed", 0) + r["counts"].get("error", 0) + r["counts"].get("errors", 0)
                 for r in d["pytest"])
    target = TARGETS[label]
    outcome = f"{passed}" + (f", {failed} failed" if failed else "") + \
        (f" (exit code {d['exit_code']})" if d.get("exit_code") else "")
    # a run that failed did not run everything (a lane stops at its failing suite): not a time to meet
    met = "no (failed)" if d.get("exit_code") else "yes" if d["wall_s"] <= target else "no"
    return [[f"`{label}`", num(d["wall_s"]), f"<= {target:.0f}", met,
             outcome, f"{d['load_average_start']:.1f} / {d['load_average_end']:.1f}"]]


def _slow_lines(d: dict) -> list[str]:
    return [f"- {s['seconds']:.0f} s {s['phase']} `{s['test']}`" for s in d["slowest"]]


def report(d: dict) -> list[str]:
    out = ["Commands: `make check`, then `make test`, warm (virtualenvs, tools and schema caches built; "
           "`make check` ran once before to fill its caches), pytest's durations on "
           f"(`PYTEST_ADDOPTS=\"{DURATIONS}\"`). Load average: the 1-minute one at each command's start "
           "and end (other work on the machine stretches wall times).", ""]
    out += md_table(["command", "wall s", "target s", "met", "tests passed", "load start / end"],
                    _rows("make check", d["check"]) + _rows("make test", d["test"]))
    out += ["", "Each pytest run of `make test` (in the order they finished; lanes run side by side):", ""]
    out += md_table(["tests", "s"], [[", ".join(f"{n} {k}" for k, n in r["counts"].items()), f"{r['seconds']:.0f}"]
                                     for r in d["test"]["pytest"]])
    out += ["", "The slowest test phases of `make test`:", ""] + _slow_lines(d["test"])
    return out


def ci_report(d: dict) -> list[str]:
    ci = d["ci"]
    out = ["Command: `git clone` of the repository beside it, then `bash .ci/run` there (= `make test` "
           "with everything installed from the clone: virtualenvs, Go tools, real vLLM, the tiny model). "
           "The machine's Go module and build caches, pip's cache and Debian's packages were warm, "
           "so a new machine's downloads come on top.", ""]
    out += md_table(["command", "wall s", "target s", "met", "tests passed", "load start / end"],
                    _rows(".ci/run", ci))
    out += ["", "The slowest test phases:", ""] + _slow_lines(ci)
    return out
