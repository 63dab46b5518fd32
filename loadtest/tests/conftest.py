"""Fixtures: fake OpenAI servers on 127.0.0.1 (subprocesses, stopped after the test).

Locust monkey-patches with gevent on import, so locust never runs inside the pytest process:
the tests start `python -m loadtest` / `locust` as subprocesses.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_openai.py")


def env_with_repo():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "picker" / "src")])
    return env


@pytest.fixture
def fake_server():
    procs = []

    def start(*args: str) -> int:
        proc = subprocess.Popen([sys.executable, str(FAKE), *args], stdout=subprocess.PIPE,
                                text=True, cwd=REPO)
        procs.append(proc)
        line = proc.stdout.readline()  # "PORT n" once listening; "" if it died
        assert line.startswith("PORT "), f"fake server did not start: {line!r}"
        return int(line.split()[1])

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
