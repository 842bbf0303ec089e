"""`arpo view` on a real short run, looked at in headless Chromium.

`arpo run` (real arpo-serve, learner, actors and desktops) trains one step with every trajectory sampled
(learner.sample_trajectories = 1) and a grammar that allows only click and drag, so every step has a point to
draw. Then `arpo view` writes the page; Chromium (Debian's chromium, installed by scripts/bootstrap.sh) dumps its
DOM after load and screenshots it while it is served by `make_server`, which records what the browser fetched.
"""

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from arpo_cli.viewer import make_server
from tests.support import Elements

pytestmark = pytest.mark.docker

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,2400"]


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *HEADLESS, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, desktop_image, tiny_model) -> Path:
    run_dir = tmp_path_factory.mktemp("viewer") / "viewer-run"  # own run id: other tests kill "demo" desktops
    proc = subprocess.run(
        [sys.executable, "-m", "arpo_cli.cli", "run", "--out", str(run_dir), "--model", str(tiny_model),
         "--steps", "1", "--actors", "2", "--set", "actors.warm_spares=0", "--set", "learner.group_size=2",
         "--set", "learner.groups_per_step=1", "--set", 'learner.task_ids=["grid4-"]',
         "--set", "learner.sample_trajectories=1.0",
         "--set", "actors.max_steps=2", "--set", 'actors.grammar_actions=["click","drag"]',
         "--set", "serve.port=31947", "--set", 'actors.inference_urls=["http://127.0.0.1:31947"]',
         "--set", "transport.endpoint=tcp://127.0.0.1:31948"],
        capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def test_page_of_a_real_run_in_chromium(short_run, tmp_path):
    assert CHROMIUM, "needs Debian's chromium on PATH (scripts/bootstrap.sh installs it)"
    records = [json.loads(p.read_text()) for p in short_run.glob("trajectories/*/record.json")]
    # rate 1: every trajectory that came back (one step needs a group of G=2 with a success and a failure; the
    # 4-button tasks, which the tiny random policy solves now and then, give one within a few groups)
    assert len(records) >= 2
    steps = sum(len(r["steps"]) for r in records)
    pointed = sum(1 for r in records for s in r["steps"] if any(a["point"] for a in s["actions"]))
    assert steps > 0 and pointed > 0 and all(r["screen_size"] == [1280, 720] for r in records)

    view = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "view", str(short_run)],
                          capture_output=True, text=True, timeout=120)
    assert view.returncode == 0, view.stderr
    page = Path(view.stdout.strip())
    assert page == short_run / "view.html"

    dumped = chromium("--virtual-time-budget=5000", "--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr[-2000:]
    dom = Elements()
    dom.feed(dumped.stdout)
    assert dom.classes["episode"] == len(records)
    shown = sum(1 for r in records for s in r["steps"] if s["screenshot"] is not None)
    assert len(dom.images) == shown == dom.classes["shot"] and shown > 0
    assert all((short_run / src).is_file() for src in dom.images)
    assert sum(dom.classes.get(f"mark-{kind}", 0) for kind in ("click", "drag")) == pointed
    assert dom.classes["curve"] == 2 and "".join(dom.text).count("no data") < 2  # success rate, reward: drawn

    server = make_server(short_run, port=0)
    fetched: list[tuple[str, str]] = []
    handler = server.RequestHandlerClass

    def recording(*args, **kwargs):
        served = handler(*args, **kwargs)  # handles the request
        fetched.append((served.command, served.path))
        return served

    server.RequestHandlerClass = recording
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    shot = tmp_path / "page.png"
    try:
        taken = chromium("--virtual-time-budget=5000", f"--screenshot={shot}",
                         f"http://127.0.0.1:{server.server_port}/")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    paths = [path for _, path in fetched]
    assert "/" in paths and any(p.startswith("/trajectories/") and p.endswith(".png") for p in paths), paths
    with Image.open(shot) as img:
        assert img.size == (1280, 2400)
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50  # text, curves and a desktop screenshot, not a blank page
