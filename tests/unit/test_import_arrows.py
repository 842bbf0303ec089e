"""The dependency arrows between the packages, read from the source with ast (every import, lazy ones inside
functions included): actors/, learner/ and arpo_serve/ may import arpo_async; arpo_async imports none of them nor
the command-line layer arpo_cli; learner/ does not import actors/ (the inference client both use is
arpo_async.inference_client); nothing but arpo_cli imports arpo_serve or arpo_cli, nor ray (the launcher's own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(path: Path, package: str) -> set[tuple[str, int]]:
    """(top-level package, line) of every import in one file; relative imports resolve to ``package``."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((package if node.level else (node.module or "").split(".")[0], node.lineno))
    return found


def violations(package: str, forbidden: set[str]) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {ROOT / package}"
    return [f"{path.relative_to(ROOT)}:{line} imports {name}" for path in files
            for name, line in sorted(imported_packages(path, package)) if name in forbidden]


def test_the_walker_sees_lazy_and_relative_imports(tmp_path):
    # the check itself must be able to fail: an import inside a function and a relative one are both found
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    from actors.episode import Step\n    import learner.main\n"
                                           "from . import sibling\n")
    assert imported_packages(tmp_path / "pkg" / "m.py", "pkg") == {("actors", 2), ("learner", 3), ("pkg", 4)}


@pytest.mark.parametrize(("package", "forbidden"), [
    ("arpo_async", {"actors", "learner", "arpo_cli", "arpo_serve", "matplotlib", "ray"}),
    ("actors", {"learner", "arpo_cli", "arpo_serve", "matplotlib", "ray"}),  # an actor host draws no curves
    # Ray only launches and supervises (arpo_cli.cluster): no process of a run imports it
    ("learner", {"actors", "arpo_cli", "arpo_serve", "ray"}),
    ("arpo_serve", {"actors", "learner", "arpo_cli", "ray"}),  # the inference server is a process of its own
    ("tests/unit", {"bench"}),  # unit tests test the product, not a benchmark's code
])
def test_dependency_arrows_point_to_arpo_async_only(package, forbidden):
    assert violations(package, forbidden) == []


# ------------------------------------------------------------------ no import circles in learner/, no long modules


def module_imports(root: Path, package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same package: line}}`` for every module under ``root / package``, from
    every import (inside functions and ``if TYPE_CHECKING:`` included): ``import p.a``, ``from p.a import x``,
    ``from p import a`` (a module, else the package) and relative imports."""
    files = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(part for part in (base, node.module or "") if part)
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module
                           for alias in node.names]
            else:
                continue
            for target in targets:
                if target in files and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles of ``graph``: one list per strongly connected component of more than one module (or a
    module importing itself), each as ``module:line -> imported`` arrows inside it."""
    order, low, stack, circles = {}, {}, [], []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                circles.append(sorted(f"{a}:{line} -> {b}" for a in component
                                      for b, line in graph[a].items() if b in component))

    for module in graph:
        if module not in order:
            visit(module)
    return circles


def test_the_circle_finder_sees_lazy_and_relative_imports(tmp_path):
    # the check must be able to fail: a -> b at module level, b -> a only inside a function, c -> a relatively
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    import pkg.a\n")
    (tmp_path / "pkg" / "c.py").write_text("from .a import x\n")
    graph = module_imports(tmp_path, "pkg")
    assert graph["pkg.c"] == {"pkg.a": 1}
    assert import_circles(graph) == [["pkg.a:1 -> pkg.b", "pkg.b:2 -> pkg.a"]]


def test_learner_has_no_import_circles():
    # module-level, lazy and type-checking imports all count: a circle hidden in a function is still a circle
    assert import_circles(module_imports(ROOT, "learner")) == []


MAX_MODULE_LINES = 500
LONG_MODULES = {
    "learner/service.py",  # 541 lines: the learner's re-cut into rooms (issue 36 items 1-2) takes it apart
    # not split yet: arpo_async/tasks.py (566 lines), arpo_serve/app.py (536), arpo_async/codec.py (502)
    "arpo_async/tasks.py",
    "arpo_serve/app.py",
    "arpo_async/codec.py",
}
"""Modules allowed over MAX_MODULE_LINES for now; the list only shrinks (a listed module that fits fails)."""


def module_lengths() -> dict[str, int]:
    return {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
            for package in ("arpo_async", "arpo_serve", "learner", "actors", "arpo_cli")
            for path in sorted((ROOT / package).rglob("*.py"))}


def test_no_module_is_over_500_lines():
    lengths = module_lengths()
    assert {path: n for path, n in lengths.items()
            if n > MAX_MODULE_LINES and path not in LONG_MODULES} == {}
    assert {path: lengths.get(path) for path in LONG_MODULES
            if lengths.get(path, 0) <= MAX_MODULE_LINES} == {}, "a listed module fits now: drop it from LONG_MODULES"
