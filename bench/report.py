"""BENCHMARKS.md from the JSON summaries in results/bench/ (whatever benchmarks have been run): a
header, the machine, then each benchmark's section in the order of bench/registry.py."""

from __future__ import annotations

import re
import time

from bench.common import REPO, git_revision, load, machine
from bench.registry import BENCHMARKS


def header() -> list[str]:
    return [
        "# Benchmarks", "",
        f"Written by `python -m bench report` on {time.strftime('%Y-%m-%d %H:%M %Z')} from the runs in "
        f"`results/bench/` (repository at {git_revision()}). Regenerate everything with `make bench` "
        "(30-40 minutes + the lab matrix); each benchmark runs alone with `python -m bench <name>` "
        f"({', '.join(f'`{b.name}`' for b in BENCHMARKS)}), then `python -m bench report`.", ""]


def machine_lines(m: dict, loads: list[float]) -> list[str]:
    """The bullets that say where the runs of this report ran and how busy the machine was."""
    busy = max(loads) if loads else None
    shared = (f"The machine was shared with other work while these ran (1-minute load average "
              f"{min(loads):.1f}-{max(loads):.1f} on {m['nproc']} cores at the start and end of the benchmarks), "
              "so times and the HTTP figures carry that noise." if busy and busy > 0.5 * m["nproc"]
              else "The machine was otherwise idle (load average below half the cores).")
    return [f"- {m['nproc']} CPUs: {m['cpu_model']}", f"- memory: {m['memory_gb']} GB",
            f"- Python {m['python']}, Linux {m['kernel']}", f"- {shared}"]


def machine_section(m: dict, loads: list[float], old: list[str] | None, fresh: list[str]) -> list[str]:
    """`## Machine`. When some sections are kept from the previous report, its machine section
    stays (those figures were measured there) and the sections run now are named with their own
    machine, so that no figure is credited to a machine it did not run on. A section run now
    leaves the earlier "Since then" block that named it (a block left naming nothing goes), so
    the section lists each machine once. Rewriting the report from the same runs adds nothing."""
    now = machine_lines(m, loads)
    if old is None:
        return ["## Machine", ""] + now + [""]
    head, blocks = _rerun_blocks(old)
    since = [f"Since then, {', '.join(fresh)} ran again on:", ""] + now
    lines = head
    for names, body in blocks:
        left = [n for n in names if n not in fresh]
        if left:
            lines += ["", f"Since then, {', '.join(left)} ran again on:"] + body
    if fresh:
        lines += [""] + since
    return lines + [""]


_SINCE = re.compile(r'^Since then, (.*) ran again on:$')


def _rerun_blocks(old: list[str]) -> tuple[list[str], list[tuple[list[str], list[str]]]]:
    """An earlier machine section split into its first part and its "Since then" blocks, each
    as (the quoted section titles it names, its lines after the heading)."""
    head: list[str] = []
    blocks: list[tuple[list[str], list[str]]] = []
    for line in old:
        match = _SINCE.match(line)
        if match:
            blocks.append((re.findall(r'"[^"]*"', match.group(1)), []))
        elif blocks:
            blocks[-1][1].append(line)
        else:
            head.append(line)

    def trim(lines: list[str]) -> list[str]:
        while lines and not lines[-1].strip():
            lines = lines[:-1]
        return lines
    return trim(head), [(names, trim(body)) for names, body in blocks]


def _old_sections(text: str) -> dict[str, list[str]]:
    """The `## ` sections of an existing BENCHMARKS.md, by heading."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line, [])
        if current is not None:
            current.append(line)
    return sections


def _previous(lines: list[str], old: dict[str, list[str]]) -> list[str] | None:
    """The previous report's section for a benchmark without results here, if it had figures."""
    previous = old.get(lines[0])
    if "(not run)" in lines and previous and "(not run)" not in previous:
        return previous + ([""] if previous[-1] else [])
    return None


def write() -> str:
    data = {b.name: [load(r) for r in b.result_names] for b in BENCHMARKS}
    loads = [v for results in data.values() for d in results if d
             for v in (d.get("load_average_start"), d.get("load_average_end")) if v is not None]
    path = REPO / "BENCHMARKS.md"
    old = _old_sections(path.read_text()) if path.exists() else {}
    sections, fresh, kept_any = [], [], False
    for b in BENCHMARKS:
        section = b.section(*data[b.name])
        previous = _previous(section, old)
        kept_any |= previous is not None
        if "(not run)" not in section:
            fresh.append(f'"{section[0][3:]}"')
        sections += previous or section
    previous_machine = old.get("## Machine") if kept_any else None
    lines = header() + machine_section(machine(), loads, previous_machine, fresh) + sections
    text = "\n".join(lines).rstrip() + "\n"
    path.write_text(text)
    print(f"wrote {REPO / 'BENCHMARKS.md'}")
    return text
