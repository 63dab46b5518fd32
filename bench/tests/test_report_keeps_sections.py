"""BENCHMARKS.md keeps every section whose results are missing: results/ is not in git, so a fresh
checkout regenerating one section must not lose the others."""

from __future__ import annotations

import json

import pytest

from bench import __main__ as bench_main
from bench import common, report
from bench.common import REPO
from bench.registry import BENCHMARKS

VALIDATION = {"command": "python -m validation", "first_run_s": 30.0, "warm_runs_s": [11.0, 12.0, 13.0],
              "warm_median_s": 12.0, "warm_min_s": 11.0, "target_s": 20.0, "load_average_start": 0.3}


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout with the committed BENCHMARKS.md and an empty results/bench/."""
    results = tmp_path / "results" / "bench"
    results.mkdir(parents=True)
    monkeypatch.setattr(common, "RESULTS", results)
    monkeypatch.setattr(report, "REPO", tmp_path)
    (tmp_path / "BENCHMARKS.md").write_text((REPO / "BENCHMARKS.md").read_text())
    return tmp_path


def sections(text: str) -> dict[str, str]:
    """The `## ` sections of a report by heading, each without its trailing blank lines."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = out.setdefault(line, [])
        if current is not None:
            current.append(line)
    return {title: "\n".join(lines).rstrip() for title, lines in out.items()}


def test_the_report_without_any_results_keeps_every_committed_section_as_it_is(checkout):
    committed = sections((REPO / "BENCHMARKS.md").read_text())
    assert len(committed) > 10  # the committed report has figures to lose
    now = sections(report.write())
    assert {t: now.get(t) for t in committed} == committed
    assert [t for t in now if t in committed] == list(committed)  # in the same order
    # a benchmark registered since the report was written gets its place, without figures
    assert all(s.endswith("(not run)") for t, s in now.items() if t not in committed)


def test_only_rewrites_the_sections_named_and_keeps_the_others_even_with_results(checkout):
    committed = sections((REPO / "BENCHMARKS.md").read_text())
    results = common.RESULTS
    (results / "validation.json").write_text(json.dumps(VALIDATION))
    # a stale result of another benchmark must not replace its committed section
    (results / "dead-backend.json").write_text(json.dumps({"command": "stale", "wall_s": 1, "runs": []}))
    text = report.write(only=["validation"])
    now = sections(text)
    assert "| wall s | 30.0 | 12.0 | 11.0 | <= 20 |" in now["## Validation time"]
    assert {t: now[t] for t in committed if t not in ("## Validation time", "## Machine")} == \
        {t: s for t, s in committed.items() if t not in ("## Validation time", "## Machine")}
    # the machine of the kept sections stays, the rewritten one is credited to this machine
    assert now["## Machine"].startswith(committed["## Machine"].split("\n\nSince then")[0])
    assert 'Since then, "Validation time" ran again on:' in now["## Machine"]
    with pytest.raises(ValueError, match="unknown benchmark nope"):
        report.write(only=["nope"])


def test_a_benchmark_with_part_of_its_results_keeps_its_whole_section(checkout, capsys):
    committed = sections((REPO / "BENCHMARKS.md").read_text())
    lab = next(b for b in BENCHMARKS if b.name == "lab")
    assert len(lab.result_names) == 2
    summary = {"policies": {"least-request": {}, "picker": {}}}
    (common.RESULTS / f"{lab.result_names[0]}.json").write_text(json.dumps({"summary": summary, "wall_s": 1}))
    text = report.write()
    assert sections(text)["## Routing lab (virtual time)"] == committed["## Routing lab (virtual time)"]
    assert f"{lab.result_names[1]}.json missing" in capsys.readouterr().err


def test_a_section_no_benchmark_writes_stays_where_it_was(checkout, capsys):
    path = checkout / "BENCHMARKS.md"
    text = path.read_text()
    extra = "## Someone's hand-made table\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    path.write_text(text.replace("## Validation time", extra + "## Validation time", 1))
    out = report.write()
    assert extra + "## Validation time" in out
    assert "Someone's hand-made table" in capsys.readouterr().err


def test_running_some_benchmarks_rewrites_only_their_sections():
    assert bench_main.sections_to_write(["validation", "demo"], None, failed=["demo"]) == ["validation"]
    assert bench_main.sections_to_write([], None, failed=["lab"]) == [b.name for b in BENCHMARKS if b.name != "lab"]
    assert bench_main.sections_to_write(["report"], None, failed=[]) is None
    assert bench_main.sections_to_write(["report"], ["picker"], failed=[]) == ["picker"]


def test_the_command_line_accepts_only_known_names(checkout, capsys):
    assert bench_main.main(["report", "--only", "validation"]) == 0
    with pytest.raises(SystemExit):
        bench_main.main(["report", "--only", "nope"])
