"""The library's import graph has no circles, and importing `core` does nothing but import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
KNOWN_CIRCLES = [{"core.engine", "core.probe"}]  # issue 34 item 1: being split apart in core/engine.py


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The core modules a file imports anywhere in it (functions and TYPE_CHECKING blocks too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("core.")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("core"):
            subs = {f"{node.module}.{a.name}" for a in node.names}
            out |= {s for s in subs if is_module(s)} | ({node.module} if node.module != "core" else set())
    return {m for m in out if is_module(m)}


def import_graph(root: Path = CORE) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(root.rglob("*.py"))}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while v not in comp:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_imports_inside_functions_and_type_checking(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from core.gpucheck import Report\n"
                    "def f():\n    from core import tree\n    import core.config\n")
    assert imports_of(path) == {"core.gpucheck", "core.tree", "core.config"}


def test_core_has_no_import_circles_but_the_known_one():
    found = circles(import_graph())
    assert all(c in KNOWN_CIRCLES for c in found), [sorted(c) for c in found if c not in KNOWN_CIRCLES]
