"""bench flow's mixes of clients: their requests, the target's check and the section it writes."""
from bench import flow_mixes as fm


def test_a_mix_gives_each_client_its_share_and_its_own_answer_lengths():
    mix = fm.Mix("t", fm.CHAT_REASONING, "one loop", 8, False, requests=100)
    reqs = fm._requests(mix, seed=1)
    clients = [r.client for r in reqs]
    assert set(clients) == {"chat", "reasoning"} and all(r.client == r.group for r in reqs)
    assert 45 < clients.count("chat") < 75                     # 60 % of 100, drawn
    for r in reqs:
        lo, hi = fm.OUTPUT_TOKENS[r.group]
        assert lo <= r.max_tokens <= hi and fm.PROMPT_TOKENS[0] <= len(r.token_ids) <= fm.PROMPT_TOKENS[1]
    assert [r.prompt for r in fm._requests(mix, seed=1)] == [r.prompt for r in reqs]   # per seed


def test_own_loops_send_each_client_in_proportion_to_its_share_and_speed():
    counts = fm._counts(fm.Mix("t", fm.CHAT_REASONING, "own loops", 28, False, requests=200))
    assert counts["reasoning"] == 80                    # its 40 % of 200
    assert 5 * 80 * 1.5 < counts["chat"] < 6 * 80 * 1.5   # 1.5x its concurrency, ~5.5x faster
    config = fm._config(fm.Mix("t", fm.CHAT_REASONING, "own loops", 28, False), 0, [], None)
    assert config.group_concurrency == {"chat": 17, "reasoning": 11} and config.concurrency is None


def _stats(flow_mean, flow_std, refused=0):
    def key(mean, std, values=None):
        return {"mean": mean, "std": std, "values": values or [mean]}
    base = {"mean_ttft_ms": key(1000, 50), "p99_ttft_ms": key(5000, 100), "output_throughput": key(200, 5),
            "failed": key(0, 0)}
    flow = dict(base, mean_ttft_ms=key(flow_mean, flow_std), failed=key(refused / 3, 0, [refused, 0, 0]))
    return {"picker": base, "picker-flow": flow}


def test_the_target_is_worse_beyond_the_larger_spread_or_any_refusal():
    assert fm.assess(_stats(1040, 10))["met"]                      # within picker's spread of 50
    a = fm.assess(_stats(1080, 10))
    assert not a["met"] and a["worse_beyond_spread"]["mean_ttft_ms"]
    assert fm.assess(_stats(1080, 90))["met"]                      # within flow's own spread
    a = fm.assess(_stats(900, 10, refused=1))
    assert not a["met"] and a["refused"] == 1 and not any(a["worse_beyond_spread"].values())


def test_a_small_mix_runs_every_policy_and_the_report_shows_the_target():
    mix = fm.Mix("small", fm.CHAT_REASONING, "own loops", 6, False, requests=10)
    rows = fm.run([0], [mix])
    stats = rows[0]["stats"]
    assert set(stats) == set(fm.POLICIES)
    assert set(stats["picker-flow"]["clients"]) == {"chat", "reasoning"}
    text = "\n".join(fm.report(rows))
    assert "| small | chat 60% / reasoning 40%, own loops, concurrency 6 | least-request |" in text
    verdict = "met" if rows[0]["assessment"]["met"] else "NOT met"
    assert f"| {verdict}" in next(line for line in text.splitlines() if "| picker-flow |" in line)
