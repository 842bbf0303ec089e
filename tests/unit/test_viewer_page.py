"""The trajectory viewer's page, from sample folders written by the learner's real sampler, and its server."""

import asyncio
import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest

from arpo_async.messages import Outcome
from arpo_cli.viewer import ViewerError, make_server, marks_svg, render_page, write_page
from learner.rollouts.trajectory_sample import TrajectorySampler
from tests.support import parse_html
from tests.unit.test_multiturn_replay import TASK as MULTI_STEP_TASK
from tests.unit.test_multiturn_replay import three_step_success
from tests.unit.test_trajectory_sample import TASK, trajectory


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "demo"
    sampler = TrajectorySampler(run / "trajectories", rate=1.0, disk_mb=10)
    asyncio.run(sampler.offer(trajectory("win", Outcome.SUCCESS), TASK, step=1, version=1))
    asyncio.run(sampler.offer(trajectory("lose"), TASK, step=2, version=2))
    records = [{"step": s, "wall_s": 10.0 * s, "success_rate": r, "reward_mean": r, "policy_version": s}
               for s, r in [(1, 0.25), (2, 0.5), (3, 0.75)]]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_page_shows_episodes_screenshots_marks_and_curves(run_dir):
    page = render_page(run_dir)
    found = parse_html(page)
    assert found.classes["episode"] == 2 and found.classes["step"] == 4
    assert len(found.images) == 4 and all(src.startswith("trajectories/") for src in found.images)
    assert all((run_dir / src).is_file() for src in found.images)
    assert found.classes["mark-click"] == 2 and found.classes["mark-drag"] == 2
    assert found.classes["curve"] == 2 and found.tags["svg"] == 2 + 4  # two matplotlib curves, four overlays
    curves = page[page.index('<div class="curves">'):page.index('<section id="episodes">')]
    assert "success rate" in curves and "reward mean" in curves and "no data" not in curves
    assert "<?xml" not in page and "<!DOCTYPE svg" not in page  # matplotlib's prolog is dropped when inlined
    text = "".join(found.text)
    assert "Click the red square." in text and "red is left" in text and "click(10,20)" in text
    assert "first success" in text and "reward 1.00" in text and "policy v2" in text
    assert not re.search(r'(src|href)="(https?:)?//', page) and "<script" not in page and "<link" not in page
    # newest first
    assert page.index('id="lose"') < page.index('id="win"')


def test_marks_sit_in_screen_pixels(run_dir):
    svg = marks_svg([{"kind": "click", "point": [10.0, 20.0]}, {"kind": "type", "point": None}], (64, 36))
    assert 'viewBox="0 0 64 36"' in svg and 'cx="10.0" cy="20.0"' in svg and svg.count('class="mark ') == 1
    assert marks_svg([{"kind": "hotkey", "point": None}], (64, 36)) == ""
    assert marks_svg([{"kind": "click", "point": [1, 2]}], (0, 0)) == ""
    assert marks_svg([{"kind": "click", "point": ['1" onload="x', 2]}], (64, 36)) == ""  # not two numbers


def test_text_from_the_run_is_escaped(tmp_path):
    hostile = "<script>alert(1)</script>"
    evil = TASK.__class__.from_dict({"id": "x-1", "instruction": hostile, "config": [],
                                     "evaluator": {"func": "infeasible"}})
    sampler = TrajectorySampler(tmp_path / "trajectories", rate=1.0, disk_mb=10)
    folder = asyncio.run(sampler.offer(trajectory("t"), evil, step=0, version=0))
    record = json.loads((folder / "record.json").read_text())
    record.update(task_id=hostile, trajectory_id=f'x" onload="{hostile}', error=hostile)
    record["steps"][0]["action"] = hostile
    record["steps"][0]["thought"] = f"{hostile} & more"
    record["steps"][1]["actions"][0]["kind"] = f'drag" onload="alert(1)'
    (folder / "record.json").write_text(json.dumps(record))
    page = render_page(tmp_path)
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert "<script" not in page and page.count(escaped) == 6 and "&amp; more" in page
    assert 'id="x&#34; onload=&#34;&lt;script' in page and 'class="mark mark-drag&#34; onload' not in page
    found = parse_html(page)
    assert "script" not in found.tags
    assert sum(hostile in t for t in found.text) == 5  # instruction, task id, thought, action, error: as text


