"""The JSONL trace workload and the production-like mixes (loadtest/traces.py, loadtest/mixes.py)."""
import json
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from loadtest.metrics import read_samples
from loadtest.plan import RunOptions, RunPlan
from loadtest.tests.conftest import REPO, env_with_repo
from loadtest.traces import read_trace
from loadtest.workloads import build_workload

EXAMPLE = REPO / "loadtest" / "examples" / "trace.jsonl"


def write(tmp_path, *records, raw=None):
    path = tmp_path / "t.jsonl"
    path.write_text(raw if raw is not None else "\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_trace_lengths_prefix_groups_and_arrivals(tmp_path):
    path = write(tmp_path,
                 {"prompt_tokens": 50, "output_tokens": 7, "prefix_group": "a", "prefix_tokens": 30,
                  "arrival_time": 0.0},
                 {"prompt_tokens": 40, "output_tokens": 3, "prefix_group": "a", "prefix_tokens": 20,
                  "arrival_time": 1.5},
                 {"prompt_tokens": 60, "output_tokens": 5, "prefix_group": "b", "prefix_tokens": 30,
                  "arrival_time": 0.5},
                 {"prompt": "  hello   there world ", "output_tokens": 2, "arrival_time": 2})
    w = build_workload("trace", path=path, seed=1)
    assert [(s.prompt_tokens, s.output_tokens, s.group, s.arrival) for s in w] == [
        (50, 7, "a", 0.0), (40, 3, "a", 1.5), (60, 5, "b", 0.5), (3, 2, "", 2.0)]
    assert all(len(s.prompt.split(" ")) == s.prompt_tokens for s in w)
    a0, a1, b0 = (s.prompt.split(" ") for s in w[:3])
    assert a0[:20] == a1[:20]                       # the group's prefix, cut to each request's
    assert a0[20:30] != a1[20:30]
    assert a0[:30] != b0[:30]                       # another group, another prefix
    assert w[3].prompt == "hello there world"
    assert build_workload("trace", path=path, seed=1) == w
    assert [s.prompt for s in build_workload("trace", path=path, seed=2)][:3] != \
        [s.prompt for s in w][:3]
    assert len(build_workload("trace", path=path, num_prompts=2)) == 2


@pytest.mark.parametrize("line, message", [
    ('{"prompt_tokens": 5}', "'output_tokens' is required"),
    ('{"output_tokens": 5}', "exactly one of 'prompt' and 'prompt_tokens'"),
    ('{"prompt": "x", "prompt_tokens": 3, "output_tokens": 5}', "exactly one of"),
    ('{"prompt_tokens": 0, "output_tokens": 5}', "'prompt_tokens' must be an integer >= 1"),
    ('{"prompt_tokens": 5, "output_tokens": 2.5}', "'output_tokens' must be an integer >= 1"),
    ('{"prompt_tokens": 5, "output_tokens": 5, "colour": 1}', "unknown field(s) colour"),
    ('{"prompt_tokens": 5, "output_tokens": 5, "prefix_group": "g"}', "needs 'prefix_tokens'"),
    ('{"prompt_tokens": 5, "output_tokens": 5, "prefix_group": "g", "prefix_tokens": 6}',
     "larger than 'prompt_tokens'"),
    ('{"prompt_tokens": 5, "output_tokens": 5, "arrival_time": -1}', "'arrival_time' must be"),
    ('[1, 2]', "each line must be a JSON object"),
    ('{"prompt_tokens": 5,', "not JSON"),
])
def test_trace_errors_name_the_line_and_field(tmp_path, line, message):
    path = write(tmp_path, raw='# comment\n\n{"prompt_tokens": 5, "output_tokens": 5}\n' + line)
    with pytest.raises(ValueError) as err:
        read_trace(path)
    assert f"{path}:4" in str(err.value) and message in str(err.value)


def test_trace_arrival_times_on_every_line_or_none(tmp_path):
    path = write(tmp_path, {"prompt_tokens": 5, "output_tokens": 5, "arrival_time": 1},
                 {"prompt_tokens": 5, "output_tokens": 5})
    with pytest.raises(ValueError, match="on 1 of 2 lines"):
        read_trace(path)
    with pytest.raises(ValueError, match="needs path="):
        build_workload("trace")
    with pytest.raises(ValueError, match="no requests"):
        read_trace(write(tmp_path, raw="# nothing\n"))


def test_example_trace_is_valid_and_documented():
    w = build_workload("trace", path=str(EXAMPLE))
    assert len(w) == 24 and all(s.arrival is not None for s in w)
    assert {s.group for s in w} == {"", "tenant-0", "tenant-1", "tenant-2"}
    assert max(s.prompt_tokens for s in w) == 6000


def test_run_plan_sends_at_the_trace_arrival_times(tmp_path):
    path = write(tmp_path, *({"prompt_tokens": 5, "output_tokens": 1, "arrival_time": t}
                             for t in (2.0, 0.0, 1.0)))
    specs = build_workload("trace", path=path)
    plan = RunPlan(specs, RunOptions(workload="trace"), clock=lambda: 100.0)
    sent = [plan.next_request() for _ in range(3)]
    assert [t for _, t, _ in sent] == [100.0, 101.0, 102.0]         # in arrival order
    assert [s.arrival for s, _, _ in sent] == [0.0, 1.0, 2.0]
    # An explicit request rate overrides the trace's times.
    plan = RunPlan(specs, RunOptions(workload="trace", request_rate=1000.0), clock=lambda: 0.0)
    assert plan.next_request()[0].arrival == 2.0


def test_sharegpt_keep_long_switch(tmp_path):
    long_q = " ".join(["word"] * 3000)
    convs = [{"conversations": [{"from": "human", "value": long_q},
                                {"from": "gpt", "value": " ".join(["ans"] * 5000)}]},
             {"conversations": [{"from": "human", "value": "a short question here"},
                                {"from": "gpt", "value": "a b c d e f"}]},
             {"conversations": [{"from": "human", "value": "a b c d e"},
                                {"from": "gpt", "value": " ".join(["x"] * 17000)}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    default = build_workload("sharegpt", path=str(path))
    assert [(s.prompt_tokens, s.output_tokens) for s in default] == [(4, 6)]   # vLLM's pruning
    kept = build_workload("sharegpt-long", path=str(path), seed=0)
    assert sorted((s.prompt_tokens, s.output_tokens) for s in kept) == [(4, 6), (3000, 5000)]
    assert build_workload("sharegpt", path=str(path), keep_long="true") == kept  # --workload-args


def test_production_like_mixes():
    cr = build_workload("chat-reasoning", seed=0, num_prompts=2000)
    long = [s for s in cr if s.group == "reasoning"]
    assert 0.27 < len(long) / len(cr) < 0.33
    assert all(2000 <= s.prompt_tokens <= 6000 and 1500 <= s.output_tokens <= 4000 for s in long)
    assert all(100 <= s.prompt_tokens <= 600 and 50 <= s.output_tokens <= 400
               for s in cr if s.group == "chat")
    mt = build_workload("multi-turn", seed=0)
    assert len(mt) == 300 and len({s.group for s in mt}) == 60
    by_session = {}
    for s in mt:                                   # each turn resends the previous one whole
        prev = by_session.get(s.group)
        if prev is not None:
            assert s.prompt.startswith(prev.prompt + " ") and s.prompt_tokens > \
                prev.prompt_tokens + prev.output_tokens
        by_session[s.group] = s
    lt = build_workload("long-tail", seed=0, num_prompts=4000)
    ins = np.array([s.prompt_tokens for s in lt])
    outs = np.array([s.output_tokens for s in lt])
    assert 800 < np.median(ins) < 1200 and 320 < np.median(outs) < 480
    assert ins.max() > 8 * np.median(ins)          # the long tail
    assert (ins + outs).max() <= 16384


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.server
def test_trace_replayed_over_http_against_the_simulator(tmp_path):
    """loadtest compare sends the trace to a real simulator process: lengths and send times."""
    arrivals = [0.0, 0.4, 0.8, 1.2, 2.0, 2.4]
    path = write(tmp_path, *({"prompt_tokens": 40 + 10 * i, "output_tokens": 5 + i,
                              "prefix_group": "g", "prefix_tokens": 32, "arrival_time": t}
                             for i, t in enumerate(arrivals)))
    port = _free_port()
    sim = subprocess.Popen([sys.executable, "-m", "local.sim", "--port", str(port),
                            "--speedup", "20"], cwd=REPO, env=env_with_repo(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        out = tmp_path / "cmp"
        proc = subprocess.run(
            [sys.executable, "-m", "loadtest", "compare", "--host", "127.0.0.1", "--ports",
             str(port), "--workload", "trace", "--workload-args", f"path={path}",
             "--concurrency", "6", "--repetitions", "1", "--out", str(out)],
            cwd=REPO, env=env_with_repo(), capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads((out / f"{port}.json").read_text())
        assert result["completed"] == 6 and result["failed"] == 0
        # The simulator counts one word as one token: the server's usage matches the trace.
        assert result["total_input_tokens"] == sum(40 + 10 * i for i in range(6))
        assert result["total_output_tokens"] == sum(5 + i for i in range(6))
        samples = sorted(read_samples(out / f"{port}.samples.jsonl"), key=lambda s: s.start)
        offsets = [s.start - samples[0].start for s in samples]
        assert offsets == pytest.approx(arrivals, abs=0.25)
    finally:
        sim.terminate()
        sim.wait(timeout=10)
