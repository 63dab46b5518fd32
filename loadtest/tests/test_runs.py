"""Whole runs (locust in subprocesses) against fake servers with known timings."""
import glob
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.tests.conftest import REPO, env_with_repo
from loadtest.metrics import read_samples
from loadtest.workloads import build_workload

pytestmark = pytest.mark.server  # starts other programs as processes

LOCUST = str(Path(sys.executable).with_name("locust"))


def run(cmd, timeout=120):
    return subprocess.run(cmd, cwd=REPO, env=env_with_repo(), capture_output=True, text=True,
                          timeout=timeout)


def test_compare_measures_known_timings_and_writes_the_report(fake_server, tmp_path):
    fast = fake_server("--ttft", "0.05", "--itl", "0.01")
    slow = fake_server("--ttft", "0.25", "--itl", "0.03", "--fail-every", "4")
    out = tmp_path / "cmp"
    proc = run([sys.executable, "-m", "loadtest", "compare", "--host", "127.0.0.1",
                "--ports", str(fast), str(slow), "--workload", "smoke", "--seed", "0",
                "--repetitions", "2", "--out", str(out),
                "--metrics-endpoints", f"http://127.0.0.1:{fast}", f"http://127.0.0.1:{slow}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = json.loads((out / f"{fast}.json").read_text())
    b = json.loads((out / f"{slow}.json").read_text())
    # 2 repetitions x 12 prompts per port; every 4th request to the slow server fails
    assert a["completed"] == 24 and a["failed"] == 0
    assert b["completed"] == 18 and b["failed"] == 6
    assert b["errors_by_reason"] == {"HTTP 500: injected failure": 6}
    # server-side timings are known; the machine is shared, so allow generous overheads
    assert 45 <= a["median_ttft_ms"] <= 150 and 245 <= b["median_ttft_ms"] <= 400
    assert 8 <= a["mean_tpot_ms"] <= 20 and 26 <= b["mean_tpot_ms"] <= 45  # chunks scheduled from arrival: a late first chunk shortens TPOT
    assert 9 <= a["median_itl_ms"] <= 20
    samples = read_samples(out / f"{fast}-rep1.samples.jsonl")
    assert sum(s.output_tokens for s in samples) == a["total_output_tokens"] / 2
    specs = build_workload("smoke", seed=0)                   # fake server counts words too
    assert sorted(s.prompt_tokens for s in samples) == sorted(p.prompt_tokens for p in specs)
    meta = json.loads((out / "compare.json").read_text())
    assert [(r["port"], r["rep"]) for r in meta["runs"]] == \
        [(fast, 1), (slow, 1), (slow, 2), (fast, 2)]          # order alternates
    load = [json.loads(l) for l in (out / f"{slow}-rep1.load.jsonl").read_text().splitlines()]
    assert {r["endpoint"] for r in load} == {f"http://127.0.0.1:{fast}",
                                              f"http://127.0.0.1:{slow}"}
    report = (out / "report.md").read_text()
    assert "| Mean TTFT (ms) |" in report and "injected failure" in report
    assert "| Mean TTFT (ms) |" in proc.stdout                # table printed for make demo
    # the headline says what ran and how to read the times; 2 repetitions show their spread
    assert "workload smoke" in proc.stdout and "times are wall clock" in proc.stdout
    assert "2 repetitions per port (value and min-max)" in report
    assert re.search(r"\| Mean TTFT \(ms\) \| [\d.,]+ \([\d.,]+-[\d.,]+\) \|", report)
    # no duplicates: the port's JSON sums the runs, the samples live only with the runs
    assert not (out / f"{fast}.samples.jsonl").exists()
    for png in ("ttft_cdf.png", "latency_over_time.png", "endpoint_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_locust_headless_chat_run_survives_broken_streams(fake_server, tmp_path):
    port = fake_server("--ttft", "0.02", "--itl", "0.005", "--broken-every", "3")
    proc = run([LOCUST, "-f", "loadtest/locustfile.py", "--headless", "-u", "3", "-r", "3",
                "--host", "http://127.0.0.1", "--ports", str(port), "--workload", "smoke",
                "--endpoint", "chat", "--objective", "critical", "--num-prompts", "9",
                "--result-dir", str(tmp_path), "--only-summary"])
    result = json.loads(Path(glob.glob(str(tmp_path / "run-*.json"))[0]).read_text())
    assert result["completed"] == 6 and result["failed"] == 3, proc.stderr[-2000:]
    assert list(result["errors_by_reason"]) == [
        "broken SSE: not JSON (Expecting property name enclosed in double quotes): '{not json'"]
    # one locust entry per request: 9 requests, 3 failures, no extra metric rows
    assert re.search(rf"^POST\s+{port} /v1/chat/completions\s+9\s+3\(", proc.stderr, re.M)
    assert not re.search(r"^(TTFT|TPOT|E2E)\s", proc.stderr, re.M)
    assert re.search(r"^\s+Aggregated\s+9\s+3\(", proc.stderr, re.M)


def test_distributed_master_collects_samples_from_workers(fake_server, tmp_path):
    """A/B over two workers: the master opens port 2's phase when port 1's is answered."""
    port = fake_server("--ttft", "0.02", "--itl", "0.005")
    other = fake_server("--ttft", "0.02", "--itl", "0.005")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master_port = s.getsockname()[1]
    common = [LOCUST, "-f", "loadtest/locustfile.py"]
    workers = [subprocess.Popen(common + ["--worker", "--master-host", "127.0.0.1",
                                          "--master-port", str(master_port)],
                                cwd=REPO, env=env_with_repo(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        proc = run(common + ["--master", "--master-bind-host", "127.0.0.1",
                             "--master-bind-port", str(master_port), "--expect-workers", "2",
                             "--headless", "-u", "4", "-r", "4", "--host", "http://127.0.0.1",
                             "--ports", f"{port},{other}", "--workload", "smoke",
                             "--num-prompts", "14",
                             "--result-dir", str(tmp_path), "--only-summary"])
    finally:
        for w in workers:  # they quit when the master tells them to
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(Path(glob.glob(str(tmp_path / "run-*.json"))[0]).read_text())
    assert result["completed"] == 28 and result["num_prompts"] == 14 and result["mode"] == "ab"
    samples = read_samples(next(tmp_path.glob("run-*.samples.jsonl")))
    first = [s for s in samples if s.target == str(port)]
    second = [s for s in samples if s.target == str(other)]
    assert len(first) == len(second) == 14
    assert max(s.end for s in first) <= min(s.start for s in second)   # one phase after the other



def test_compare_and_sweep_without_a_listener_say_what_to_run(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        silent = s.getsockname()[1]
    for command in ("compare", "sweep"):
        out = tmp_path / command
        proc = run([sys.executable, "-m", "loadtest", command, "--ports", str(silent),
                    "--workload", "smoke", "--out", str(out)])
        assert proc.returncode == 2 and not out.exists()
        assert f"127.0.0.1:{silent} (ConnectionRefusedError" in proc.stderr
        assert "make up" in proc.stderr and "Traceback" not in proc.stderr


def streaming(port: int) -> bool:
    """The fake server has a request in flight (its /metrics' running gauge)."""
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return 'vllm:num_requests_running{model_name="qwq"} 0\n' not in r.read().decode()


def test_ctrl_c_stops_with_one_line_and_removes_an_empty_folder(fake_server, tmp_path):
    port = fake_server("--ttft", "2", "--itl", "0.5")
    out = tmp_path / "cmp"
    proc = subprocess.Popen([sys.executable, "-m", "loadtest", "compare", "--ports", str(port),
                             "--workload", "smoke", "--metrics-endpoints", "none",
                             "--out", str(out)], cwd=REPO, env=env_with_repo(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Interrupt once the first run streams (a request in flight at the server): earlier, a loaded
    # machine could still be starting locust, later the run could be over.
    deadline = time.monotonic() + 60
    while not streaming(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.exists(), "the run started without its folder"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, (stdout[-1000:], stderr[-2000:])
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert stderr.count("interrupted:") == 1 and f"{out}/ removed" in stderr
    assert not out.exists()


def test_sweep_runs_each_port_at_each_rate_and_plots_ttft_and_goodput(fake_server, tmp_path):
    fast = fake_server("--ttft", "0.05", "--itl", "0.01")
    slow = fake_server("--ttft", "0.4", "--itl", "0.01")
    out = tmp_path / "sweep"
    proc = run([sys.executable, "-m", "loadtest", "sweep", "--ports", str(fast), str(slow),
                "--workload", "smoke", "--rates", "4", "16", "--goodput", "ttft:250",
                "--percentiles", "50,90", "--label", "try", "--speedup", "1",
                "--metrics-endpoints", "none", "--out", str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((out / "sweep.json").read_text())
    assert [(r["port"], r["rate"]) for r in meta["runs"]] == \
        [(fast, 4.0), (slow, 4.0), (slow, 16.0), (fast, 16.0)]      # order alternates
    for port, goodput in ((fast, True), (slow, False)):
        for rate in ("4", "16"):
            r = json.loads((out / f"{port}-rate{rate}.json").read_text())
            assert r["completed"] == 12 and r["label"] == f"try port {port}"
            assert "p90_ttft_ms" in r and "p99_ttft_ms" not in r
            # every fast request meets TTFT <= 250 ms, no slow one does
            assert (r["request_goodput"] > 0) == goodput
            assert r["request_goodput"] in (0, r["request_throughput"]) or not goodput
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "ttft <= 250 ms" in report and "times are wall clock (= model time" in report
    assert "| 16 |" in proc.stdout


def test_locust_run_does_not_start_when_a_port_is_silent(fake_server, tmp_path):
    port = fake_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        silent = s.getsockname()[1]
    env = env_with_repo() | {"LOCUST_PORTS": f"{port} {silent}", "LOCUST_WORKLOAD": "smoke"}
    proc = subprocess.run([LOCUST, "-f", "loadtest/locustfile.py", "--headless", "-u", "2",
                           "-r", "2", "--host", "http://127.0.0.1", "--result-dir",
                           str(tmp_path / "r"), "--only-summary"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"not started: nothing answers at http://127.0.0.1:{silent} " in proc.stderr
    assert f"127.0.0.1:{port} " not in proc.stderr.split("not started")[1].splitlines()[0]
    assert "`make up`" in proc.stderr and not (tmp_path / "r").exists()


def test_the_load_test_sends_the_api_key_of_the_environment(fake_server, tmp_path):
    port = fake_server("--ttft", "0.01", "--itl", "0.002", "--api-key", "sk-test")
    results = {}
    for key in ("sk-test", ""):
        out = tmp_path / (key or "none")
        env = env_with_repo() | {"OPENAI_API_KEY": key}
        proc = subprocess.run([sys.executable, "-m", "loadtest", "compare", "--host", "127.0.0.1",
                               "--ports", str(port), "--workload", "smoke", "--repetitions", "1",
                               "--out", str(out), "--metrics-endpoints", "none"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        results[key] = json.loads((out / f"{port}.json").read_text()), proc
    sent, _ = results["sk-test"]
    assert sent["completed"] == 12 and sent["failed"] == 0
    refused, proc = results[""]
    assert refused["completed"] == 0 and refused["failed"] == 12
    assert list(refused["errors_by_reason"]) == ["HTTP 401: invalid API key"], refused["errors_by_reason"]
