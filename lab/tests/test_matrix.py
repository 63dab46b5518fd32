"""The lab's scenario matrix, the oracle, outages, heterogeneous pools and traces in the lab."""
import json

import pytest

from lab import matrix
from lab.oracle import Oracle, predicted_ttft
from lab.policies import make_policy
from lab.simulation import LabConfig, outage_windows, prepare_requests, run_lab
from local.sim.engines import A10_QWQ32B
from loadtest.metrics import RequestSample
from loadtest.workloads import build_workload


def reqs(name="demo", n=30, seed=3, **kw):
    return prepare_requests(build_workload(name, seed=seed, num_prompts=n, **kw), 16)


def test_trace_arrival_times_and_prefix_groups_in_the_lab(tmp_path):
    lines = [{"prompt_tokens": 600, "output_tokens": 20, "prefix_group": "t", "prefix_tokens": 512,
              "arrival_time": t} for t in (0.0, 5.0, 10.0, 30.0)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    run = run_lab(prepare_requests(build_workload("trace", path=str(path)), 16),
                  make_policy("round-robin"), LabConfig(num_engines=1, concurrency=None))
    assert sorted(s.start for s in run.samples) == [0.0, 5.0, 10.0, 30.0]
    ep = run.per_endpoint["127.0.0.1:8101"]
    assert ep["prefix_cache_hits"] == 3 * 512            # every later request hits the prefix


def test_oracle_prediction_is_exact_and_it_picks_the_fastest_group():
    requests = reqs("article", n=12, seed=0)
    # Alone on an idle group, the prediction is the TTFT the lab then measures.
    cfg = LabConfig(num_engines=1, concurrency=None)
    lab_run = run_lab(requests[:1], make_policy("round-robin"), cfg)
    from lab.simulation import Lab
    lab = Lab(requests[:1], make_policy("round-robin"), cfg)
    assert predicted_ttft(lab.endpoints[0], requests[0], 0.0) == pytest.approx(
        lab_run.samples[0].ttft)
    # Busy groups: the oracle picks the lowest prediction; no request gets its first token
    # sooner than predicted (later requests can only lengthen the steps it shares with them).
    oracle = Oracle()
    seen = []
    pick = oracle.pick

    def recording_pick(request):
        ep = pick(request)
        seen.append((request.request_id, predicted_ttft(ep, request, oracle.clock()),
                     min(predicted_ttft(e, request, oracle.clock()) for e in oracle.endpoints)))
        return ep
    oracle.pick = recording_pick
    run = run_lab(requests, oracle, LabConfig(num_engines=3, concurrency=None))
    assert all(chosen == best for _, chosen, best in seen)
    measured = {s.prompt_tokens: s.ttft for s in run.samples}
    assert len(measured) == len(requests)                    # prompt lengths are distinct here
    by_id = {r.request_id: len(r.token_ids) for r in requests}
    assert all(measured[by_id[rid]] >= chosen - 1e-9 for rid, chosen, _ in seen)
    assert sum(measured[by_id[rid]] == pytest.approx(chosen) for rid, chosen, _ in seen) >= 3


def test_the_oracles_shortcuts_predict_what_plain_stepping_predicts():
    """predicted_ttft skips groups by a lower bound and plays stretches of decode steps at once;
    at every decision of a KV-starved run its prediction for every group equals stepping a copy
    one step at a time (inf where the bound says the group cannot beat the best)."""
    import math
    from lab.oracle import copy_engine, ttft_lower_bound

    def plain(ep, request, now):
        t = [max(now, ep.step_end) if ep.busy else now]
        engine = copy_engine(ep.engine, lambda: t[0])
        target = engine.add_request(request.request_id, request.token_ids, request.max_tokens,
                                    hashes=request.hashes)
        while (result := engine.step()) is not None:
            t[0] = result.end_time
            if target.first_token_time is not None:
                return t[0] - now
        return math.inf

    oracle, checked = Oracle(), []
    pick = oracle.pick

    def checking_pick(request):
        now = oracle.clock()
        exact = {ep.index: plain(ep, request, now) for ep in oracle.endpoints}
        best = min(exact.values())
        for ep in oracle.endpoints:
            assert predicted_ttft(ep, request, now) == exact[ep.index]
            assert ttft_lower_bound(ep, request, now) <= exact[ep.index]
            bounded = predicted_ttft(ep, request, now, best)
            assert bounded == exact[ep.index] or (bounded == math.inf and exact[ep.index] > best)
        checked.append(max(t for t in exact.values() if t < math.inf))
        return pick(request)
    oracle.pick = checking_pick
    starved = A10_QWQ32B.with_overrides(num_gpu_blocks=300)
    run_lab(reqs("demo", n=40, seed=4), oracle,
            LabConfig(num_engines=3, concurrency=20, engine_models=[starved] * 3))
    assert len(checked) == 40 and max(checked) > 20.0     # long queues were played forward


def test_oracle_beats_least_request_on_the_article_workload():
    requests = reqs("article", n=90, seed=0)
    cfg = LabConfig(concurrency=30, seed=0)
    lr = run_lab(requests, make_policy("least-request"), cfg).summary["mean_ttft_ms"]
    orc = run_lab(requests, make_policy("oracle"), cfg).summary["mean_ttft_ms"]
    assert orc < 0.8 * lr


def test_outage_fails_inflight_requests_and_the_group_comes_back_empty():
    requests = reqs(n=60)
    cfg = LabConfig(concurrency=15, seed=1, outages=((0, 20.0, 60.0),))
    for name in ("least-request", "round-robin", "picker", "oracle"):
        policy = make_policy(name)
        run = run_lab(requests, policy, cfg)
        failed = [s for s in run.samples if not s.success]
        assert failed and all(s.error == "group down" and s.end == 20.0 for s in failed), name
        on_0 = [s for s in run.samples if s.target == "127.0.0.1:8101" and s.success]
        assert not [s for s in on_0 if 20.0 <= s.start < 60.0], name     # none sent while down
        assert "127.0.0.1:8101" in [e.address for e in policy.endpoints]   # back in the pool
        if name in ("least-request", "round-robin"):
            assert [s for s in on_0 if s.start >= 60.0], name             # and used again
        # (At this light load the picker and the oracle keep the requests, which all share the
        # workload's prefix, on the groups that cache it: that is the faster choice.)
        if name == "picker":
            assert "127.0.0.1:8101" in policy.router.endpoints
        assert run.summary["completed"] + run.summary["failed"] == 60
        windows = outage_windows(run.samples, (0, 20.0, 60.0))
        assert {k: run.summary[k] for k in windows} == windows, name


def test_outage_windows_split_the_successful_requests_by_send_time():
    ok = lambda start, ttft: RequestSample(start=start, success=True, ttft=ttft)  # noqa: E731
    samples = [ok(1.0, 0.1), ok(19.9, 0.3), ok(20.0, 2.0), ok(59.0, 4.0), ok(60.0, 0.5),
               RequestSample(start=30.0, success=False)]
    assert outage_windows(samples, (0, 20.0, 60.0)) == {
        "mean_ttft_ms_before_outage": pytest.approx(200.0),
        "mean_ttft_ms_during_outage": pytest.approx(3000.0),
        "mean_ttft_ms_after_outage": pytest.approx(500.0)}


def test_heterogeneous_pool_engine_models():
    slow = A10_QWQ32B.with_overrides(stage_base_s=A10_QWQ32B.stage_base_s * 3)
    run = run_lab(reqs(n=30), make_policy("round-robin"),
                  LabConfig(concurrency=3, engine_models=[slow, A10_QWQ32B, A10_QWQ32B]))
    tpot = {}
    for s in run.samples:
        tpot.setdefault(s.target, []).append((s.latency - s.ttft) / (s.output_tokens - 1))
    mean = {k: sum(v) / len(v) for k, v in tpot.items()}
    assert mean["127.0.0.1:8101"] > 1.5 * mean["127.0.0.1:8102"]
    with pytest.raises(ValueError, match="2 engine models for 3 engines"):
        run_lab(reqs(n=3), make_policy("round-robin"),
                LabConfig(engine_models=[slow, slow]))


def test_scenarios_vary_one_factor_of_the_base():
    base = matrix.BY_NAME[matrix.BASE]
    fields = [f for f in matrix.Scenario.__dataclass_fields__ if f not in
              ("name", "factor", "description")]
    for s in matrix.SCENARIOS[1:]:
        changed = {f for f in fields if getattr(s, f) != getattr(base, f)}
        # a factor is one of these groups of fields
        assert changed and changed <= {
            "workload": {"workload"}, "arrivals": {"num_prompts", "concurrency", "load",
                                                   "burstiness"},
            "pool": {"engines", "num_prompts", "concurrency"}, "KV": {"kv_scale"},
            "heterogeneous": {"slow_group", "small_kv_group"}, "outage": {"outages"},
            # a class mix, always in a KV-starved pool (where answer lengths decide who waits)
            "lengths": {"workload", "kv_scale"}}[s.factor], s.name
        if s.factor == "lengths":
            assert s.kv_scale == 0.7
    assert len(matrix.SCENARIOS) == 22
    assert len(matrix.BY_NAME) == 22 + len(matrix.PRESSURE_SCENARIOS)


def test_pressure_scenarios_fill_60_to_80_percent_of_the_pools_kv():
    pool_tokens = 3 * matrix.A10_QWQ32B.num_gpu_blocks * matrix.A10_QWQ32B.block_size
    tenants = set()
    for s in matrix.PRESSURE_SCENARIOS:
        args = dict(s.workload_args)
        assert s.workload == "shared-prefix" and s.engines == 3 and s.name in matrix.BY_NAME
        assert 0.6 <= args["num_groups"] * args["system_prompt_len"] / pool_tokens <= 0.8, s.name
        tenants.add(args["num_groups"])
        specs = matrix.named_workload(s.workload, 20, **args)(100)
        assert {len(x.prompt.split()) for x in specs} == {args["system_prompt_len"] + 800}
    assert len(tenants) == len(matrix.PRESSURE_SCENARIOS)
    assert not set(matrix.REPORTED_SEEDS) & set(matrix.TUNING_SEEDS)


def test_assess_applies_the_targets():
    def stats(mean, p99, tput, std=10.0):
        return {"mean_ttft_ms": {"mean": mean, "std": std}, "p99_ttft_ms": {"mean": p99, "std": std},
                "output_throughput": {"mean": tput, "std": 1.0}}
    a = matrix.assess({"least-request": stats(1000, 5000, 100), "picker": stats(600, 5005, 99.5),
                       "oracle": stats(500, 4000, 100), "picker-upstream": stats(700, 6000, 99)})
    assert a["oracle_gain_pct"] == pytest.approx(50.0) and a["gap_target_applies"]
    assert a["gap_closed_pct"] == pytest.approx(80.0)
    assert a["worse_than_baseline_beyond_spread"] == {
        "mean_ttft_ms": False, "p99_ttft_ms": False, "output_throughput": False}
    assert a["default_beats_upstream"]
    b = matrix.assess({"least-request": stats(1000, 5000, 100), "picker": stats(1100, 5000, 97),
                       "oracle": stats(900, 5000, 100)})
    assert not b["gap_target_applies"]
    assert b["worse_than_baseline_beyond_spread"]["mean_ttft_ms"]
    assert b["worse_than_baseline_beyond_spread"]["output_throughput"]


def test_matrix_cli_measures_capacity_then_runs_open_loop(tmp_path, monkeypatch, capsys):
    small = [matrix.Scenario(matrix.BASE, "-", "smoke base", workload="demo", num_prompts=20,
                             concurrency=10),
             matrix.Scenario("open", "arrivals", "open loop at half capacity", workload="demo",
                             num_prompts=20, concurrency=None, load=0.5),
             matrix.Scenario("kv", "KV", "closed loop, less KV", workload="demo", num_prompts=20,
                             concurrency=10, kv_scale=0.5)]
    monkeypatch.setattr(matrix, "SCENARIOS", small)
    monkeypatch.setattr(matrix, "BY_NAME", {s.name: s for s in small})
    from lab.__main__ import main as lab_main
    assert lab_main(["matrix", "--out", str(tmp_path), "--seeds", "0", "1", "--jobs", "2",
                     "--policy", "least-request", "--policy", "oracle"]) == 0
    data = json.loads((tmp_path / "matrix.json").read_text())
    base, open_, closed = data["scenarios"]
    cap = base["policies"]["least-request"]["request_throughput"]["mean"]
    assert data["capacity_rps"] == pytest.approx(cap)
    assert open_["request_rate"] == pytest.approx(cap / 2)
    assert open_["policies"]["oracle"]["completed"]["values"] == [20.0, 20.0]
    assert "gap_closed_pct" not in base["assessment"]          # no picker in this run
    assert closed["policies"]["oracle"]["completed"]["values"] == [20.0, 20.0]
    err = capsys.readouterr().err
    assert "[6/6]" in err and "left" in err
    # The closed-loop scenario needs no capacity: it runs beside the base one, the open-loop
    # one only after both base runs.
    lines = [line.split("]")[1].split(":")[0].strip() for line in err.splitlines()
             if line.startswith("[")]
    assert lines.index("open seed 0") > max(lines.index("base seed 0"), lines.index("base seed 1"))
    assert lines.index("open seed 1") > lines.index("base seed 1")
    assert json.loads((tmp_path / "runs" / "kv-seed0.json").read_text())["capacity_rps"] is None
    # --resume reuses the saved runs: same figures, nothing rerun.
    assert lab_main(["matrix", "--out", str(tmp_path), "--seeds", "0", "1", "--jobs", "2",
                     "--policy", "least-request", "--policy", "oracle", "--resume"]) == 0
    again = json.loads((tmp_path / "matrix.json").read_text())
    assert again["scenarios"] == data["scenarios"]
    assert capsys.readouterr().err.count("(0.0 s)") == 6
    assert (again["runs"], again["reused_runs"], data["reused_runs"]) == (6, 6, 0)
    assert matrix.reuse_note(again).startswith("; 6 of 6 runs reused") and not matrix.reuse_note(data)
    # ... but not runs made by other code: every run again.
    monkeypatch.setattr(matrix, "code_fingerprint", lambda: "other code")
    assert lab_main(["matrix", "--out", str(tmp_path), "--seeds", "0", "1", "--jobs", "2",
                     "--policy", "least-request", "--policy", "oracle", "--resume"]) == 0
    assert json.loads((tmp_path / "matrix.json").read_text())["reused_runs"] == 0


def test_a_failing_matrix_job_stops_the_matrix_with_its_error(tmp_path, monkeypatch):
    small = [matrix.Scenario(matrix.BASE, "-", "smoke base", workload="demo", num_prompts=5,
                             concurrency=5)]
    monkeypatch.setattr(matrix, "SCENARIOS", small)
    monkeypatch.setattr(matrix, "BY_NAME", {s.name: s for s in small})

    def broken(*args):
        raise RuntimeError("this run broke")
    monkeypatch.setattr(matrix, "run_one", broken)
    from lab.__main__ import main as lab_main
    with pytest.raises(RuntimeError, match="this run broke"):
        lab_main(["matrix", "--out", str(tmp_path), "--seeds", "0", "--jobs", "2",
                  "--policy", "least-request"])


def test_code_fingerprint_follows_the_source_the_runs_execute(tmp_path, monkeypatch):
    for top in matrix.CODE_DIRS:
        (tmp_path / top).mkdir(parents=True)
    (tmp_path / "lab" / "policy.py").write_text("A = 1\n")
    (tmp_path / "lab" / "tests").mkdir()
    monkeypatch.setattr(matrix, "REPO", tmp_path)
    first = matrix.code_fingerprint()
    (tmp_path / "lab" / "tests" / "test_x.py").write_text("# a test\n")
    assert matrix.code_fingerprint() == first
    (tmp_path / "picker/src/picker" / "core.py").write_text("B = 2\n")
    assert matrix.code_fingerprint() != first
