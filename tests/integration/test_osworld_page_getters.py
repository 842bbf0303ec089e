"""OSWorld's page getters (actors.osworld.getters_web, through Chromium's DevTools endpoint inside the desktop) and
the cache_file getter, against a real osworld-image desktop: Chromium shows a page served inside the desktop (it
has no network), the getters read its URL and content and print it to PDF, and a whole evaluation scores a task
whose evaluator uses them with OSWorld's metrics."""
from __future__ import annotations

import pytest

from actors.evaluation import EvalContext, evaluate, run_setup
from actors.osworld.getter_table import GETTERS
from actors.osworld.getters import GetterError
from arpo_async.tasks import Task

pytestmark = [pytest.mark.docker, pytest.mark.osworld_image]

PAGE = ('<html><head><title>Item</title></head><body><main><p class="loc">Z&uuml;rich</p><p class="loc">Bern</p>'
        '<div class="sep">SEA<span>-</span>NYC</div><input id="n" value=" 42 "></main></body></html>')
URL = "http://127.0.0.1:8765/shop/item.html?q=drip+coffee&tbs=mr:1,price:1"
SETUP = [
    {"type": "execute", "parameters": {"command": ["sh", "-c", 'mkdir -p /tmp/arpo-site/shop && printf %s "$0" > '
                                                   '/tmp/arpo-site/shop/item.html', PAGE]}},
    {"type": "launch", "parameters": {"command": "cd /tmp/arpo-site && exec python3 -m http.server 8765 "
                                                 "--bind 127.0.0.1", "shell": True}},
    {"type": "execute", "parameters": {"command": ["python3", "-c", "import urllib.request; urllib.request.urlopen("
                                                   "'http://127.0.0.1:8765/shop/item.html', timeout=2)"],
                                       "until": {"returncode": 0}}},
    {"type": "launch", "parameters": {"command": ["google-chrome", "--remote-debugging-port=1337"]}},
    {"type": "chrome_open_tabs", "parameters": {"urls_to_open": [URL]}},
]


async def test_page_getters_read_chromiums_active_tab_and_an_evaluation_uses_them(osworld_desktop, tmp_path):
    c = osworld_desktop.controller
    await run_setup(c, SETUP)
    ctx = EvalContext(cache_dir=tmp_path)

    async def get(spec: dict):
        return await GETTERS[spec["type"]](c, spec, ctx)

    assert await get({"type": "active_url_from_accessTree", "goto_prefix": "http://"}) == URL
    assert await get({"type": "url_dashPart", "goto_prefix": "http://", "partIndex": -1, "needDeleteId": True,
                      "returnType": "string"}) == "item.html"
    assert await get({"type": "url_dashPart", "goto_prefix": "http://", "partIndex": 3, "returnType": "json",
                      "key": "dir"}) == {"dir": "shop"}
    assert await get({"type": "active_tab_url_parse", "goto_prefix": "http://", "parse_keys": ["q", "tbs"],
                      "replace": {"tbs": "filters"}}) == {"q": "drip coffee", "filters": "mr:1,price:1"}
    assert await get({"type": "active_tab_html_parse", "goto_prefix": "http://", "category": "class",
                      "class_multiObject": {"loc": {"0": "from", "1": "to"}},
                      "class_multiObject_child": {"sep": {"0": "a", "1": "b"}}}) == {
        "from": "Zürich", "to": "Bern", "a": "SEA", "b": "NYC"}
    assert await get({"type": "active_tab_html_parse", "goto_prefix": "http://", "category": "input",
                      "inputObject": {"//input[@id='n']": "n", "//input[@id='none']": "none"}}) == {
        "n": "42", "none": ""}
    # OSWorld's "https://www." prefix on a page without www: no tab has that URL, so {} (as OSWorld)
    assert await get({"type": "active_tab_html_parse", "goto_prefix": "https://www.", "category": "xpath",
                      "xpathObject": {"/html/body/main/p[1]": "p"}}) == {}

    pdf = await get({"type": "pdf_from_url", "path": "http://127.0.0.1:8765/shop/item.html", "dest": "item.pdf"})
    assert open(pdf, "rb").read(5) == b"%PDF-"
    assert (await get({"type": "page_info", "url": "http://127.0.0.1:8765/shop/item.html"}))["title"] == "Item"
    with pytest.raises(GetterError, match="www.example.com.*cannot be reached from the desktop"):
        await get({"type": "pdf_from_url", "path": "https://www.example.com/", "dest": "x.pdf"})
    assert len((await get({"type": "open_tabs_info"}))) == 1  # the getters' own tabs are closed again

    def task(url: str) -> Task:
        return Task.from_dict({"id": "t", "instruction": "i", "evaluator": {
            "postconfig": [{"type": "execute", "parameters": {"command": ["ls", "/tmp/arpo-site/shop"],
                                                              "stdout": "ls.out"}}],
            "func": ["is_expected_active_tab", "check_list"],
            "result": [{"type": "active_url_from_accessTree", "goto_prefix": "http://"},
                       {"type": "cache_file", "path": "ls.out"}],
            "expected": [{"type": "rule", "rules": {"type": "url", "url": url}},
                         {"type": "rule", "rules": {"expect": [r"\bitem\.html\b"]}}]}}, check_names=True)

    assert await evaluate(c, task(URL), "DONE") == 1.0
    assert await evaluate(c, task("http://127.0.0.1:8765/shop/other.html"), "DONE") == 0.0
