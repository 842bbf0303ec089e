"""Pure parts of OSWorld setup support: `until` semantics, the Chrome History file, placeholders, tables."""
from __future__ import annotations

import datetime
import sqlite3

import pytest

from actors.desktop.controller_client import ControllerClient
from actors.evaluation import GETTERS, METRICS, SETUP_STEPS
from actors.osworld.downloads import DownloadCache
from actors.osworld.metric_env import PLACEHOLDER_MODULES, REQUIREMENTS
from actors.osworld.setup import SetupContext, _opener_probe, _substitute, build_history_db, until_met
from arpo_async.task_names import GETTER_TYPES, METRIC_FUNCS, SETUP_TYPES


def test_until_is_met_by_any_one_condition():
    r = {"returncode": 0, "output": "ready\n", "error": ""}
    assert until_met(r, {"returncode": 0, "stdout": "absent"})
    assert until_met(r, {"returncode": 1, "stdout": "read"})
    assert until_met({"returncode": 2, "output": "", "error": "boom"}, {"returncode": 0, "stderr": "boo"})
    assert not until_met(r, {"returncode": 1, "stdout": "absent", "stderr": "x"})


def test_history_db_has_osworlds_rows(tmp_path):
    now = datetime.datetime(2024, 1, 1, 12, 0, 0)
    data = build_history_db([{"url": "https://a.example/", "title": "A", "visit_time_from_now_in_seconds": 60}],
                            now=now)
    (tmp_path / "History").write_bytes(data)
    conn = sqlite3.connect(tmp_path / "History")
    (url, title, count, stamp), = conn.execute("SELECT url, title, visit_count, last_visit_time FROM urls")
    (visit_url, visit_time, transition), = conn.execute("SELECT url, visit_time, transition FROM visits")
    conn.close()
    expected = int((now - datetime.timedelta(seconds=60) - datetime.datetime(1601, 1, 1)).total_seconds() * 1e6)
    assert (url, title, count, stamp) == ("https://a.example/", "A", 1, expected)
    assert (visit_url, visit_time, transition) == (1, expected, 805306368)
    with pytest.raises(KeyError):
        build_history_db([{"url": "u"}])


async def test_placeholders_are_replaced_without_touching_the_desktop():
    nowhere = ControllerClient("/nonexistent/arpo/controller.sock", timeout=1)
    ctx = SetupContext(DownloadCache(), screen=(1280, 720))
    assert await _substitute(nowhere, "echo {CLIENT_PASSWORD} | sudo -S true", ctx) == "echo password | sudo -S true"
    assert await _substitute(nowhere, ["xdotool", "mousemove", "{SCREEN_WIDTH_HALF}", "{SCREEN_HEIGHT}"], ctx) \
        == ["xdotool", "mousemove", "640", "720"]
    await nowhere.close()


def test_open_picks_an_app_by_extension():
    assert "libreoffice --calc" in _opener_probe("/root/a.XLSX") and "xdg-open" in _opener_probe("/root/a")
    assert "vlc" in _opener_probe("/root/v.mp4") and "gimp" not in _opener_probe("/root/v.mp4")


def test_tables_agree_and_placeholders_are_not_installed():
    assert set(SETUP_STEPS) == SETUP_TYPES and set(GETTERS) == GETTER_TYPES and set(METRICS) == METRIC_FUNCS
    installed = {r.split("==")[0].lower() for r in REQUIREMENTS}
    assert not {"pyacoustid", "easyocr", "borb", "pdfplumber", "formulas"} & installed
    assert {"librosa", "fastdtw", "opencv-python-headless"} <= installed  # compare_audios, compare_videos
    assert set(PLACEHOLDER_MODULES) == {"acoustid", "borb", "pdfplumber", "easyocr", "formulas", "playwright",
                                        "pydrive"}
