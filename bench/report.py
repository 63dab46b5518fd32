"""BENCHMARKS.md from the JSON summaries in results/bench/ (whatever benchmarks have been run): a
header, the machine, then each benchmark's section in the order of bench/registry.py. A section
whose results are missing keeps its text from the current BENCHMARKS.md."""

from __future__ import annotations

import re
import sys
import time

from bench.common import REPO, git_revision, load, machine
from bench.registry import BENCHMARKS


def header() -> list[str]:
    return [
        "# Benchmarks", "",
        f"Written by `python -m bench report` on {time.strftime('%Y-%m-%d %H:%M %Z')} from the runs in "
        f"`results/bench/` (repository at {git_revision()}). Regenerate everything with `make bench` "
        "(30-40 minutes + the lab matrix); each benchmark runs alone with `python -m bench <name>` "
        f"({', '.join(f'`{b.name}`' for b in BENCHMARKS)}), which rewrites its own section only; "
        "`python -m bench report [--only NAME ...]` rewrites sections from the results there are. "
        "A section whose results are missing stays as it was.", ""]


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


def _old_sections(text: str) -> list[tuple[str, list[str]]]:
    """The `## ` sections of an existing BENCHMARKS.md, in their order: (heading, its lines)."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append((line, []))
        if sections:
            sections[-1][1].append(line)
    return sections


def _as_kept(lines: list[str]) -> list[str]:
    """An earlier section's lines as they stand, ending in one blank line."""
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines + [""]


def write(only: list[str] | None = None) -> str:
    """Rewrite BENCHMARKS.md. A benchmark's section is written from its results in results/bench/
    when all of them are there (and, given `only`, the benchmark is one of those names); otherwise
    the current BENCHMARKS.md's section stays as it is, so a checkout without results loses no
    figure. A section of the current file that no registered benchmark writes stays too (in its
    place after the section it followed), with a note on stderr: only a person deletes figures."""
    chosen = [b for b in BENCHMARKS if only is None or b.name in only]
    unknown = set(only or ()) - {b.name for b in BENCHMARKS}
    if unknown:
        raise ValueError(f"unknown benchmark {' '.join(sorted(unknown))}; known: {' '.join(b.name for b in BENCHMARKS)}")
    data = {b.name: [load(r) for r in b.result_names] for b in chosen}
    loads = [v for results in data.values() for d in results if d
             for v in (d.get("load_average_start"), d.get("load_average_end")) if v is not None]
    path = REPO / "BENCHMARKS.md"
    old = _old_sections(path.read_text()) if path.exists() else []
    old_by_title = dict(old)
    written: dict[str, list[str]] = {}
    fresh, kept_any = [], False
    for b in BENCHMARKS:
        results = data.get(b.name)
        complete = results is not None and all(d is not None for d in results)
        title = b.section(*(None for _ in b.result_names))[0]
        previous = old_by_title.get(title)
        if complete or (previous is None and results is not None):
            section = b.section(*results)
            if "(not run)" not in section:
                fresh.append(f'"{title[3:]}"')
        elif previous is not None:
            section, kept_any = _as_kept(previous), True
            if results is not None:
                missing = [r for r, d in zip(b.result_names, results) if d is None]
                print(f"{b.name}: results/bench/{', '.join(m + '.json' for m in missing)} missing: "
                      "its section stays as it was", file=sys.stderr)
        else:
            section = b.section(*(None for _ in b.result_names))
        written[title] = section
    sections = _in_order(written, old)
    previous_machine = old_by_title.get("## Machine") if kept_any else None
    lines = header() + machine_section(machine(), loads, previous_machine, fresh) + sections
    text = "\n".join(lines).rstrip() + "\n"
    path.write_text(text)
    print(f"wrote {path}" + (f" (sections of {', '.join(b.name for b in chosen)})" if only is not None else ""))
    return text


def _in_order(written: dict[str, list[str]], old: list[tuple[str, list[str]]]) -> list[str]:
    """The registered sections in the registry's order, each earlier section no benchmark writes
    any more right after the section it followed in the current file (at the start if it led)."""
    orphans: dict[str | None, list[list[str]]] = {}
    before = None
    for title, lines in old:
        if title == "## Machine":
            continue
        if title not in written:
            print(f"kept the section {title[3:]!r}: no benchmark writes it (delete it by hand if it is obsolete)",
                  file=sys.stderr)
            orphans.setdefault(before, []).append(_as_kept(lines))
        else:
            before = title
    out = [line for kept in orphans.get(None, []) for line in kept]
    for title, lines in written.items():
        out += lines
        out += [line for kept in orphans.get(title, []) for line in kept]
    return out
