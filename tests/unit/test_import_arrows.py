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
