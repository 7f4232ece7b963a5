"""No loop of imports among src/'s modules, counting the imports inside functions: a function-local import hides
a loop from Python's import system (it runs later), not from a reader following the calls."""

from __future__ import annotations

import ast
from pathlib import Path

from src.paths import PROJECT_ROOT


def modules(root: Path) -> dict[str, Path]:
    """Every module under `root` by its dotted name (a package by its own name)."""
    found = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's imports of the others, at any depth of its code (module level or inside a function)."""
    def owner(name: str) -> str | None:  # `src.a.b.f` is module src.a.b's
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            # A package's module imports its own package on the way in: not a loop of the code's making.
            edges[name] |= {found for found in map(owner, targets)
                            if found and found != name and not name.startswith(found + ".")}
    return edges


def a_loop(edges: dict[str, set[str]]) -> list[str] | None:
    """One import loop (its modules in order, the first again at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (loop := visit(target)):
                return loop
        state[name] = 2
        path.pop()
        return None

    for name in sorted(edges):
        if name not in state and (loop := visit(name)):
            return loop
    return None


def test_src_has_no_import_loop_even_through_imports_inside_functions():
    loop = a_loop(imports(modules(PROJECT_ROOT / "src")))
    assert loop is None, "import loop: " + " -> ".join(loop)


def test_the_walk_finds_a_loop_hidden_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "budget.py").write_text("from pkg import runners\n")
    (package / "runners.py").write_text("def plan():\n    from pkg.plan import schedule\n")
    (package / "plan.py").write_text("def schedule():\n    from pkg.budget import x\n")
    assert a_loop(imports(modules(package))) == ["pkg.budget", "pkg.runners", "pkg.plan", "pkg.budget"]
