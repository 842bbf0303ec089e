"""Runs OSWorld's metric functions unchanged, inside the OSWorld metrics virtualenv (see metric_env).

Started as a script by :class:`actors.osworld.metrics.MetricWorker` with that venv's interpreter; imports only
the standard library and the venv's packages, never arpo code. Protocol: one JSON object per line on stdin,
``{"module": "chrome", "func": "is_expected_bookmarks", "args": [...], "kwargs": {...}}``; one JSON line back per
request on the original stdout (with ``"getter": true`` the function is OSWorld's getter
``desktop_env.evaluators.getters.<module>.<func>``, called with a stand-in ``env`` built from ``"env"``:
``{"cache_dir", "files": {desktop path: local path}}``, or None): ``{"ok": true, "value": <the metric's return
value>}`` or ``{"ok": false, "error_type": str, "error": str}``. Whatever the metrics print goes to stderr.

desktop_env's package ``__init__`` files import every provider, controller and metric module (torch, playwright,
...): the worker registers ``desktop_env``, ``desktop_env.evaluators`` and ``desktop_env.evaluators.metrics`` as
bare package modules pointing at their folders, so only the metric submodule asked for (and what it imports) is
executed. Libraries named on the command line (``--placeholder NAME=WHAT``) get placeholder modules: importing
them works, using anything from them raises ``MissingLibrary`` (a BaseException) naming the library.
"""
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
import types


class MissingLibrary(BaseException):
    """A metric called into a library the OSWorld metrics environment does not install. A BaseException, so
    that a metric's own ``except Exception`` (compare_audios has one) cannot turn it into a score."""


class _Placeholder:
    def __init__(self, name: str, what: str) -> None:
        self._name, self._what = name, what

    def _fail(self, *_a, **_k):
        raise MissingLibrary(f"{self._name.split('.')[0]} is not installed in the OSWorld metrics environment "
                             f"(needed for {self._what}; called {self._name})")

    __call__ = _fail

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}", self._what)

    def __mro_entries__(self, bases):  # `class X(placeholder.Base)` at import time still works
        return (object,)


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, libraries: dict[str, str]) -> None:
        self.libraries = libraries

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.libraries:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        what = self.libraries[module.__name__.split(".")[0]]
        module.__path__ = []
        module.__getattr__ = lambda attr: (_ for _ in ()).throw(AttributeError(attr)) if attr.startswith("__") \
            else _Placeholder(f"{module.__name__}.{attr}", what)


def _register_packages() -> None:
    spec = importlib.util.find_spec("desktop_env")  # finds the folder; does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("metric_worker: desktop_env is not installed in this environment")
    root = list(spec.submodule_search_locations)[0]
    for name, folder in (("desktop_env", root), ("desktop_env.evaluators", os.path.join(root, "evaluators")),
                         ("desktop_env.evaluators.metrics", os.path.join(root, "evaluators", "metrics")),
                         ("desktop_env.evaluators.getters", os.path.join(root, "evaluators", "getters"))):
        mod = types.ModuleType(name)
        mod.__path__ = [folder]
        sys.modules[name] = mod


class _LocalFiles:
    """A stand-in for OSWorld's PythonController in a getter's ``env``: get_file(path) answers from files the
    actor already fetched from the desktop ({desktop path: local path}); None for any other path."""

    def __init__(self, files: dict) -> None:
        self.files = files

    def get_file(self, path: str):
        local = self.files.get(path)
        if local is None:
            return None
        with open(local, "rb") as f:
            return f.read()


def _env(spec):
    """The ``env`` argument of an OSWorld getter: None, or cache_dir + controller (_LocalFiles)."""
    if spec is None:
        return None
    return types.SimpleNamespace(cache_dir=spec["cache_dir"], vm_platform="Linux",
                                 controller=_LocalFiles(spec.get("files", {})))


def _answer(out, obj) -> None:
    out.write(json.dumps(obj, default=str) + "\n")
    out.flush()


def main() -> None:
    libraries = {}
    for arg in sys.argv[1:]:
        if arg.startswith("--placeholder="):
            name, _, what = arg.split("=", 1)[1].partition("=")
            libraries[name] = what
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # metrics print; keep the protocol channel clean
    sys.stdout = sys.stderr
    sys.meta_path.append(_PlaceholderFinder(libraries))
    _register_packages()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            package = "getters" if req.get("getter") else "metrics"
            module = importlib.import_module(f"desktop_env.evaluators.{package}.{req['module']}")
            func = getattr(module, req["func"])
            args = [_env(req.get("env")), *req.get("args", [])] if req.get("getter") else req.get("args", [])
            value = func(*args, **req.get("kwargs", {}))
            _answer(out, {"ok": True, "value": value})
        except (Exception, MissingLibrary) as exc:  # every failure becomes an answer; the worker lives on
            _answer(out, {"ok": False, "error_type": type(exc).__name__, "error": str(exc)[:2000],
                          "trace": traceback.format_exc()[-3000:]})


if __name__ == "__main__":
    main()
