"""bench flow-fairness-http: what it asks loadtest for and the section it writes."""
from bench import flow_clients_http as fch
from loadtest.clients import parse_client


def _row(mean, p99, completed, failed=0, kinds=None):
    return {"mean_ttft_ms": mean, "p99_ttft_ms": p99, "completed": completed, "failed": failed,
            "errors_by_kind": kinds or {}}


def test_clients_are_asked_at_their_fractions_of_the_measured_capacity_with_their_own_keys():
    args = fch.fairness_clients(4.0)
    heavy, light = (parse_client(a) for a in args[1::2])
    assert (heavy.name, heavy.rate, heavy.prompts, heavy.key_env) == ("heavy", 6.0, 150, "BENCH_KEY_LOADTEST")
    assert (light.name, light.rate, light.prompts, light.key_env) == ("light", 0.6, 15, "BENCH_KEY_USER")
    assert [parse_client(a).name for a in fch.fairness_clients(4.0, alone=True)[1::2]] == ["light"]
    hi, lo = (parse_client(a) for a in fch.priority_clients(4.0)[1::2])
    assert (hi.objective, hi.rate, lo.objective, lo.rate) == ("interactive", 3.0, None, 3.0)
    assert hi.key_env != lo.key_env


def test_flow_bounds_are_the_picker_defaults_in_model_time():
    assert fch.flow_bounds(5.0) == ["--flow-max-wait", "6", "--flow-max-wait-sheddable", "1",
                                    "--flow-activity-window", "24", "--flow-stale-hold", "1"]


def test_report_shows_both_targets_per_flow_control_mode():
    def mode(alone, light, hi_p99):
        return {"fairness": {"alone": _row(alone, 2 * alone, 15),
                             "mixed": {"light": _row(light, 2 * light, 15),
                                       "heavy": _row(900, 5000, 85, 65, {"HTTP 503 (queue_timeout)": 65})}},
                "priorities": {"interactive": _row(100, hi_p99, 100), "standard": _row(800, 4000, 70, 30)}}
    d = {"command": "python -m bench flow-fairness-http", "wall_s": 420, "speedup": 5.0, "light": 0.15,
         "heavy": 1.5, "priority_load": 0.75, "heavy_prompts": 150, "light_prompts": 15, "priority_prompts": 100,
         "runs": [{"seed": 0, "capacity_rps": 3.6, "modes": {"off": mode(200, 5000, 3000), "on": mode(200, 260, 1000)}}]}
    text = "\n".join(fch.report(d))
    assert "capacity 3.60 req/s" in text and "7.0 min wall" in text
    assert "| on | 200 | 260 | 1.30x | 400 / 520 | 900 / 5,000 | 15% / 85% (15 / 85) | 0 | " \
           "65 (65 HTTP 503 (queue_timeout)) |" in text
    assert "| off | 3,000 | 4,000 | 0.75 |" in text and "| on | 1,000 | 4,000 | 0.25 |" in text


def test_the_lab_on_the_same_scale_runs_and_is_reported():
    lab = fch.lab_same_scale([0])
    assert set(lab["fairness"]) == set(lab["priorities"]) == {"picker", "picker-flow"}
    import json
    lines = fch._lab_lines(json.loads(json.dumps(lab)))  # as read back from the results JSON
    flow_row = next(line for line in lines if line.startswith("| 0 | picker-flow |"))
    light_ratio = float(flow_row.split("|")[4].strip().rstrip("x"))
    assert 0.5 < light_ratio < 3   # flow control keeps the light client near what it gets alone
    assert float(lab["capacity_rps"][0]) > 0


def test_the_mix_sends_the_busier_client_with_the_short_answers_and_reports_refusals():
    chat, reasoning = (parse_client(a) for a in fch.mix_clients(4.0)[1::2])
    assert (chat.name, chat.prompts, chat.output_len, chat.key_env) == ("chat", 90, fch.MIX_CHAT, "BENCH_KEY_LOADTEST")
    assert (reasoning.prompts, reasoning.output_len) == (60, fch.MIX_REASONING)
    assert abs(chat.rate + reasoning.rate - fch.MIX_LOAD * 4.0) < 1e-3 and chat.rate == 1.5 * reasoning.rate
    assert fch.MIX_REASONING[0] >= 9 * fch.MIX_CHAT[0]

    def mode(chat_mean, failed=0):
        return {"mix": {"chat": _row(chat_mean, 3 * chat_mean, 90 - failed, failed), "reasoning": _row(300, 900, 60)}}
    d = {"mix_load": 0.8, "mix_prompts": 150, "mix_chat": [17, 67], "mix_reasoning": [167, 667]}
    lines = fch._mix_lines(d, {"modes": {"off": mode(200), "on": mode(200), "on-workers2": mode(400, failed=3)}})
    text = "\n".join(lines)
    assert "| on | 200 / 600 | 300 / 900 | 240 | 0 | 0 | +0.0 % vs off; nothing refused |" in text
    assert "| on-workers2 | 400 / 1,200 |" in text and "NOT met: 3 refused |" in text
