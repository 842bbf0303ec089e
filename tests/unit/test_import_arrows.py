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
    # tests test the product and never lean on a benchmark's code: what they share with bench/ lives in tests/
    # (tests/netns.py, wire_fuzz.py, learning_probe.py, ...), and bench/'s own tests live in bench/
    ("tests", {"bench"}),
])
def test_dependency_arrows_point_to_arpo_async_only(package, forbidden):
    assert violations(package, forbidden) == []


# ------------------------------------------------------------------ bench/ is a package; tests/ does not reach into it


def path_edits(path: Path) -> list[tuple[int, str]]:
    """(line number, that line's source) of every use of ``sys.path`` in one file (an insert, an append, an
    assignment or a read)."""
    text = path.read_text()
    lines = text.splitlines()
    return sorted({(node.lineno, lines[node.lineno - 1].strip()) for node in ast.walk(ast.parse(text, str(path)))
                   if isinstance(node, ast.Attribute) and node.attr == "path"
                   and isinstance(node.value, ast.Name) and node.value.id == "sys"})


def imports_from_tests(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every ``tests.<...>`` module one file imports (``from tests import x`` names
    ``tests.x``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tests":
            names = [f"tests.{alias.name}" for alias in node.names] if node.module == "tests" else [node.module]
            found += [(node.lineno, name) for name in names]
    return found


def harness_module(name: str) -> bool:
    """Whether dotted ``name`` is one of tests/'s helper modules (tests/<name>.py, not a test file nor conftest),
    the only part of tests/ that bench/ may import."""
    parts = name.split(".")
    return (len(parts) == 2 and (ROOT / "tests" / f"{parts[1]}.py").is_file()
            and not parts[1].startswith("test_") and parts[1] != "conftest")


def test_the_bench_checks_can_fail(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.path.insert(0, 'bench')\nfrom tests import support, netns\n"
                      "from tests.integration.test_resume import tail\n")
    assert path_edits(script) == [(2, "sys.path.insert(0, 'bench')")]
    assert imports_from_tests(script) == [(3, "tests.support"), (3, "tests.netns"),
                                              (4, "tests.integration.test_resume")]
    assert harness_module("tests.netns") and not harness_module("tests.integration.test_resume")
    assert not harness_module("tests.conftest") and not harness_module("tests.no_such_module")


def test_bench_runs_as_a_package_without_sys_path_edits():
    # `python -m bench.<name>` from the repository root: no bench file puts a folder on sys.path (a module that
    # loads under two names, bench_actor_loop and bench.bench_actor_loop, holds two copies of its state)
    files = sorted((ROOT / "bench").rglob("*.py"))
    assert files
    assert {str(p.relative_to(ROOT)): edits for p in files if (edits := path_edits(p))} == {}


def test_no_test_puts_bench_on_sys_path():
    # an import of bench/ by another name: sys.path.insert(0, ".../bench") then `import gpu_model`
    edits = {str(p.relative_to(ROOT)): [e for e in path_edits(p) if "bench" in e[1]]
             for p in sorted((ROOT / "tests").rglob("*.py"))}
    assert {path: e for path, e in edits.items() if e} == {}


def test_bench_imports_only_the_helper_modules_of_tests():
    # bench/ may use what tests/ shares with it (network namespaces, the wire fuzzer, the learning probe), never a
    # test file nor conftest
    found = {str(p.relative_to(ROOT)): [(line, name) for line, name in imports_from_tests(p)
                                         if not harness_module(name)]
             for p in sorted((ROOT / "bench").rglob("*.py"))}
    assert {path: bad for path, bad in found.items() if bad} == {}


# ------------------------------------------------------------------ no import circles anywhere, no long modules

PACKAGES = ("arpo_async", "arpo_serve", "learner", "actors", "arpo_cli", "bench")
"""Every package of the tree whose imports the circle check reads (tests/ is the product's user, not part of it)."""


def module_imports(root: Path, *packages: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same packages: line}}`` for every module under ``root / package`` of each
    of ``packages``, from every import (inside functions and ``if TYPE_CHECKING:`` included): ``import p.a``,
    ``from p.a import x``, ``from p import a`` (a module, else the package) and relative imports. In a folder that
    is no package (no ``__init__.py``: scripts run with their own folder on ``sys.path``, as the desktop image's
    controller), ``import b`` of a sibling file ``b.py`` names that sibling."""
    files = {".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
             for package in packages for path in sorted((root / package).rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        script_folder = None if (path.parent / "__init__.py").exists() else name.rpartition(".")[0]
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
                if target not in files and script_folder and not getattr(node, "level", 0):
                    target = f"{script_folder}.{target}"
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


def test_the_circle_finder_sees_circles_across_packages_and_script_folders(tmp_path):
    # a circle through two packages, and one between two scripts of a folder without __init__.py
    for folder in ("p", "q", "p/image"):
        (tmp_path / folder).mkdir()
    (tmp_path / "p" / "__init__.py").write_text("")
    (tmp_path / "q" / "__init__.py").write_text("")
    (tmp_path / "p" / "a.py").write_text("import q.b\n")
    (tmp_path / "q" / "b.py").write_text("def f():\n    from p.a import x\n")
    (tmp_path / "p" / "image" / "server.py").write_text("import routes\n")
    (tmp_path / "p" / "image" / "routes.py").write_text("from server import App\n")
    assert sorted(import_circles(module_imports(tmp_path, "p", "q"))) == [
        ["p.a:1 -> q.b", "q.b:2 -> p.a"],
        ["p.image.routes:1 -> p.image.server", "p.image.server:1 -> p.image.routes"]]


def test_no_package_has_import_circles():
    # module-level, lazy and type-checking imports all count: a circle hidden in a function is still a circle; one
    # graph over every package, so a circle through two packages is found too
    assert import_circles(module_imports(ROOT, *PACKAGES)) == []


ROOMS = ("learner.state", "learner.algo", "learner.rollouts", "learner.train", "learner.run", "learner.main")
"""learner/'s rooms from the bottom up: a module may import its own room and the rooms below it, never one above
(the algorithm imports neither the conversation with actors nor the trainer; the run's state imports nothing)."""


def room_of(module: str) -> int:
    """The index in :data:`ROOMS` of the room that holds dotted ``module`` (ValueError: in none of them)."""
    for index, room in enumerate(ROOMS):
        if module == room or module.startswith(room + "."):
            return index
    raise ValueError(f"{module} is in none of learner/'s rooms {ROOMS}: add it to one")


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """``module:line -> imported`` for every import of a module in a higher room than the importer's."""
    return sorted(f"{a}:{line} -> {b}" for a, targets in graph.items() if a != "learner"
                  for b, line in targets.items() if b != "learner" and room_of(b) > room_of(a))


def test_the_room_check_can_fail():
    graph = {"learner.algo.batcher": {"learner.train.trainer": 12, "learner.state": 3},
             "learner.rollouts.service": {"learner.algo.baseline": 40}, "learner.state": {}}
    assert upward_imports(graph) == ["learner.algo.batcher:12 -> learner.train.trainer"]
    with pytest.raises(ValueError, match="none of learner"):
        room_of("learner.stray")


def test_learner_rooms_import_downwards_only():
    # state <- algo <- rollouts <- train <- main: a trajectory that leaves a room never comes back to it
    assert upward_imports(module_imports(ROOT, "learner")) == []


MAX_MODULE_LINES = 500
"""The longest a module may be, in every folder of source; there is no allowlist (a longer module is split by role)."""


def source_folders(root: Path) -> list[Path]:
    """The top-level folders of ``root`` that hold Python source: each package (``__init__.py`` at its top: the
    product's, bench/, tests/) and each folder of scripts (a ``.py`` file at its top: examples/). Hidden folders
    (the virtual environment) and folders with no Python at their top (runs/, docs/) are not source."""
    return sorted(path for path in root.iterdir()
                  if path.is_dir() and not path.name.startswith(".") and any(path.glob("*.py")))


def long_modules(root: Path) -> dict[str, int]:
    """``{path relative to root: lines}`` of every module over MAX_MODULE_LINES in the source folders of ``root``,
    subfolders included. Test modules (``test_*.py``, in tests/ and bench/) hold lists of cases and are left out;
    every other module counts, tests' helper modules (conftest.py, support.py, ...) and bench/'s included."""
    lengths = {str(path.relative_to(root)): len(path.read_text().splitlines())
               for folder in source_folders(root) for path in sorted(folder.rglob("*.py"))
               if not path.name.startswith("test_")}
    return {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}


def test_the_length_check_sees_every_source_folder(tmp_path):
    # the check must be able to fail: a long module deep in a package and a long helper of tests/ are found, one at
    # the bound is not; a long test module and long files outside the source (a virtual environment, a run's
    # folder) are not counted
    for folder in ("pkg/sub", "tests", "examples", ".venv/lib", "runs/r1"):
        (tmp_path / folder).mkdir(parents=True)
    for init in ("pkg", "tests"):
        (tmp_path / init / "__init__.py").write_text("")
    for path, lines in (("pkg/sub/long.py", 501), ("tests/support.py", 600), ("tests/test_cases.py", 900),
                        ("examples/script.py", 500), (".venv/lib/big.py", 900), ("runs/r1/big.py", 900)):
        (tmp_path / path).write_text("x = 1\n" * lines)
    assert [p.name for p in source_folders(tmp_path)] == ["examples", "pkg", "tests"]
    assert long_modules(tmp_path) == {"pkg/sub/long.py": 501, "tests/support.py": 600}


def test_no_module_is_over_500_lines():
    # every package of the product, bench/ and tests/ (its helper modules), and examples/
    folders = {path.name for path in source_folders(ROOT)}
    assert {"arpo_async", "arpo_serve", "learner", "actors", "arpo_cli", "bench", "tests", "examples"} <= folders
    assert long_modules(ROOT) == {}


def test_test_modules_have_unique_basenames():
    # pytest's default import mode puts each test folder on sys.path and imports a test module by its basename, so two
    # test_x.py in two folders without __init__.py stop the whole collection ("import file mismatch")
    by_name: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if not (path.parent / "__init__.py").exists():
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
