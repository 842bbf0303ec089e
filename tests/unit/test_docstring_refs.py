"""Every dotted reference to the project's own code in a docstring resolves: a renamed or moved function, class or
module leaves no docstring naming the old place (issue 52 item 5: ``learner.main.inference_engines`` was named
after it had gone).

What counts as a reference, in the docstrings of modules, classes and functions of every package: a dotted name that
starts with one of the project's packages (``learner.algo.grpo.grpo_advantages``, in double backticks, a Sphinx role
or plain text), and the dotted target of a Sphinx role (:meth:`Class.method`, :class:`~x.Y`, ...), which may also
start from a name of the module's namespace, of the class the docstring stands in, or of any import of the module
(a lazy or ``if TYPE_CHECKING:`` one). A reference resolves when ``importlib`` imports its longest module prefix and
``getattr`` walks the rest (a module path alone counts; so does an instance attribute a class assigns as
``self.name`` or annotates). Not references: the run configuration's dotted keys (``learner.lr``: arpo_async.config's
keys, which share their first part with a package), file names (``learner.pt``), wildcards (``actors.settle_*``),
undotted role targets (:func:`name`), and the few non-keys that docstrings show on purpose (:data:`NOT_CODE`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

from arpo_async.config import dotted_keys

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("arpo_async", "arpo_serve", "learner", "actors", "arpo_cli", "bench")
"""The packages whose docstrings are read (tests/ uses the product and is not read)."""

FILE_SUFFIXES = {"py", "pt", "pth", "toml", "json", "jsonl", "md", "yaml", "yml", "txt", "sh", "html", "j2", "png",
                 "csv", "log", "safetensors"}
"""A dotted name ending in one of these is a file's name (``learner.pt``), not code."""

NOT_CODE = {
    # suggest_keys' docstring shows unknown keys and what they are pointed to
    ("arpo_async/config_fields.py", "actors.lr"),
    ("arpo_async/config_fields.py", "learner.run_dir"),
    ("arpo_async/config_fields.py", "learner.lrr"),
}
"""(file, dotted name) pairs that a docstring writes on purpose and that name no code."""

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|data|attr|mod|obj|exc|const):`~?\.?([A-Za-z_][\w.]*)`")
"""A Sphinx cross-reference role and its target (``~`` and a leading ``.`` only change how it is shown)."""


def project_names(packages: tuple[str, ...]) -> re.Pattern:
    """The pattern of a dotted name that starts with one of ``packages`` (not inside a path nor a longer dotted
    name, and not a wildcard such as ``actors.settle_*``)."""
    return re.compile(r"(?<![\w./-])(?:%s)(?:\.[A-Za-z_]\w*)+(?![\w*])" % "|".join(map(re.escape, packages)))


