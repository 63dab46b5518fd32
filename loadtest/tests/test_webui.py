"""The locust web UI in a real headless chromium (Debian's, driven by playwright).

The test starts two fake OpenAI servers and the locust web UI on free ports, starts an A/B run
from the browser, reads the per-port rows in the "LLM metrics" tab and the charts on /loadtest/,
stops the run and downloads the result JSON from the download tab. Options come from the three
places locust reads them: flags, LOCUST_* environment variables and a locust.conf.
"""
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from loadtest.tests.conftest import REPO, env_with_repo

CHROMIUM = "/usr/bin/chromium"
LOCUST = str(Path(sys.executable).with_name("locust"))
playwright_api = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium missing (make test installs it)"),
              pytest.mark.server]  # locust and a browser, as processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def locust_ui(fake_server, tmp_path):
    fast = fake_server("--ttft", "0.05", "--itl", "0.05")
    slow = fake_server("--ttft", "0.3", "--itl", "0.08")
    web = free_port()
    conf = tmp_path / "locust.conf"
    conf.write_text(f"ports = {fast} {slow}\npercentiles = 50,95\n")
    env = env_with_repo() | {"LOCUST_WORKLOAD": "smoke", "LOCUST_NUM_PROMPTS": "60"}
    proc = subprocess.Popen(
        [LOCUST, "-f", "loadtest/locustfile.py", "--config", str(conf), "--web-host",
         "127.0.0.1", "--web-port", str(web), "--host", "http://127.0.0.1", "-u", "4", "-r", "4",
         "--result-dir", str(tmp_path / "results")],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "locust.log", "w"))
    url = f"http://127.0.0.1:{web}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/", timeout=2).read()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "locust.log").read_text()[-2000:]
            time.sleep(0.2)
    yield url, fast, slow, tmp_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def browser(tmp_path):
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            accept_downloads=True, downloads_path=str(tmp_path / "downloads"),
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        try:
            yield browser
        finally:
            browser.close()


def test_ui_run_shows_per_port_rows_and_charts_stops_and_downloads(locust_ui, browser):
    url, fast, slow, tmp_path = locust_ui
    page = browser.new_page()
    page.set_default_timeout(60_000)
    page.goto(url + "/")
    page.get_by_role("button", name="Start").click()
    deadline = time.monotonic() + 30            # the server has started the run (the form's
    while json.loads(urllib.request.urlopen(url + "/stats/requests").read())["state"] \
            not in ("spawning", "running"):     # POST may still be in flight when Stop shows)
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)

    # the extra tab: one row per port with its routing, A/B phase and TTFT percentiles
    page.goto(url + "/?tab=llm-metrics")
    try:
        page.locator("tr", has_text=str(fast)).filter(has_text="(phase 1/2)").first.wait_for()
    except playwright_api.Error:
        page.screenshot(path=str(tmp_path / "llm-metrics-tab.png"), full_page=True)
        raise AssertionError(page.locator("body").inner_text()[-3000:]) from None
    page.get_by_text("TTFT P95 (ms)").wait_for()        # percentiles from locust.conf
    page.wait_for_function(
        "port => [...document.querySelectorAll('tr')].some(tr => tr.innerText.includes(port)"
        " && /\\d+\\.\\d/.test(tr.innerText.split('\\t').slice(6).join(' ')))", arg=str(fast))

    # the page with charts over time: the phase indicator and one line per port and percentile
    page.goto(url + "/loadtest/")
    page.wait_for_function("document.querySelector('#phase').textContent.includes('phase 2/2')",
                           timeout=90_000)
    page.wait_for_selector(f"[data-metric=ttft] polyline[data-port='{slow}']", state="attached")
    assert page.locator(f"[data-metric=ttft] polyline[data-port='{fast}']").count() == 2
    assert page.locator(f"#table tr[data-port^='{fast}']").inner_text().startswith(str(fast))
    assert "running (phase 2/2)" in page.locator(f"#table tr[data-port^='{slow}']").inner_text()

    # stop from the main page; the run explains itself and its result file is offered
    page.goto(url + "/")
    page.get_by_role("button", name="Stop").click()
    page.goto(url + "/loadtest/")
    page.wait_for_function("document.querySelector('#status').textContent.startsWith('stopped')")
    assert "results in" in page.locator("#status").inner_text()
    page.goto(url + "/?tab=reports")
    link = page.get_by_text("Download the last run's result JSON")
    with page.expect_download() as info:
        link.click()
    result = json.loads(Path(info.value.path()).read_text())
    assert result["mode"] == "ab" and result["completed"] >= 60
    assert set(result["by_target"]) == {str(fast), str(slow)}
    assert "p95_ttft_ms" in result and "p95_ttft_ms" in result["by_target"][str(fast)]
    assert result["by_target"][str(slow)]["median_ttft_ms"] > \
        result["by_target"][str(fast)]["median_ttft_ms"]
    saved = list((tmp_path / "results").glob("run-*.samples.jsonl"))
    assert len(saved) == 1 and len(saved[0].read_text().splitlines()) == \
        result["completed"] + result["failed"]
