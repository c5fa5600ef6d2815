"""The package boundaries of the README's layout, enforced on every import statement
(module level and inside functions), plus one live check that the contract package loads
without the heavy stacks.

- pfcompile.formats (the contract): no torch, ortools, networkx, graphviz, no runtime and
  no other part of pfcompile.
- the compiler (pfcompile outside the profiler): no torch and no runtime.
- runtime: no ortools, networkx or graphviz; of pfcompile only the contract package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "ortools", "networkx", "graphviz")


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base))
            # `from pfcompile import place` imports pfcompile.place
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if base in ("pfcompile", "runtime")]
    return out


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(root: Path = ROOT) -> list[str]:
    """Every import that crosses a boundary, as 'file:line: imports X (rule)'."""
    found = []
    for path in sorted([*root.glob("pfcompile/**/*.py"), *root.glob("runtime/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        for line, mod in imports_of(path, root):
            rule = None
            if rel.startswith("pfcompile/formats/"):
                if any(_under(mod, h) for h in HEAVY) or _under(mod, "runtime") or (
                        _under(mod, "pfcompile") and not _under(mod, "pfcompile.formats") and mod != "pfcompile"):
                    rule = "the contract package imports only the standard library and itself"
            elif rel.startswith("pfcompile/") and not rel.startswith("pfcompile/profiler/"):
                if _under(mod, "torch") or _under(mod, "runtime"):
                    rule = "the compiler outside the profiler imports no torch and no runtime"
            elif rel.startswith("runtime/"):
                if any(_under(mod, h) for h in ("ortools", "networkx", "graphviz")):
                    rule = "the runtime imports no solver or graph stack"
                elif _under(mod, "pfcompile") and not _under(mod, "pfcompile.formats"):
                    rule = "the runtime imports only pfcompile.formats of pfcompile"
            if rule:
                found.append(f"{rel}:{line}: imports {mod} ({rule})")
    return found


def test_no_import_crosses_a_boundary():
    assert violations() == []


def test_a_forbidden_import_is_found(tmp_path):
    """The check itself can fail: a copy of the tree with one forbidden import added."""
    import shutil

    for pkg in ("pfcompile", "runtime"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "data"))
    for rel, line, expect in (
            ("pfcompile/formats/ops.py", "import torch\n", "pfcompile/formats/ops.py"),
            ("pfcompile/graph/costs.py", "def f():\n    import torch\n", "pfcompile/graph/costs.py"),
            ("runtime/pipeline/comm.py", "from pfcompile.place.build import build_plan\n", "runtime/pipeline/comm.py"),
            ("runtime/optimizers/kfac.py", "import networkx as nx\n", "runtime/optimizers/kfac.py"),
            ("pfcompile/formats/plan.py", "from pfcompile.graph import schedules\n", "pfcompile/formats/plan.py")):
        f = tmp_path / rel
        original = f.read_text()
        f.write_text(original + "\n" + line)
        found = violations(tmp_path)
        assert len(found) == 1 and found[0].startswith(expect), (rel, found)
        f.write_text(original)
    assert violations(tmp_path) == []


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file, function bodies too).
    A module's import of its own parent package is left out: Python loads the parent first
    either way, and `from pkg import sibling` resolves to the sibling module."""
    paths = {}
    for path in [*root.glob("pfcompile/**/*.py"), *root.glob("runtime/**/*.py")]:
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    graph = {}
    for name, path in paths.items():
        targets = set()
        for _, mod in imports_of(path, root):
            while mod and mod not in paths:
                mod = mod.rpartition(".")[0]
            if mod and mod != name and not name.startswith(mod + "."):
                targets.add(mod)
        graph[name] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert import_circles(module_graph()) == []


def test_an_import_circle_is_found():
    graph = module_graph()
    graph["runtime.io.data"] = graph["runtime.io.data"] | {"runtime.pipeline.loop"}  # loop imports data
    assert ["runtime.io.data", "runtime.pipeline.loop"] in import_circles(graph)


def test_runtime_is_in_subpackages():
    """At most 8 modules directly in runtime/: the rest lives in a subpackage per stage of
    the data flow (config, models, optimizers, pipeline, observe, io)."""
    top = sorted(p.name for p in (ROOT / "runtime").glob("*.py"))
    assert len(top) <= 8, top
    assert {"config", "models", "optimizers", "pipeline", "observe", "io"} <= {
        p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").is_file()}


@pytest.mark.e2e
def test_contract_and_runtime_load_without_heavy_stacks():
    code = ("import sys, pfcompile.formats.plan, pfcompile.formats.profile, pfcompile.formats.trace, "
            "pfcompile.formats.jsonio, pfcompile.formats.ops;"
            "print(sorted(m for m in ('torch','ortools','networkx','graphviz') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = ("import sys, runtime.pipeline.interpreter, runtime.io.checkpoint, runtime.observe.measure;"
            "print(sorted(m for m in ('ortools','networkx','graphviz') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
