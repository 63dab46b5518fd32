"""The docs cannot rot: every relative link resolves (to a file, and to a heading when it names
one); every `make` target and make variable, every `python -m` module and its flags, every flag and
every repo path the front page and docs/ name exists; a measured figure links BENCHMARKS.md; the
front page's picture is what its generator draws.

The commands themselves are not run here (most start a stack or a cluster's worth of work); what
they name is checked against the Makefile, the modules' own `--help` and the tree."""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from docs.diagram import architecture

ROOT = Path(__file__).resolve().parents[2]
FRONT_AND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRONT_PAGE_MAX_LINES = 150

# Paths the docs name that the tree does not hold by design: made by a run, by `make setup`, or
# placeholders for a user's own values.
GENERATED = ("runs/", "results/", ".cache/", ".venv", ".tools/", "locust.conf")


def markdown_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = [ROOT / f for f in listed.stdout.split()]
    return sorted({*files, *FRONT_AND_DOCS})  # the new docs count before they are committed


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"`|\*|\[([^]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        slug = github_slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def code_of(text: str) -> list[str]:
    """The commands and names a doc shows: its inline code spans and its indented code blocks
    (backslash continuations joined)."""
    spans = re.findall(r"`([^`\n]+)`", text)
    block: list[str] = []
    for line in text.splitlines():
        if re.match(r"^( {4}| {6})\S", line) and not re.match(r"^\s*([-*|]|\d+\.)\s", line):
            block.append(line.strip())
    joined = re.sub(r"\\\n", " ", "\n".join(block))
    return spans + joined.splitlines()


@cache
def make_database() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables, as make itself reads them."""
    out = subprocess.run(["make", "-pRrq", "-f", "Makefile", "--no-print-directory"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    targets = {m for m in re.findall(r"^([A-Za-z][\w.-]*):", out, re.M)}
    # only the Makefile's own variables, not the environment's
    variables = set(re.findall(r"^# makefile \(from 'Makefile'.*\n([A-Z_][A-Z0-9_]*) :?\??=", out, re.M))
    return targets, variables


def make_commands(doc: Path) -> list[tuple[str, list[str]]]:
    commands = []
    for code in code_of(doc.read_text()):
        for m in re.finditer(r"\bmake((?: [A-Z_]+=\S+)*)((?: [a-z][\w-]*)+)?((?: [A-Z_]+=(?:\"[^\"]*\"|\S+))*)", code):
            words = (m.group(2) or "").split()
            variables = re.findall(r"([A-Z_]+)=", (m.group(1) or "") + (m.group(3) or ""))
            commands.append((" ".join(words), variables))
    return commands


@pytest.mark.parametrize("doc", FRONT_AND_DOCS, ids=lambda p: p.name)
def test_every_make_target_and_variable_named_exists(doc: Path):
    targets, variables = make_database()
    missing = []
    for words, names in make_commands(doc):
        # `make up && make compare` and prose after a target ("make validate checks") both
        # appear: the first word must be a target; later words are targets only if make knows them
        first = words.split()[0] if words else None
        if first and first not in targets:
            missing.append(f"make {first}")
        missing += [f"make variable {v}" for v in names if v not in variables]
    assert not missing, f"{doc.name} names what the Makefile does not have: {sorted(set(missing))}"


@cache
def help_text(module: str, sub: str | None) -> str:
    args = [sys.executable, "-m", module] + ([sub] if sub else []) + ["--help"]
    run = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return run.stdout if run.returncode == 0 else ""


def python_commands(doc: Path) -> list[tuple[str, str | None, list[str]]]:
    found = []
    for code in code_of(doc.read_text()):
        for m in re.finditer(r"python -m ([\w.]+)((?: +[^\s|;&`#]+)*)", code):
            tokens = m.group(2).split()
            sub = tokens[0] if tokens and re.fullmatch(r"[a-z][\w-]*", tokens[0]) else None
            flags = [t.split("=")[0] for t in tokens if re.fullmatch(r"--[a-z][\w-]*(=\S*)?", t)]
            found.append((m.group(1), sub, flags))
    return found


@pytest.mark.parametrize("doc", FRONT_AND_DOCS, ids=lambda p: p.name)
def test_every_python_module_and_flag_named_exists(doc: Path):
    missing = []
    for module, sub, flags in python_commands(doc):
        text = help_text(module, sub) if sub else ""
        if not text:
            text = help_text(module, None)
        if not text:
            missing.append(f"python -m {module}: no --help")
            continue
        missing += [f"python -m {module}{' ' + sub if sub else ''} {f}" for f in flags
                    if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{doc.name} names what does not exist: {missing}"


@cache
def repo_text() -> str:
    """Where a bare flag may be defined: the Python sources, the Makefile, the manifests and the
    pinned vLLM's flag list."""
    listed = subprocess.run(["git", "ls-files", "*.py", "Makefile", "*.yaml", "validation/vllm-cli/*.txt"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return "\n".join((ROOT / f).read_text(errors="replace") for f in listed if (ROOT / f).is_file())


@pytest.mark.parametrize("doc", FRONT_AND_DOCS, ids=lambda p: p.name)
def test_every_bare_flag_named_is_defined_somewhere(doc: Path):
    flags = {f for code in code_of(doc.read_text()) for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", code)}
    text = repo_text()
    missing = sorted(f for f in flags if f not in text)
    assert not missing, f"{doc.name} names flags nothing defines: {missing}"


def named_paths(doc: Path) -> set[str]:
    tops = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name in (".github", ".ci")}
    paths = set()
    for code in code_of(doc.read_text()):
        for token in re.findall(r"[\w./-]+", code):
            token = token.rstrip(".,:")
            top = token.split("/")[0]
            if "/" in token and top in tops and not token.startswith(GENERATED) and "<" not in token:
                paths.add(token)
    return paths


@pytest.mark.parametrize("doc", FRONT_AND_DOCS, ids=lambda p: p.name)
def test_every_repo_path_named_exists(doc: Path):
    missing = sorted(p for p in named_paths(doc) if not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


# A measured figure: a signed change in percent, or a rate of decisions, tokens or requests.
MEASURED = re.compile(r"(?<![\w.])[+\-−]\d+(?:\.\d+)? ?%|\d[\d,.]* ?(?:decisions/s|tok/s|tokens/s|req/s)")


@pytest.mark.parametrize("doc", FRONT_AND_DOCS, ids=lambda p: p.name)
def test_measured_figures_link_to_benchmarks(doc: Path):
    unlinked = [p.strip()[:100] for p in re.split(r"\n\s*\n", doc.read_text())
                if MEASURED.search(p) and "BENCHMARKS.md" not in p]
    assert not unlinked, f"{doc.name}: paragraphs with measured figures and no link to BENCHMARKS.md: {unlinked}"


def test_the_front_page_stays_short_and_leads_to_every_doc():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= FRONT_PAGE_MAX_LINES
    assert readme.splitlines()[2].split()[:2] == ["make", "demo"]
    assert readme.splitlines()[3].split()[:2] == ["make", "test"]
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    assert linked == {p.name for p in FRONT_AND_DOCS[1:]}, "every doc is in the front page's table"


def test_the_picture_is_what_its_generator_draws():
    assert architecture.SVG.read_text() == architecture.render(), \
        "docs/architecture.svg is stale: run python -m docs.diagram.architecture"
