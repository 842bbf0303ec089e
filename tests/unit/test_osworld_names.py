"""Every getter, metric and setup step OSWorld's 369 tasks name is one we know, so every task loads; the pure parts
of the getters added for them (actors.osworld.getters_web / getters_more) against hand-made inputs."""
from __future__ import annotations

import asyncio
import io
import json
import zipfile
from pathlib import Path

import pytest

from actors.evaluation import GETTERS, METRICS, SETUP_STEPS
from actors.osworld.cdp import cdp_page
from actors.osworld.getters import EvalContext, GetterError
from actors.osworld.getters_more import _slide_media, cache_name, get_cache_file
from actors.osworld.getters_web import (get_googledrive_file, get_gotoRecreationPage_and_get_html_content,
                                        html_parse_result, omnibox_text)
from actors.osworld.metrics import LEFT_OUT_LIBRARY_METRICS, OSWORLD_METRICS
from actors.osworld.setup import SetupContext, TaskSetupError, _keep_outputs, run_setup
from arpo_async.task_checks import INFEASIBLE
from arpo_async.task_names import GETTER_TYPES, METRIC_FUNCS, SETUP_TYPES
from arpo_async.task_sets import load_split
from arpo_async.tasks import load_task_file
from tests.support import osworld_examples

OSWORLD_EXAMPLES = osworld_examples()

ADDED = {  # what OSWorld's 369 tasks named that main (485c8d8) refused at load
    "getter": {"accessibility_tree", "active_tab_html_parse", "active_tab_url_parse", "active_url_from_accessTree",
               "audio_in_slide", "background_image_in_slide", "cache_file", "content_from_vm_file",
               "find_installed_extension_name", "find_unpacked_extension_path", "googledrive_file",
               "gotoRecreationPage_and_get_html_content", "info_from_website", "page_info", "pdf_from_url",
               "rule_relativeTime", "time_diff_range", "url_dashPart", "vscode_config"},
    "metric": {"compare_audios", "compare_videos", "compare_image_text"},
    "setup": {"googledrive", "login"},
}


def test_the_names_osworlds_tasks_added_are_known_everywhere():
    assert ADDED["getter"] <= GETTER_TYPES == set(GETTERS)
    assert ADDED["metric"] <= METRIC_FUNCS == set(METRICS)
    assert ADDED["setup"] <= SETUP_TYPES == set(SETUP_STEPS)
    assert {m: OSWORLD_METRICS[m] for m in ADDED["metric"]} == {
        "compare_audios": "vlc", "compare_videos": "vlc", "compare_image_text": "docs"}
    assert set(LEFT_OUT_LIBRARY_METRICS) == {"compare_image_text"}  # the one that fails at evaluation (OCR)


def names_used(task: dict) -> dict[str, set[str]]:
    ev = task["evaluator"]
    out = {"getter": set(), "metric": set(ev["func"] if isinstance(ev["func"], list) else [ev["func"]]),
           "setup": {s["type"] for s in task.get("config", []) + ev.get("postconfig", [])}}
    for key in ("result", "expected"):
        value = ev.get(key) or []
        out["getter"] |= {g["type"] for g in (value if isinstance(value, list) else [value]) if g}
    return out


@pytest.mark.skipif(OSWORLD_EXAMPLES is None, reason="$OSWORLD_EXAMPLES names no folder of OSWorld's task files")
def test_every_osworld_task_and_arpos_128_load():
    files = sorted(OSWORLD_EXAMPLES.rglob("*.json"))
    used: dict[str, set[str]] = {"getter": set(), "metric": set(), "setup": set()}
    for f in files:
        for kind, names in names_used(json.loads(f.read_text(encoding="utf-8"))).items():
            used[kind] |= names
        assert load_task_file(f).id  # OSWorld has one file whose id is not its name (08c73485)
    assert len(files) == 369
    assert used["getter"] == GETTER_TYPES  # exactly OSWorld's getters: none missing, none of our own
    assert used["metric"] - {INFEASIBLE} <= METRIC_FUNCS and used["setup"] <= SETUP_TYPES
    assert ADDED["getter"] <= used["getter"] and ADDED["metric"] <= used["metric"]
    arpo = [(d, i) for d, ids in load_split("arpo-128").items() for i in ids]
    assert len(arpo) == 128 and all(load_task_file(OSWORLD_EXAMPLES / d / f"{i}.json").id for d, i in arpo)


def test_omnibox_text_is_what_chromes_address_bar_shows():
    assert omnibox_text("https://www.drugs.com/npc/") == "drugs.com/npc/"
    assert omnibox_text("https://www.nfl.com/") == "nfl.com"
    assert omnibox_text("http://127.0.0.1:8765/a b%20c/?q=1#x") == "127.0.0.1:8765/a b%20c/?q=1#x"
    assert omnibox_text("https://scholar.google.com/citations?user=q") == "scholar.google.com/citations?user=q"
    assert omnibox_text("chrome://password-manager/passwords") == "chrome://password-manager/passwords"
    assert omnibox_text("file:///tmp/x.html") == "file:///tmp/x.html"
    assert omnibox_text("about:blank") == "about:blank"


