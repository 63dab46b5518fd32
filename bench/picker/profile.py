"""Where the ext_proc server's CPU goes, part `profile` of `python -m bench.picker`.

Each server (compiled, Python) as the null server and with a Router on 16 endpoints, buffered
bodies, 64 streams closed loop: `perf record -e cpu-clock` samples the server process (every
thread) while the load client runs, and every sample is put in one bucket by the shared object
it was taken in (the kernel, gRPC's C core, protobuf, the interpreter, uvloop, the compiled
transport, libc) and by the thread (the Python thread, gRPC's or the transport's threads).
Shares of samples times the run's server CPU per decision give milliseconds per decision.
`perf` comes from Debian's linux-perf; without it this part is skipped.
"""
from __future__ import annotations

import multiprocessing as mp
import re
import shutil
import subprocess
import tempfile
import time

# shared object (a regular expression on perf's dso column) -> bucket, first match wins
BUCKETS = [
    (r"\[kernel", "kernel (syscalls, loopback TCP, thread wake-ups)"),
    (r"cygrpc", "gRPC C core + its Cython layer"),
    (r"_message|upb|protobuf", "protobuf (upb)"),
    (r"_extproc", "compiled transport (tonic, h2, prost, tokio)"),
    (r"^loop\.cpython|uvloop", "uvloop"),
    (r"libpython|^python|_asyncio|_json|_struct|_heapq|_bisect|_random|math\.cpython", "Python interpreter"),
    (r"libc\.so|ld-linux|libstdc\+\+|libgcc|\[vdso\]|libm\.so", "libc (memcpy, malloc, locks)"),
]
OTHER = "other native modules (xxhash, msgspec, ...)"
THREADS = [(r"^python", "Python thread"), (r"extproc", "transport threads"),
           (r"event_engine|grpc|default-execu|timer", "gRPC core threads")]


def perf_available() -> bool:
    if shutil.which("perf") is None:
        return False
    return subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", "/dev/null", "--", "true"],
                          capture_output=True).returncode == 0


def _bucket(name: str, table: list[tuple[str, str]], other: str) -> str:
    return next((label for pattern, label in table if re.search(pattern, name)), other)


def _shares(data: str, key: str, table, other) -> dict[str, float]:
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", key, "--stdio",
                          "--percent-limit", "0"], capture_output=True, text=True).stdout
    shares: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S.*?)\s*$", line)
        if m and not line.lstrip().startswith("#"):
            label = _bucket(m.group(2), table, other)
            shares[label] = shares.get(label, 0.0) + float(m.group(1)) / 100
    return shares


def profile(server: str, n: int | None, seconds: float, bodies: str) -> dict:
    from bench.picker.service import _cpu_seconds, _load_client, _serve, _serve_null
    ctx = mp.get_context("spawn")
    q, ctl, timings = ctx.Queue(), ctx.Queue(), ctx.Queue()
    target, args = (_serve_null, (q, server)) if n is None else (_serve, (n, q, ctl, timings, server))
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        port = q.get(timeout=60)
        _load_client(port, bodies, "buffered", 1.0, 64)  # warm-up
        with tempfile.TemporaryDirectory() as tmp:
            data = f"{tmp}/perf.data"
            perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "499", "-p", str(proc.pid),
                                     "-o", data, "--", "sleep", str(max(1.0, seconds - 1.0))],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            cpu0, t0 = _cpu_seconds(proc.pid), time.perf_counter()
            r = _load_client(port, bodies, "buffered", seconds, 64)
            cpu = _cpu_seconds(proc.pid) - cpu0
            perf.wait(timeout=60)
            by_dso = _shares(data, "dso", BUCKETS, OTHER)
            by_thread = _shares(data, "comm", THREADS, "other threads")
    finally:
        proc.terminate()
        proc.join()
    per = 1000 * cpu / max(1, r["requests"])
    return {"server": server, "endpoints": n, "mode": "buffered", "decisions_per_s": r["decisions_per_s"],
            "server_cpu_ms_per_request": per, "server_cpu_cores": cpu / (time.perf_counter() - t0),
            "by_dso_ms": {k: v * per for k, v in sorted(by_dso.items(), key=lambda kv: -kv[1])},
            "by_thread_ms": {k: v * per for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1])}}


def run(servers: list[str], seconds: float, bodies: str, say=print) -> list[dict] | None:
    if not perf_available():
        say("\nprofile: skipped (perf is missing or cannot sample here: apt-get install linux-perf)")
        return None
    say("\nwhere the server's CPU goes (perf, buffered, 64 streams; ms of CPU per decision):")
    out = []
    for n in (None, 16):
        for server in servers:
            p = profile(server, n, seconds, bodies)
            out.append(p)
            label = "null server" if n is None else f"{n} endpoints"
            say(f"  {label:>12} {server:>6}: {p['server_cpu_ms_per_request']:.3f} ms = "
                + ", ".join(f"{k} {v:.3f}" for k, v in p["by_dso_ms"].items() if v >= 0.005))
    return out