def test_empty_or_missing_runs(tmp_path):
    page = render_page(tmp_path)
    assert "No sampled trajectories yet" in page and "no metrics.jsonl" in page
    assert page.count("no data") == 2 and parse_html(page).classes["curve"] == 2
    with pytest.raises(ViewerError, match="not a folder"):
        render_page(tmp_path / "absent")
    (tmp_path / "trajectories" / "broken").mkdir(parents=True)
    (tmp_path / "trajectories" / "broken" / "record.json").write_text("{not json")
    assert "skipped broken" in render_page(tmp_path)


def test_page_written_elsewhere_links_back(run_dir, tmp_path):
    (tmp_path / "pages").mkdir()
    out = write_page(run_dir, tmp_path / "pages" / "demo.html")
    images = parse_html(out.read_text()).images
    assert images and all((out.parent / src).is_file() for src in images)
    assert write_page(run_dir) == run_dir / "view.html"


def test_server_serves_page_and_samples_only(run_dir):
    server = make_server(run_dir, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        page = urllib.request.urlopen(f"{base}/", timeout=10).read().decode()
        src = parse_html(page).images[0]
        assert urllib.request.urlopen(f"{base}/{src}", timeout=10).read() == (run_dir / src).read_bytes()
        for path in ("/metrics.jsonl", "/trajectories/../metrics.jsonl"):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(f"{base}{path}", timeout=10)
            assert denied.value.code == 404
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    with pytest.raises(ViewerError, match="loopback"):
        make_server(run_dir, port=0, host="0.0.0.0")


def test_arpo_view_serve_command(run_dir):
    """`arpo view RUN_DIR --serve --port 0`: writes the page, prints the URL, serves until stopped."""
    proc = subprocess.Popen([sys.executable, "-m", "arpo_cli.cli", "view", str(run_dir), "--serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == str(run_dir / "view.html")
        url = proc.stdout.readline().split()[1]  # "serving http://127.0.0.1:PORT/ (Ctrl-C stops)"
        assert url.startswith("http://127.0.0.1:")
        assert 'class="episode"' in urllib.request.urlopen(url, timeout=30).read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bad = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "view", str(run_dir / "absent")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a folder" in bad.stderr


def test_every_step_of_a_multi_step_episode_shows_its_screenshot_thought_and_action(tmp_path):
    traj = three_step_success()
    sampler = TrajectorySampler(tmp_path / "trajectories", rate=1.0, disk_mb=10)
    folder = asyncio.run(sampler.offer(traj, MULTI_STEP_TASK, step=3, version=5))
    page = render_page(tmp_path)
    figures = page.split('<figure class="step">')[1:]
    assert len(figures) == len(traj.steps) == 3
    for number, (figure, step) in enumerate(zip(figures, traj.steps), start=1):
        found = parse_html(figure.split("</figure>")[0])
        (src,) = found.images  # the screenshot the step acted on: the last of its prompt's window
        assert (tmp_path / src).read_bytes() == traj.screenshots[step.image_indices[-1]], number
        assert src.startswith(f"trajectories/{folder.name}/")
        text = "".join(found.text)
        thought = step.text.split("Thought: ")[1].split("\nAction:")[0]
        assert f"step {number}" in text and f"Thought: {thought}" in text and f"Action: {step.action}" in text
    assert [parse_html(f).images[0].rsplit("/", 1)[1] for f in figures] == ["shot-0.png", "shot-1.png", "shot-2.png"]
    assert "v4-5" in figures[1] and "3 steps" in page  # step 2 was sampled across a weight publication


def test_arpo_view_refuses_a_folder_with_no_episodes_and_writes_nothing(tmp_path, capsys):
    """As `arpo curve` refuses a folder with no metrics: exit 2, one line naming the folder, no view.html; a
    folder whose only sample cannot be read is refused too, naming it."""
    from arpo_cli.viewer import view_main

    empty = tmp_path / "empty"
    (empty / "trajectories").mkdir(parents=True)
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 1, "success_rate": 0.5}) + "\n")
    assert view_main(empty) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"arpo view: no episodes in {empty} (") and len(err.strip().splitlines()) == 1
    assert "learner.sample_trajectories" in err and not (empty / "view.html").exists()
    (empty / "trajectories" / "broken").mkdir()
    (empty / "trajectories" / "broken" / "record.json").write_text("{not json")
    assert view_main(empty, serve=True, port=0) == 2
    assert "1 unreadable, e.g. broken: " in capsys.readouterr().err and not (empty / "view.html").exists()


def test_arpo_view_writes_the_page_of_a_folder_with_episodes(run_dir, capsys):
    from arpo_cli.viewer import require_episodes, view_main

    assert require_episodes(run_dir) == 2
    assert view_main(run_dir) == 0 and capsys.readouterr().out.strip() == str(run_dir / "view.html")
