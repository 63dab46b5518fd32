"""The load test's additions to locust's web UI, through its documented extension points.

- an "LLM metrics" tab (template_args extended_tabs/extended_tables, rows added to the
  /stats/requests answer as extended_stats): one row per port with the phase or state, requests,
  failures, throughput and TTFT/TPOT/ITL/E2E mean and percentiles from the raw samples, and a
  whole-run row that says what the run is doing or why it ended;
- the page /loadtest/ (a Flask route on web_ui.app): the same table and status, and charts over
  time per port, refreshed every 2 s;
- download-tab links (extended_csv_files) to the last run's result JSON and raw samples.

Imported by the locustfile on the master (or the single local process) only.
"""
from __future__ import annotations

import json
from pathlib import Path

from flask import Response, jsonify, request, send_file

from loadtest.live import port_row, series, table_structure
from loadtest.metrics import parse_goodput, parse_percentiles
from loadtest.targets import describe_ports, routing

TAB = "llm-metrics"
PAGE = Path(__file__).with_name("webui.html")
DOWNLOADS = {"result.json": 0, "samples.jsonl": 1}


def _settings(environment) -> tuple[tuple, dict]:
    stats = getattr(environment, "loadtest_stats", None)
    if stats:
        return stats["percentiles"], stats["goodput"]
    opts = environment.parsed_options
    try:
        return parse_percentiles(opts.percentiles), parse_goodput(opts.goodput)
    except ValueError:  # the run refuses to start and says why; show the defaults meanwhile
        return parse_percentiles(""), {}


def port_states(environment, plan) -> dict[str, str]:
    """Port -> what its run is doing: running / waiting / done, with the A/B phase."""
    active = str(getattr(environment.runner, "state", "")) in ("spawning", "running")
    ports = plan.options.ports or [None]
    states = {}
    for i, port in enumerate(ports):
        key = str(port or "")
        phase = f" (phase {i + 1}/{plan.phase_count})" if plan.phase_count > 1 else ""
        if plan.finished:
            states[key] = "done" + phase
        elif plan.phase_count > 1 and i < plan.phase:
            states[key] = "done" + phase
        elif plan.phase_count > 1 and i > plan.phase:
            states[key] = ("waiting" if active else "not run") + phase
        elif not active:
            states[key] = "stopped" + phase
        else:
            states[key] = ("running" if plan.phase_open else "draining") + phase
    return states


def snapshot(environment) -> dict:
    """Status, per-port rows and series of the current (or last) run."""
    percentiles, goodput = _settings(environment)
    plan = getattr(environment, "loadtest_plan", None)
    status = getattr(environment, "loadtest_status", "")
    out = {"status": status, "phase": plan.phase_label() if plan else "",
           "columns": table_structure(percentiles, bool(goodput)), "rows": [], "series": {},
           "ports": [], "downloads": [name for name in DOWNLOADS
                                     if _download_path(environment, name) is not None]}
    if plan is None:
        return out
    if status.startswith("running"):  # live progress instead of the line logged at the start
        mode = "A/B, one port after the other" if plan.phase_count > 1 else "all ports at once"
        status = out["status"] = f"running ({mode}): {plan.progress()}"
    samples = list(plan.samples)
    ports = plan.options.ports
    states = port_states(environment, plan)
    names = getattr(environment, "loadtest_routing", {})
    for key, state in states.items():
        mine = [s for s in samples if s.target == key]
        name = names.get(key) or routing(key or None)
        out["rows"].append(port_row(key, mine, state, percentiles, goodput, name))
        out["ports"].append({"port": key, "routing": name})
        if mine:
            out["series"][key] = series(mine, min(s.start for s in mine), percentiles)
    failed = sum(1 for s in samples if not s.success)
    out["rows"].append({"port": "whole run", "state": status, "requests": len(samples),
                        "failures": failed})
    out["percentiles"] = [c["key"][4:] for c in out["columns"] if c["key"].startswith("ttft")
                          and c["key"] != "ttftmean"]
    out["description"] = f"{plan.options.workload}, {describe_ports(ports)}, mode {plan.options.mode}"
    return out


def _download_path(environment, name: str) -> Path | None:
    files = getattr(environment, "loadtest_result_files", [])
    index = DOWNLOADS.get(name)
    if index is None or index >= len(files) or not Path(files[index]).is_file():
        return None
    return Path(files[index])


def install(environment, web_ui) -> None:
    percentiles, goodput = _settings(environment)
    web_ui.template_args["extended_tabs"] = [{"title": "LLM metrics", "key": TAB}]
    web_ui.template_args["extended_tables"] = [
        {"key": TAB, "structure": table_structure(percentiles, bool(goodput))}]
    web_ui.template_args["extended_csv_files"] = [
        {"href": "./loadtest/download/result.json",
         "title": "Download the last run's result JSON (vLLM fields, per port)"},
        {"href": "./loadtest/download/samples.jsonl",
         "title": "Download the last run's raw samples (JSONL)"},
        {"href": "./loadtest/", "title": "LLM metrics page: per-port tables and charts over time"},
    ]
    app = web_ui.app

    @app.after_request
    def _add_llm_rows(response):
        if request.path.rstrip("/").endswith("/stats/requests") and response.is_json:
            data = response.get_json()
            rows = snapshot(environment)["rows"]
            data["extended_stats"] = [{"key": TAB, "data": rows}]
            response.set_data(json.dumps(data))
        return response

    @app.route("/loadtest/")
    @web_ui.auth_required_if_enabled
    def loadtest_page():
        return Response(PAGE.read_text(encoding="utf-8"), mimetype="text/html")

    @app.route("/loadtest/data")
    @web_ui.auth_required_if_enabled
    def loadtest_data():
        return jsonify(snapshot(environment))

    @app.route("/loadtest/download/<name>")
    @web_ui.auth_required_if_enabled
    def loadtest_download(name):
        path = _download_path(environment, name)
        if path is None:
            return Response("no result file yet: it is written when a run finishes or is "
                            "stopped\n", status=404, mimetype="text/plain")
        return send_file(path.resolve(), as_attachment=True, download_name=path.name)
