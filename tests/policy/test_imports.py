"""Imports point one way: no circle among the repository's modules, nor among its top-level
folders. The graph is drawn from the code with `ast` (imports inside functions count too: a lazy
import is still a dependency); test modules are left out (a test may use any folder)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.policy.conftest import ROOT

SKIP_DIRS = {".venv", ".tools", ".cache", ".git", "results", "node_modules"}
PACKAGE_ROOTS = {("picker", "src")}   # picker/src/picker/x.py is module picker.x


def is_test(rel: Path) -> bool:
    return "tests" in rel.parts or rel.name.startswith("test_") or rel.name == "conftest.py"


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every non-test source file under root."""
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP_DIRS or any(p.startswith(".") for p in rel.parts) or is_test(rel):
            continue
        parts = list(rel.with_suffix("").parts)
        if tuple(parts[:2]) in PACKAGE_ROOTS:
            parts = parts[2:]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the repository modules it imports (`from a.b import c`: a.b.c if it is a module,
    else a.b)."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod].update(t for t in map(resolve, names) if t and t != mod)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        for target in targets:
            if target.split(".")[0] != mod.split(".")[0]:
                out.setdefault(mod.split(".")[0], set()).add(target.split(".")[0])
    return out


def edges_within(graph: dict[str, set[str]], folders: set[str]) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                  if m.split(".")[0] in folders and t.split(".")[0] in folders
                  and m.split(".")[0] != t.split(".")[0])


def test_no_import_circle_among_modules():
    assert circles(import_graph(ROOT)) == []


def test_no_import_circle_among_top_level_folders():
    graph = import_graph(ROOT)
    assert [edges_within(graph, c) for c in circles(folder_graph(graph))] == []  # the edges to cut


def test_a_planted_circle_is_found(tmp_path):
    (tmp_path / "alpha").mkdir()
    (tmp_path / "beta").mkdir()
    (tmp_path / "alpha" / "__init__.py").write_text("")
    (tmp_path / "beta" / "__init__.py").write_text("")
    (tmp_path / "alpha" / "one.py").write_text("from alpha import two\n")
    (tmp_path / "alpha" / "two.py").write_text("def f():\n    from .one import g\n")
    (tmp_path / "alpha" / "three.py").write_text("import beta.four\n")
    (tmp_path / "beta" / "four.py").write_text("from alpha.three import x\n")
    (tmp_path / "beta" / "tests").mkdir()
    (tmp_path / "beta" / "tests" / "test_x.py").write_text("import alpha.one\n")
    graph = import_graph(tmp_path)
    assert "beta.tests.test_x" not in graph
    assert sorted(map(sorted, circles(graph))) == [["alpha.one", "alpha.two"],
                                                   ["alpha.three", "beta.four"]]
    assert circles(folder_graph(graph)) == [{"alpha", "beta"}]
