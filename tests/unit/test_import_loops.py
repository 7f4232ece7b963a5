"""No loop of imports among src/'s modules, counting the imports inside functions: a function-local import hides
a loop from Python's import system (it runs later), not from a reader following the calls. Nor among src/'s
wings (its folders, each read as one room, as docs/layout.md draws them), and at most ten modules loose in src/."""

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


def wings(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports between src/'s wings: a module of src/<wing>/ counts as src.<wing>, a loose one as itself."""
    def wing(name: str) -> str:
        return ".".join(name.split(".")[:2])

    joined: dict[str, set[str]] = {}
    for name, targets in edges.items():
        joined.setdefault(wing(name), set()).update(wing(t) for t in targets if wing(t) != wing(name))
    return joined


def test_src_wings_import_each_other_one_way_only():
    loop = a_loop(wings(imports(modules(PROJECT_ROOT / "src"))))
    assert loop is None, "wings in a loop (a module of one imports the other, both ways): " + " -> ".join(loop)


def test_at_most_ten_modules_sit_loose_in_src():
    loose = sorted(p.name for p in (PROJECT_ROOT / "src").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 10, f"{len(loose)} modules loose in src/ ({', '.join(loose)}): move one into the wing it serves"


def test_the_wings_walk_finds_two_folders_that_import_each_other():
    edges = {"src.a.x": {"src.b.y"}, "src.b.z": {"src.a.w"}, "src.a.w": set(), "src.b.y": set(), "src.c": {"src.a.x"}}
    assert a_loop(wings(edges)) == ["src.a", "src.b", "src.a"]


def test_the_walk_finds_a_loop_hidden_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "budget.py").write_text("from pkg import runners\n")
    (package / "runners.py").write_text("def plan():\n    from pkg.plan import schedule\n")
    (package / "plan.py").write_text("def schedule():\n    from pkg.budget import x\n")
    assert a_loop(imports(modules(package))) == ["pkg.budget", "pkg.runners", "pkg.plan", "pkg.budget"]
