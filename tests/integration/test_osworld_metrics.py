"""OSWorld's published metric functions run unchanged in their own venv (actors.osworld.metric_env, built on
first use from PyPI, about 90 s and 550 MB once) through the worker process (actors.osworld.metrics)."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from actors.desktop.controller_client import ControllerClient
from actors.evaluation import METRICS, evaluate
from actors.osworld import metric_env
from actors.osworld.metrics import OSWORLD_METRICS, MetricError, MetricWorker
from actors.osworld.native_metrics import NATIVE_METRICS
from arpo_async.tasks import METRIC_FUNCS, Task

UTC = ("               Local time: Thu 2024-01-25 12:56:06 UTC\n           Universal time: Thu 2024-01-25 12:56:06 "
       "UTC\n                 RTC time: Thu 2024-01-25 12:56:05\n                Time zone: Etc/UTC (UTC, +0000)\n")


@pytest.fixture(scope="module")
def metrics_dir() -> Path:
    python = metric_env.ensure_env()
    out = subprocess.run([str(python), "-c", "import importlib.util as u; "
                          "print(u.find_spec('desktop_env').submodule_search_locations[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out) / "evaluators" / "metrics"


@pytest.fixture(scope="module")
def worker():
    w = MetricWorker()
    yield w
    w.close()


def test_table_matches_osworlds_package(metrics_dir):
    """Every metric we list is exported by desktop_env.evaluators.metrics from the module we name."""
    exported = {}
    for node in ast.parse((metrics_dir / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            exported.update({a.asname or a.name: node.module for a in node.names})
    assert {n: exported.get(n) for n in OSWORLD_METRICS} == OSWORLD_METRICS
    assert set(METRICS) == METRIC_FUNCS == set(OSWORLD_METRICS) | set(NATIVE_METRICS)


def test_supported_metrics_use_no_placeholder_library(metrics_dir):
    """No listed metric (nor a function of its module it calls) touches a library the venv leaves out."""
    for module in set(OSWORLD_METRICS.values()):
        tree = ast.parse((metrics_dir / f"{module}.py").read_text())
        missing = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                missing |= {(a.asname or a.name).split(".")[0] for a in node.names
                            if a.name.split(".")[0] in metric_env.PLACEHOLDER_MODULES}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in metric_env.PLACEHOLDER_MODULES:
                missing |= {a.asname or a.name for a in node.names}
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        names = {f: {x.id for x in ast.walk(n) if isinstance(x, ast.Name)} for f, n in funcs.items()}
        for name in (n for n, m in OSWORLD_METRICS.items() if m == module):
            seen, todo = set(), [name]
            while todo:
                f = todo.pop()
                if f not in seen:
                    seen.add(f)
                    todo += list(names[f] & funcs.keys())
            used = set().union(*(names[f] for f in seen)) & missing
            assert not used, f"{module}.{name} needs {used}"


def test_worker_runs_metrics_and_reports_errors(worker):
    assert worker.call("is_utc_0", [UTC], {}) == 1
    assert worker.call("is_utc_0", [UTC.replace("+0000", "+0100")], {}) == 0
    assert worker.call("check_enabled_experiments", [["a@1"], {"type": "names", "names": ["a"]}], {}) == 1.0
    with pytest.raises(MetricError) as err:
        worker.call("is_utc_0", [""], {})
    assert err.value.error_type == "IndexError"
    with pytest.raises(MetricError, match="librosa is not installed") as err:  # a left-out library
        worker.call("compare_audios", ["a.wav", "b.wav"], {}, module="vlc")
    assert err.value.error_type == "MissingLibrary"
    worker._proc.kill()  # a dead worker is replaced on the next call
    assert worker.call("is_utc_0", [UTC], {}) == 1


def rule(value):
    return {"type": "rule", "rules": value}


async def test_evaluate_with_osworld_metrics():
    nowhere = ControllerClient("/nonexistent/arpo/controller.sock", timeout=2)
    try:
        t = Task.from_dict({"id": "t", "instruction": "i", "evaluator": {
            "func": ["is_utc_0", "check_enabled_experiments"], "result": [rule(UTC), rule(["x@1"])],
            "expected": [None, rule({"type": "names", "names": ["x"]})]}})
        assert await evaluate(nowhere, t, None) == 1.0
        # a metric that raises on the state it gets (None: nothing there) scores 0, like a failed task
        t0 = Task.from_dict({"id": "t0", "instruction": "i", "evaluator": {
            "func": "check_enabled_experiments", "result": rule(None), "expected": rule({"type": "names"})}})
        assert await evaluate(nowhere, t0, None) == 0.0
    finally:
        await nowhere.close()