def test_html_parse_result_follows_osworlds_categories():
    cls = {"category": "class", "class_multiObject": {"loc": {"0": "from", "2": "to"}},
           "class_multiObject_child": {"sep": {"0": "a", "1": "b"}},
           "class_multiObject_search_exist": {"tag": ["x", "y", "is_other_exist"]}, "class_singleObject": {"t": "t"}}
    answers = [["Zurich", "Bern"], [["SEA", "NYC"], ["no"]], ["x", "z"], []]
    assert html_parse_result(cls, answers, "") == {"from": "Zurich", "to": "", "a": "SEA", "b": "NYC",
                                                   "x": True, "y": False, "is_other_exist": True, "t": ""}
    assert html_parse_result({"category": "xpath", "xpathObject": {"/a": "k", "/b": "m"}}, ["v", None], "") == {
        "k": "v", "m": ""}
    url = {"category": "class&url", "class_multiObject": {"f": ["Red", "Blue"]},
           "url_include_expected": ["Sale"], "url_include_expected_multichoice": {"size=l": "large"}}
    assert html_parse_result(url, [["red"]], "https://x/?sale=1&size=L") == {
        "red": True, "is_other_exist": False, "sale": True, "large": True}
    assert html_parse_result(url, [["Green"]], "https://x/")["is_other_exist"] is True


def pptx(tmp_path: Path, slide_xml: str, rels: str) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("ppt/slides/slide1.xml", slide_xml)
        z.writestr("ppt/slides/_rels/slide1.xml.rels", rels)
        z.writestr("ppt/media/media1.mp3", b"ID3 audio")
    path = tmp_path / "deck.pptx"
    path.write_bytes(buf.getvalue())
    return str(path)


RELS = ('<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">{}</Relationships>')
REL = ('<Relationship Id="{}" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/{}" '
       'Target="{}"/>')
SLIDE_BG = ('<p:sld xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main" '
            'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main" '
            'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><p:cSld><p:bg><p:bgPr>'
            '<a:blipFill><a:blip r:embed="rId7"/></a:blipFill></p:bgPr></p:bg></p:cSld></p:sld>')


def test_slide_media_finds_embedded_and_linked_audio_and_the_background_image(tmp_path):
    embedded = pptx(tmp_path, "<x/>", RELS.format(REL.format("rId1", "audio", "../media/media1.mp3")))
    assert _slide_media(embedded, 0, "audio") == ("zip", "ppt/media/media1.mp3")
    assert _slide_media(embedded, 1, "audio") is None  # no slide 2
    assert _slide_media(embedded, 0, "image") is None  # no background fill
    linked = pptx(tmp_path, SLIDE_BG, RELS.format(REL.format("rId1", "audio", "file:///home/user/a.mp3")
                                                  + REL.format("rId6", "image", "../media/other.png")
                                                  + REL.format("rId7", "image", "../media/bg.png")))
    assert _slide_media(linked, 0, "audio") == ("vm", "/home/user/a.mp3")
    assert _slide_media(linked, 0, "image") == ("zip", "ppt/media/bg.png")  # the rId the bgPr names
    hostile = pptx(tmp_path, "<x/>", RELS.format(REL.format("rId1", "audio", "http://evil/a.mp3")))
    with pytest.raises(GetterError, match="neither in the file nor file://"):
        _slide_media(hostile, 0, "audio")


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "", ".", "..", "a/b", "a\\b", 5, None])
def test_cache_names_and_stdout_names_must_be_plain_file_names(tmp_path, name):
    with pytest.raises(GetterError, match="not a plain file name"):
        cache_name(name, "cache_file")
    with pytest.raises(GetterError, match="not a plain file name"):
        asyncio.run(get_cache_file(None, {"path": name}, EvalContext(cache_dir=tmp_path)))
    if name:  # "" means no stdout file at all, as in OSWorld
        with pytest.raises(TaskSetupError, match="must be a plain file name"):
            _keep_outputs({"stdout": name}, {"output": "x"}, SetupContext())


def test_cache_file_reads_a_postconfig_steps_named_output(tmp_path):
    setup = SetupContext()
    _keep_outputs({"stdout": "ls.out", "stderr": "ls.err"}, {"output": "a\nb\n", "error": "warn"}, setup)
    assert setup.outputs == {"ls.out": "a\nb\n", "ls.err": "warn"}
    ctx = EvalContext(cache_dir=tmp_path, outputs=setup.outputs)
    assert Path(asyncio.run(get_cache_file(None, {"path": "ls.out"}, ctx))).read_text() == "a\nb\n"
    with pytest.raises(GetterError, match="grep.out is not in the evaluation's cache folder"):
        asyncio.run(get_cache_file(None, {"path": "grep.out"}, ctx))


def test_what_cannot_work_here_says_so_when_run_not_at_load(tmp_path):
    ctx = EvalContext(cache_dir=tmp_path)
    with pytest.raises(GetterError, match="needs Google Drive"):
        asyncio.run(get_googledrive_file(None, {"path": ["x"]}, ctx))
    with pytest.raises(GetterError, match="www.recreation.gov; needs network"):
        asyncio.run(get_gotoRecreationPage_and_get_html_content(None, {}, ctx))
    for step in ({"type": "googledrive", "parameters": {}}, {"type": "login", "parameters": {"platform": "x"}}):
        with pytest.raises(TaskSetupError) as err:
            asyncio.run(run_setup(None, [step]))
        assert err.value.kind == "needs_network" and step["type"] in str(err.value)
    with pytest.raises(ValueError, match="exactly one of tab, new"):
        asyncio.run(cdp_page(None, tab="a", new="b"))
