"""Several clients in one run: parsing, their prompts and times, their headers, their statistics."""
import json
import subprocess
import sys

import pytest

from loadtest.clients import ClientStream, client_headers, parse_client
from loadtest.metrics import RequestSample, by_client, error_kind, error_kinds
from loadtest.openai_api import error_reason
from loadtest.plan import RunOptions, RunPlan
from loadtest.tests.conftest import REPO, env_with_repo

HEAVY = ClientStream("heavy", rate=20.0, prompts=40)
LIGHT = ClientStream("light", rate=2.0, prompts=4, key_env="LIGHT_KEY", objective="interactive")


def test_parse_client_reads_every_field_and_names_what_is_wrong():
    assert parse_client("name=light,rate=0.5,prompts=15,key_env=K,objective=interactive,burstiness=0.5") == \
        ClientStream("light", 0.5, 15, "K", "interactive", 0.5)
    assert parse_client("name=a, rate=2, prompts=3").objective is None
    with pytest.raises(ValueError, match="missing prompts"):
        parse_client("name=a,rate=2")
    with pytest.raises(ValueError, match="'colour=red' is not one of"):
        parse_client("name=a,rate=2,prompts=3,colour=red")
    with pytest.raises(ValueError, match="rate and burstiness must be > 0"):
        parse_client("name=a,rate=0,prompts=3")
    assert parse_client("name=a,rate=2,prompts=3,output_len=300-600").output_len == (300, 600)
    assert parse_client("name=a,rate=2,prompts=3,output_len=50").output_len == (50, 50)
    with pytest.raises(ValueError, match="output_len must be LOW-HIGH"):
        parse_client("name=a,rate=2,prompts=3,output_len=600-300")


def test_a_client_with_its_own_answer_lengths_keeps_its_prompts_and_times():
    long = ClientStream("light", rate=2.0, prompts=4, key_env="LIGHT_KEY", objective="interactive",
                        output_len=(300, 600))
    plain = RunOptions(workload="smoke", seed=3, clients=(HEAVY, LIGHT)).build()
    mixed = RunOptions(workload="smoke", seed=3, clients=(HEAVY, long)).build()
    assert [(s.prompt, s.arrival) for s in mixed] == [(s.prompt, s.arrival) for s in plain]
    assert [s.output_tokens for s in mixed if s.client == "heavy"] == \
        [s.output_tokens for s in plain if s.client == "heavy"]
    lengths = [s.output_tokens for s in mixed if s.client == "light"]
    assert all(300 <= n <= 600 for n in lengths) and max(s.output_tokens for s in plain) < 300


def test_a_client_gets_the_same_requests_at_the_same_times_alone_or_with_others():
    both = RunOptions(workload="smoke", seed=3, clients=(HEAVY, LIGHT)).build()
    alone = RunOptions(workload="smoke", seed=3, clients=(LIGHT,)).build()
    assert [s.client for s in both].count("light") == 4 and len(both) == 44
    assert [s for s in both if s.client == "light"] == alone
    assert [s.arrival for s in both] == sorted(s.arrival for s in both)
    # heavy sends 10x light's rate: its 40 requests span about as long as light's 4
    span = {c: max(s.arrival for s in both if s.client == c) for c in ("heavy", "light")}
    assert 0.3 < span["heavy"] / span["light"] < 3
    # the clients' prompts differ (their own seeds)
    assert {s.prompt for s in both if s.client == "heavy"}.isdisjoint({s.prompt for s in alone})


def test_the_plan_sends_each_client_at_its_own_times():
    options = RunOptions(workload="smoke", seed=0, clients=(HEAVY, LIGHT))
    plan = RunPlan(options.build(), options, clock=lambda: 100.0)
    sent = [plan.next_request() for _ in range(plan.total)]
    assert plan.total == 44 and options.settings()["num_prompts"] == 44
    assert [t for _, t, _ in sent] == sorted(t for _, t, _ in sent) and sent[0][1] == 100.0


def test_clients_refuse_a_run_wide_rate_or_count():
    with pytest.raises(ValueError, match="no --request-rate"):
        RunOptions(clients=(HEAVY,), request_rate=2.0)
    with pytest.raises(ValueError, match="names must differ"):
        RunOptions(workload="smoke", clients=(HEAVY, HEAVY)).build()


