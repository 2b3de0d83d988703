"""The library's import graph has no circles, and importing `core` does nothing but import."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.threads import OMP_VARIABLES

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"


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
            out |= {s for s in subs if is_module(s)} | ({node.module} if any(not is_module(s) for s in subs) else set())
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
                    "def f():\n    from core.decoding import tree\n    import core.config\n")
    assert imports_of(path) == {"core.gpucheck", "core.decoding.tree", "core.config"}


def test_core_has_no_import_circles():
    """Lazy imports inside functions count too: a circle hidden in one still ties the modules together."""
    assert [sorted(c) for c in circles(import_graph())] == []


def test_the_probe_checks_the_forwards_the_loop_runs_without_importing_the_engine():
    """The split of issue 34 item 1: the forwards, the numerics and the drafter protocol below the engine."""
    graph = import_graph()
    assert "core.decoding.engine" not in graph["core.decoding.probe"] and "core.decoding.forward" in graph["core.decoding.probe"]
    assert {"core.decoding.forward", "core.decoding.numerics", "core.decoding.drafter"} <= graph["core.decoding.engine"]
    assert not {"core.decoding.engine", "core.decoding.numerics", "core.decoding.probe"} & (graph["core.decoding.forward"] | graph["core.decoding.drafter"])


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_importing_core_and_its_commands_has_no_side_effects():
    out = run_python(
        "import json, os, time\n"
        "import torch, fastapi, transformers.models.llama.modeling_llama  # their own imports set variables\n"
        "slept = []\n"
        "time.sleep = slept.append\n"
        "before = dict(os.environ)\n"
        "import core, core.threads, core.config, core.generate, core.bench, core.serve\n"
        "print(json.dumps({'slept': slept, 'changed': sorted(set(os.environ.items()) ^ set(before.items())),\n"
        "                  'chosen': core.threads._policy is not None}))\n")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"slept": [], "changed": [], "chosen": False}


def test_start_measures_once_and_sets_the_environment():
    """The negative control of the test above: start() does what importing must not."""
    out = run_python(
        "import json, os, time\n"
        "from core import threads\n"
        "first, again = threads.start(), threads.start()\n"
        "print(json.dumps({'wait': first.wait, 'same': first is again is threads.policy() is threads.POLICY,\n"
        "                  'omp': {k: os.environ.get(k) for k in threads.OMP_VARIABLES}}))\n")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["same"]
    expected = {"short spin": {"GOMP_SPINCOUNT": "10000"}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}[got["wait"]]
    assert {k: v for k, v in got["omp"].items() if v is not None} == expected


@pytest.mark.parametrize("command", ["core.bench", "core.serve", "core.autotune", "core.gpucheck", "core.train"])
def test_each_command_starts_the_thread_policy_before_torch_loads(command):
    out = run_python(
        "import runpy, sys\n"
        "import core.threads\n"
        "start, seen = core.threads.start, []\n"
        "core.threads.start = lambda: (seen.append('torch' in sys.modules), start())[1]\n"
        f"sys.argv = [{command!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_module({command!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch loaded first:', seen[:1])\n")  # the first call counts; main() calls it again
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "torch loaded first: [False]"
