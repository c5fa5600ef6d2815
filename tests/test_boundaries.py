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
