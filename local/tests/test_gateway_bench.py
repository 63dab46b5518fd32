"""`make bench-gateway`, tiny: it runs end to end and every SSE event of every stream arrives."""
from __future__ import annotations

import json
import subprocess
import sys

from local.stack import python_env


def test_gateway_bench_streams_every_event_through_each_listener(tmp_path):
    out = tmp_path / "gateway.json"
    run = subprocess.run([sys.executable, "-m", "local.gateway.bench", "--streams", "4", "--requests", "8",
                          "--events", "10", "--json", str(out)],
                         env=python_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [x["listener"] for x in result["listeners"]] == [
        "http", "llm-gw (buffered)", "llm-gw (full-duplex)"]
    for x in result["listeners"]:
        assert x["events"] == 8 * (10 + 1), x  # 10 chunks and [DONE] per stream
        assert x["events_per_s"] > 0