def docstrings(source: str) -> list[tuple[int, str, list[str]]]:
    """(first line, text, names of the classes it stands in, outermost first) of the module's docstring and of
    every class's and function's, nested ones included."""
    tree = ast.parse(source)
    found = [(1, doc, []) for doc in [ast.get_docstring(tree, clean=False)] if doc]

    def visit(node: ast.AST, classes: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = classes + [child.name] if isinstance(child, ast.ClassDef) else classes
                if doc := ast.get_docstring(child, clean=False):
                    found.append((child.body[0].lineno, doc, inner))
                visit(child, inner)

    visit(tree, [])
    return found


def references(text: str, packages: tuple[str, ...], keys: set[str] = frozenset()) -> list[str]:
    """The references to code in one docstring, in order, each once: project-dotted names (not a config key of
    ``keys`` nor a file name) and dotted Sphinx role targets (``:meth:`Class.method```; a bare ``:func:`name``` is
    not a dotted reference and is not read)."""
    found = [m.group(0) for m in project_names(packages).finditer(text)
             if m.group(0) not in keys and m.group(0).rsplit(".", 1)[1] not in FILE_SUFFIXES]
    found += [target for m in ROLE.finditer(text) if "." in (target := m.group(1).rstrip("."))]
    return list(dict.fromkeys(found))


def instance_attribute(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base of it) annotates ``name`` or assigns ``self.name`` in its source."""
    for klass in inspect.getmro(cls):
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            tree = ast.parse(inspect.getsource(klass).strip() if klass.__module__ != "builtins" else "")
        except (OSError, TypeError, SyntaxError):
            continue
        if any(isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)
               and node.value.id == "self" and isinstance(node.ctx, ast.Store) for node in ast.walk(tree)):
            return True
    return False


def walk(start: object, names: list[str], shown: str) -> str | None:
    """None when ``getattr`` reaches ``start.<names...>``; else why not (``shown``: the path walked so far)."""
    here = start
    for name in names:
        if hasattr(here, name):
            here = getattr(here, name)
        elif isinstance(here, type) and instance_attribute(here, name):
            return None
        else:
            return f"{shown} has no attribute {name!r}"
        shown = f"{shown}.{name}"
    return None


def resolve_dotted(ref: str) -> str | None:
    """None when ``ref`` resolves: its longest importable module prefix, then ``getattr`` through the rest; else
    why not (the module that failed to import and why, or the first missing attribute)."""
    parts = ref.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            found = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            return f"importing {module} fails: {e}"
        except Exception as e:  # a module that exists but fails to import resolves nothing
            return f"importing {module} fails: {type(e).__name__}: {e}"
        return walk(found, parts[end:], module)
    return f"no module {parts[0]}"


def imported_names(source: str) -> dict[str, str]:
    """``{name: dotted origin}`` of every ``from x import name [as alias]`` in a module, lazy ones and those under
    ``if TYPE_CHECKING:`` included (absolute imports only)."""
    return {alias.asname or alias.name: f"{node.module}.{alias.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and not node.level and node.module for alias in node.names}


def resolve_in(ref: str, module: object, classes: list[str], imported: dict[str, str]) -> str | None:
    """None when a dotted role target ``ref`` resolves in the module's namespace, in a class the docstring stands in
    (innermost first), through a name the module imports anywhere (``imported``, from :func:`imported_names`) or
    as an absolute dotted name; else why not."""
    parts = ref.split(".")
    scopes = [module]
    for name in classes:
        scopes.append(getattr(scopes[-1], name, None))
    for scope in reversed(scopes):
        if scope is not None and hasattr(scope, parts[0]) and walk(scope, parts, "") is None:
            return None
    if parts[0] in imported and resolve_dotted(".".join([imported[parts[0]], *parts[1:]])) is None:
        return None
    if resolve_dotted(ref) is None:
        return None
    return f"{ref} is in neither the module's namespace{', its classes' if classes else ''}, its imports nor importable"


def stale_references(root: Path, packages: tuple[str, ...], keys: set[str] = frozenset(),
                     skip: set[tuple[str, str]] = frozenset()) -> list[str]:
    """``path:line: reference: why`` for every docstring reference under ``root / package`` that does not resolve.
    ``root`` must be on ``sys.path``. Modules of a folder without ``__init__.py`` (scripts with their own folder on
    sys.path) and ``__main__`` modules are not imported: only their project-dotted names are checked."""
    pattern = project_names(packages)
    stale = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            relative = str(path.relative_to(root))
            dotted = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            importable = path.name != "__main__.py" and all(
                (folder / "__init__.py").exists() for folder in path.parents if root in folder.parents)
            module, failure, source = None, None, path.read_text()
            for line, text, classes in docstrings(source):
                for ref in references(text, packages, keys):
                    if (relative, ref) in skip:
                        continue
                    if pattern.fullmatch(ref):
                        why = resolve_dotted(ref)
                    elif not importable:
                        continue
                    else:
                        if module is None and failure is None:
                            failure = resolve_dotted(dotted)
                            module = None if failure else importlib.import_module(dotted)
                        why = failure or resolve_in(ref, module, classes, imported_names(source))
                    if why:
                        stale.append(f"{relative}:{line}: {ref}: {why}")
    return stale


def plant(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    """Write package ``name`` under ``tmp_path`` (``files``: relative path -> source) and put it on sys.path."""
    for relative, source in files.items():
        path = tmp_path / name / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path


def test_the_finder_reads_every_kind_of_docstring_and_reference():
    source = ('"""Module: ``learner.algo.grpo`` and `arpo_async.config.LearnerConfig`."""\n'
              'class A:\n    """:meth:`A.go`, :func:`bare`, the key learner.lr, a file learner.pt, a wildcard '
              '``actors.settle_*``."""\n'
              '    def go(self):\n        """:func:`~actors.desktop.build.base_tag`, actors.a.b."""\n')
    found = [(line, references(text, PACKAGES, {"learner.lr"}), classes) for line, text, classes in docstrings(source)]
    assert found == [(1, ["learner.algo.grpo", "arpo_async.config.LearnerConfig"], []),
                     (3, ["A.go"], ["A"]),
                     (5, ["actors.desktop.build.base_tag", "actors.a.b"], ["A"])]


def test_a_planted_stale_reference_is_found(tmp_path, monkeypatch):
    # the check must be able to fail: a moved function, a missing module, a missing method (by its full path and
    # through an imported class); the good ones beside them (a module path, an instance attribute, a role target of
    # the class or of an imported name) pass, and an undotted role target is not read
    root = plant(tmp_path, "plantpkg", {
        "__init__.py": "",
        "good.py": '"""Uses :func:`plantpkg.good.helper` and ``plantpkg.good.Box.size``."""\n'
                   'class Box:\n    """:meth:`grow` and :data:`LIMIT`."""\n'
                   '    def __init__(self):\n        self.size = 1\n    def grow(self):\n        pass\n'
                   'LIMIT = 3\ndef helper():\n    pass\n',
        "bad.py": '"""Names plantpkg.good.moved_away, ``plantpkg.gone.thing`` and plantpkg.good."""\n'
                  'from plantpkg.good import Box\n'
                  'def f():\n    """See :meth:`Box.grow`, :meth:`Box.gone`, :func:`undotted` and '
                  ':meth:`plantpkg.good.Box.shrink`."""\n',
    })
    monkeypatch.syspath_prepend(str(root))
    try:
        assert stale_references(root, ("plantpkg",)) == [
            "plantpkg/bad.py:1: plantpkg.good.moved_away: plantpkg.good has no attribute 'moved_away'",
            "plantpkg/bad.py:1: plantpkg.gone.thing: plantpkg has no attribute 'gone'",
            "plantpkg/bad.py:4: plantpkg.good.Box.shrink: plantpkg.good.Box has no attribute 'shrink'",
            "plantpkg/bad.py:4: Box.gone: Box.gone is in neither the module's namespace, its imports nor importable",
        ]
    finally:
        for name in [m for m in sys.modules if m == "plantpkg" or m.startswith("plantpkg.")]:
            del sys.modules[name]


def test_every_docstring_reference_resolves():
    assert stale_references(ROOT, PACKAGES, set(dotted_keys()), NOT_CODE) == []