def test_each_client_sends_its_own_key_and_objective(monkeypatch):
    monkeypatch.setenv("LIGHT_KEY", "sk-light")
    headers = client_headers((HEAVY, LIGHT), {"Accept": "text/event-stream"}, "sk-run", "",
                             "x-gateway-inference-objective")
    assert headers["heavy"] == {"Accept": "text/event-stream", "Authorization": "Bearer sk-run"}
    assert headers["light"] == {"Accept": "text/event-stream", "Authorization": "Bearer sk-light",
                                "x-gateway-inference-objective": "interactive"}
    monkeypatch.delenv("LIGHT_KEY")
    with pytest.raises(ValueError, match=r"\$LIGHT_KEY \(its API key\) is not set"):
        client_headers((LIGHT,), {}, "sk-run", "", "x")


def test_error_reasons_keep_the_code_and_kinds_drop_the_details():
    body = b'{"error": {"message": "waited 6.1s in the queue", "type": "x", "code": "queue_timeout"}}'
    reason = error_reason(503, body)
    assert reason == "HTTP 503 (queue_timeout): waited 6.1s in the queue"
    assert error_kind(reason) == "HTTP 503 (queue_timeout)"
    assert error_reason(400, b'{"error": {"message": "bad", "code": 400}}') == "HTTP 400: bad"
    assert error_kind("timeout after 900s") == "timeout after Ns"
    samples = [RequestSample(0, False, error=error_reason(503, body)),
               RequestSample(0, False, error=error_reason(503, body.replace(b"6.1", b"7.9"))),
               RequestSample(0, False, error="HTTP 429: local_rate_limited")]
    assert error_kinds(samples) == {"HTTP 503 (queue_timeout)": 2, "HTTP 429: local_rate_limited": 1}


def test_by_client_summarizes_each_client_alone():
    samples = [RequestSample(0.0, True, ttft=0.1, latency=0.2, end=1.0, output_tokens=5, client="a"),
               RequestSample(0.0, True, ttft=0.3, latency=0.4, end=1.0, output_tokens=5, client="a"),
               RequestSample(0.0, False, error="HTTP 503 (queue_full): full", end=1.0, client="b")]
    out = by_client(samples)
    assert out["a"]["completed"] == 2 and out["a"]["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["b"]["failed"] == 1 and out["b"]["errors_by_kind"] == {"HTTP 503 (queue_full)": 1}
    assert by_client([RequestSample(0.0, True)]) == {}


@pytest.mark.server
def test_compare_runs_two_clients_with_their_keys_and_objectives(fake_server, tmp_path):
    port = fake_server("--ttft", "0.01", "--itl", "0.002", "--api-key", "sk-heavy", "--api-key", "sk-light",
                       "--refuse-objective", "batch")
    out = tmp_path / "two"
    env = env_with_repo() | {"HEAVY_KEY": "sk-heavy", "LIGHT_KEY": "sk-light", "OPENAI_API_KEY": "sk-wrong"}
    proc = subprocess.run([sys.executable, "-m", "loadtest", "compare", "--host", "127.0.0.1",
                           "--ports", str(port), "--workload", "smoke", "--repetitions", "1",
                           "--out", str(out), "--metrics-endpoints", "none",
                           "--client", "name=heavy,rate=40,prompts=20,key_env=HEAVY_KEY",
                           "--client", "name=light,rate=4,prompts=4,key_env=LIGHT_KEY",
                           "--client", "name=shed,rate=4,prompts=3,key_env=LIGHT_KEY,objective=batch",
                           "--client", "name=nokey,rate=4,prompts=2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / f"{port}.json").read_text())
    clients = result["by_client"]
    assert result["completed"] == 24 and result["failed"] == 5
    assert (clients["heavy"]["completed"], clients["light"]["completed"]) == (20, 4)
    assert clients["shed"]["errors_by_kind"] == {"HTTP 503 (queue_timeout)": 3}
    assert clients["nokey"]["errors_by_kind"] == {"HTTP 401: invalid API key": 2}  # the run's key
    meta = json.loads((out / "compare.json").read_text())
    assert [c["name"] for c in meta["clients"]] == ["heavy", "light", "shed", "nokey"]
    assert "sk-" not in (out / "compare.json").read_text()
