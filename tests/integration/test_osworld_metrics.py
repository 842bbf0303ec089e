"""OSWorld's published metric functions run unchanged in their own venv (actors.osworld.metric_env, built on
first use from PyPI, about 90 s and 550 MB once) through the worker process (actors.osworld.metrics)."""
from __future__ import annotations

import ast
import datetime
import math
import subprocess
import wave
from pathlib import Path

import pytest
from PIL import Image

from actors.desktop.controller_client import ControllerClient
from actors.evaluation import METRICS, evaluate
from actors.osworld import metric_env
from actors.osworld.metrics import LEFT_OUT_LIBRARY_METRICS, OSWORLD_METRICS, MetricError, MetricWorker
from actors.osworld.native_metrics import NATIVE_METRICS
from arpo_async.task_names import METRIC_FUNCS
from arpo_async.tasks import Task

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
            assert used == ({LEFT_OUT_LIBRARY_METRICS[name]} if name in LEFT_OUT_LIBRARY_METRICS else set()), \
                f"{module}.{name} needs {used}"


def test_worker_runs_metrics_and_reports_errors(worker, tmp_path):
    assert worker.call("is_utc_0", [UTC], {}) == 1
    assert worker.call("is_utc_0", [UTC.replace("+0000", "+0100")], {}) == 0
    assert worker.call("check_enabled_experiments", [["a@1"], {"type": "names", "names": ["a"]}], {}) == 1.0
    with pytest.raises(MetricError) as err:
        worker.call("is_utc_0", [""], {})
    assert err.value.error_type == "IndexError"
    image = tmp_path / "blank.png"
    Image.new("RGB", (8, 8), "white").save(image)
    with pytest.raises(MetricError, match="easyocr is not installed") as err:  # a left-out library
        worker.call("compare_image_text", [str(image), {"type": "text", "text": "x"}], {})
    assert err.value.error_type == "MissingLibrary"
    worker._proc.kill()  # a dead worker is replaced on the next call
    assert worker.call("is_utc_0", [UTC], {}) == 1


def write_wav(path: Path, tones: list[float], seconds_each: float = 0.5, rate: int = 22050) -> str:
    """A mono 16-bit WAV of the given sine tones (Hz) one after the other."""
    frames = bytearray()
    for hz in tones:
        for i in range(int(rate * seconds_each)):
            frames += int(12000 * math.sin(2 * math.pi * hz * i / rate)).to_bytes(2, "little", signed=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(bytes(frames))
    return str(path)


def test_compare_audios_runs_osworlds_own_code_with_librosa(worker, tmp_path):
    """OSWorld's vlc.compare_audios (librosa MFCCs aligned by fastdtw) on real WAV files: a file matches its copy
    fully and scores lower against a different melody; a missing path scores 0, as in OSWorld."""
    melody = write_wav(tmp_path / "a.wav", [440, 660, 880, 550])
    copy = write_wav(tmp_path / "b.wav", [440, 660, 880, 550])
    other = write_wav(tmp_path / "c.wav", [1500, 200, 3000, 120])
    same = worker.call("compare_audios", [melody, copy], {})
    different = worker.call("compare_audios", [melody, other], {})
    assert same == pytest.approx(1.0) and 0.0 <= different < same - 0.05, (same, different)
    assert worker.call("compare_audios", [melody, ""], {}) == 0


def test_osworlds_own_getters_run_in_the_worker(worker, tmp_path):
    """get_rule_relativeTime (getters/misc.py) and get_content_from_vm_file (getters/file.py, pandas) run unchanged
    in the worker, the latter on a file handed over as the desktop's (the stand-in env's controller)."""
    def next_monday() -> str:
        now = datetime.datetime.now(datetime.timezone.utc)
        return (now + datetime.timedelta(days=7 - now.weekday())).strftime("%Y-%m-%d")

    before = next_monday()
    config = {"rules": {"relativeTime": {"from": "next Monday"}, "timezone": "UTC",
                        "expected": {"time": "{Year}-{Month0D}-{Day0D}", "from": "BOM"}}}
    got = worker.call("get_rule_relativeTime", [config], {}, "misc", getter_env={})
    assert got["expected"] in ({"time": before, "from": "BOM"}, {"time": next_monday(), "from": "BOM"})
    xlsx = tmp_path / "r.xlsx"
    subprocess.run([str(metric_env.env_python()), "-c", "import openpyxl, sys; wb = openpyxl.Workbook(); "
                    "ws = wb.active; ws.append(['name', 'n']); ws.append(['Ada', 1]); ws.append(['Bob', 2]); "
                    "wb.save(sys.argv[1])", str(xlsx)], check=True, timeout=120)
    env = {"cache_dir": str(tmp_path / "cache"), "files": {"/home/user/r.xlsx": str(xlsx)}}
    spec = {"path": "/home/user/r.xlsx", "file_type": "xlsx", "file_content": "last_row"}
    assert worker.call("get_content_from_vm_file", [spec], {}, "file", getter_env=env) == ["Bob", "2"]
    with pytest.raises(MetricError, match="NotImplementedError"):  # OSWorld's own refusal, as a clear error
        worker.call("get_content_from_vm_file", [{**spec, "file_type": "csv"}], {}, "file", getter_env=env)


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
