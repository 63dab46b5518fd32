"""The alert rules under the real promtool: syntax, and each alert's firing and silent tests."""
from __future__ import annotations

import yaml

from monitoring import rules


def test_promtool_checks_the_rules(tmp_path):
    proc = rules.check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules.alerts())} rules found" in proc.stdout


def test_promtool_rule_tests_pass(tmp_path):
    proc = rules.test(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_silent_test():
    suite = yaml.safe_load(rules.TESTS.read_text())
    fires, silent = set(), set()
    for group in suite["tests"]:
        for case in group["alert_rule_test"]:
            (fires if case["exp_alerts"] else silent).add(case["alertname"])
    names = {a["alert"] for a in rules.alerts()}
    assert names - fires == set(), "alerts without a test that fires"
    assert names - silent == set(), "alerts without a test that stays silent"


def test_a_broken_threshold_fails_the_rule_tests(tmp_path):
    """The tests pin the thresholds: KV saturation at 99.5 % instead of 95 % must not fire."""
    text = rules.RULES.read_text()
    broken = text.replace('(vllm:kv_cache_usage_perc{job="vllm"}) > 0.95', '(vllm:kv_cache_usage_perc{job="vllm"}) > 0.995')
    assert broken != text
    (tmp_path / "rules.yaml").write_text(broken)
    proc = rules.test(tmp_path / "work", path=tmp_path / "rules.yaml")
    assert proc.returncode != 0
    assert "VLLMKVCacheSaturated" in proc.stdout + proc.stderr
