"""Markdown pieces the benchmarks' BENCHMARKS.md sections are written with."""

from __future__ import annotations

from loadtest.report import change_pct


def md_table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table: the header, its rule, one line a row."""
    line = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    return [line(header), "|---" * len(header) + "|"] + [line(row) for row in rows]


def num(x, digits=0) -> str:
    """A figure with thousands separators, or "n/a"."""
    return "n/a" if x is None else f"{x:,.{digits}f}"


def versus(new, old) -> str:
    """`new` against `old` in percent, signed."""
    return change_pct(old, new)


def spread(run: dict | None, key: str, digits: int) -> str:
    """The reported (median) run's value, then every repeat's in brackets."""
    if not run:
        return "n/a"
    repeats = run.get("repeats") or []
    brackets = f" [{' '.join(num(x[key], digits) for x in repeats)}]" if len(repeats) > 1 else ""
    return num(run.get(key), digits) + brackets


def section(title: str, d: dict | None, body) -> list[str]:
    """A `## title` section: the lines `body(d)` writes, or "(not run)" without results."""
    return [f"## {title}", ""] + (body(d) if d else ["(not run)"]) + [""]
