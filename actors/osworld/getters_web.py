"""OSWorld's getters that read the browser's pages (desktop_env/evaluators/getters/chrome.py in OSWorld's published
package desktop-env 1.0.2, https://pypi.org/project/desktop-env/1.0.2/ , the version actors.osworld.metric_env
pins), run against Chromium in our desktop through its DevTools endpoint (:mod:`actors.osworld.chrome` for the tab
list, :mod:`actors.osworld.cdp` for a page's content) instead of playwright on the host.

The active tab's URL: OSWorld reads the text of Chrome's address bar from the accessibility tree
(get_active_url_from_accessTree) and prefixes it with the task's ``goto_prefix``; we take the most recently active
tab's URL from ``/json/list`` and turn it into the text Chrome's address bar shows (:func:`omnibox_text`: Chrome
hides ``http(s)://``, a leading ``www.`` and a bare ``/`` path by default), so ``goto_prefix`` + that text is
what OSWorld computes, including its quirks (``https://www.`` prefixed to a host that has no ``www.``).

Getters that cannot work in a desktop without network raise :class:`~actors.osworld.getters.GetterError` when
the task is evaluated, with the reason (never at load): googledrive_file (Google Drive), the website getters
when their site cannot be reached (pdf_from_url, page_info), gotoRecreationPage_and_get_html_content.
"""
from __future__ import annotations

import json
import urllib.parse
from pathlib import PurePosixPath
from typing import Any

from actors.desktop.controller_client import ControllerClient
from actors.osworld.cdp import CdpError, cdp_page
from actors.osworld.chrome import ChromeTabsError, chrome_tabs
from actors.osworld.getters import EvalContext, GetterError, _chrome_json, _save


def omnibox_text(url: str) -> str:
    """The text Chrome's address bar shows for ``url`` with its default elision (Chrome 76 and later): no
    ``http://``/``https://``, no leading ``www.``, no lone ``/`` path; other schemes (``chrome://``, ``file://``)
    are shown whole. Percent-escapes stay as they are (OSWorld's url_dashPart tasks expect ``%20``)."""
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.netloc:
        return url
    host = p.netloc[4:] if p.netloc.lower().startswith("www.") else p.netloc
    rest = url.split("://", 1)[1][len(p.netloc):]
    return host + ("" if rest == "/" else rest)


async def get_active_url_from_accessTree(c: ControllerClient, config: dict, ctx: EvalContext) -> str | None:
    """Mirrors OSWorld get_active_url_from_accessTree (getters/chrome.py, desktop-env 1.0.2): ``goto_prefix``
    (default ``https://``) + the active tab's address-bar text (:func:`omnibox_text`); None when no browser
    answers or no tab is open."""
    try:
        tabs = await chrome_tabs(c, "list", wait_s=5)
    except ChromeTabsError:
        return None
    if not tabs or not tabs[0].get("url"):
        return None
    return f"{config.get('goto_prefix', 'https://')}{omnibox_text(tabs[0]['url'])}"


async def get_url_dashPart(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """Mirrors OSWorld get_url_dashPart (desktop-env 1.0.2): part ``partIndex`` of the active URL split on "/"
    (``needDeleteId``: cut at "?"); ``returnType`` "string" gives it, "json" gives {config["key"]: it}; None when
    there is no active URL, the index is out of range or not an integer, or the returnType is unknown."""
    url = await get_active_url_from_accessTree(c, config, ctx)
    if url is None:
        return None
    try:
        index = int(config["partIndex"])
    except (KeyError, ValueError, TypeError):
        return None
    parts = url.split("/")
    if index >= len(parts):  # OSWorld checks only the upper bound; a too-negative index raises there as here
        return None
    part = parts[index]
    if config.get("needDeleteId", False):
        part = part.split("?")[0]
    if config.get("returnType") == "string":
        return part
    if config.get("returnType") == "json":
        return {config["key"]: part}
    return None


async def get_active_tab_url_parse(c: ControllerClient, config: dict, ctx: EvalContext) -> dict | None:
    """Mirrors OSWorld get_active_tab_url_parse (desktop-env 1.0.2): {key: first value of the query parameter or
    ""} for each of ``parse_keys`` of the active URL, keys renamed by ``replace`` {old: new}, values split on ","
    with ``split_list``; None when there is no active URL."""
    url = await get_active_url_from_accessTree(c, config, ctx)
    if url is None:
        return None
    query = urllib.parse.parse_qs(urllib.parse.urlparse(url).query)
    out = {key: query.get(key, [""])[0] for key in config["parse_keys"]}
    for old, new in (config.get("replace") or {}).items():
        out[new] = out.pop(old)
    if config.get("split_list", False):
        out = {k: v.split(",") for k, v in out.items()}
    return out


HTML_QUERIES_JS = r"""(() => {
const qs = %s, all = s => Array.from(document.querySelectorAll(s));
const xp = s => { const r = document.evaluate(s, document, null, XPathResult.ORDERED_NODE_SNAPSHOT_TYPE, null);
                  return r.snapshotLength ? r.snapshotItem(0) : null; };
const label = t => { t = t.toLowerCase(); const has = e => (e.textContent || "").toLowerCase().includes(t);
  const hit = Array.from(document.body ? document.body.querySelectorAll("*") : []).filter(
    e => has(e) && !Array.from(e.children).some(has));
  return hit.length ? hit[0].textContent.trim() : ""; };
return qs.map(([kind, s]) => {
  if (kind === "text") return all(s).map(e => (e.textContent || "").trim());
  if (kind === "direct_text") return all(s).map(e => Array.from(e.childNodes).filter(
      n => n.nodeType === Node.TEXT_NODE).map(n => n.textContent.trim()).filter(Boolean));
  if (kind === "li_span") return all(s + " li.catAllProducts").filter(e => e.querySelector("span")).map(
      e => e.querySelector("span").innerText.trim());
  if (kind === "h3") return all(s).filter(e => e.querySelector("h3")).map(
      e => e.querySelector("h3").textContent.trim());
  if (kind === "label") return label(s);
  if (kind === "xpath") { const e = xp(s); return e ? (e.textContent || "").trim() : null; }
  if (kind === "value") { const e = xp(s); return e ? (e.value || "").trim() : null; }
  return null; });
})()"""
"""JavaScript answering a list of ``[kind, selector]`` queries in the page (``%s`` is the JSON list): what
playwright's text_content / query_selector_all / locator('text=...') / input_value calls give OSWorld."""


def _html_queries(config: dict) -> list[list[str]]:
    cat, q = config["category"], []
    if cat == "class":
        q += [["text", "." + k] for k in config.get("class_multiObject", {})]
        q += [["direct_text", "." + k] for k in config.get("class_multiObject_child", {})]
        q += [["h3", "." + k] for k in config.get("class_multiObject_only_child", {})]
        q += [["text", "." + k] for k in config.get("class_multiObject_search_exist", {})]
        q += [["text", "." + k] for k in config.get("class_singleObject", {})]
    elif cat == "label":
        q += [["label", k] for k in config.get("labelObject", {})]
    elif cat == "xpath":
        q += [["xpath", k] for k in config.get("xpathObject", {})]
    elif cat == "input":
        q += [["value", k] for k in config.get("inputObject", {})]
    elif cat == "class&url":
        q += [["text", "." + k] for k in config.get("class_multiObject", {})]
        q += [["li_span", "." + k] for k in config.get("class_multiObject_li", {})]
    return q


def _pick(texts: list, objects: dict, out: dict) -> None:
    for order, key in objects.items():
        i = int(order)
        out[key] = texts[i] if len(texts) > i else ""


def _any_equal(key: str, texts: list[str]) -> bool:
    return any(key.lower() == t.lower() for t in texts)


def html_parse_result(config: dict, answers: list, page_url: str) -> dict:
    """OSWorld get_active_tab_html_parse's return value (desktop-env 1.0.2) from the page's answers to
    :func:`_html_queries` (same order) and the page's URL; a pure function of its inputs."""
    cat, out, it = config["category"], {}, iter(answers)
    if cat == "class":
        for objects in config.get("class_multiObject", {}).values():
            _pick(next(it), objects, out)
        for objects in config.get("class_multiObject_child", {}).values():
            per_element = next(it)
            _pick(per_element[0] if per_element else [], objects, out)  # OSWorld keeps the first element's
        for objects in config.get("class_multiObject_only_child", {}).values():
            _pick(next(it), objects, out)
        for wanted in config.get("class_multiObject_search_exist", {}).values():
            texts = next(it)
            out.update({w: w in texts for w in wanted if w != "is_other_exist"})
            if "is_other_exist" in wanted:
                if any(t not in wanted for t in texts):
                    out["is_other_exist"] = True
                out.setdefault("is_other_exist", False)
        for key in config.get("class_singleObject", {}).values():
            texts = next(it)
            out[key] = texts[0] if texts else ""
    elif cat in ("label", "xpath", "input"):
        objects = config.get({"label": "labelObject", "xpath": "xpathObject", "input": "inputObject"}[cat], {})
        for key in objects.values():
            value = next(it)
            out[key] = value or ""
    elif cat == "class&url":
        for group in ("class_multiObject", "class_multiObject_li"):
            for wanted in config.get(group, {}).values():
                texts = next(it)
                out.update({w.lower(): True for w in wanted if _any_equal(w, texts)})
                if any(all(t.lower() not in w.lower() for w in wanted) for t in texts):
                    out["is_other_exist"] = True
                out.setdefault("is_other_exist", False)
        url = page_url.lower()
        for key in config.get("url_include_expected", []):
            out.setdefault(key.lower(), key.lower() in url)
        for key, value in config.get("url_include_expected_multichoice", {}).items():
            out.setdefault(value.lower(), key.lower() in url)
    return out


async def get_active_tab_html_parse(c: ControllerClient, config: dict, ctx: EvalContext) -> dict | None:
    """Mirrors OSWorld get_active_tab_html_parse (desktop-env 1.0.2): finds the open tab at the active URL
    (goto_prefix + address-bar text, compared percent-decoded without a trailing slash) and reads elements by
    ``category``: class (class_multiObject, class_multiObject_child, class_multiObject_only_child,
    class_multiObject_search_exist, class_singleObject), label, xpath, input, class&url; see
    :func:`html_parse_result`. None when there is no active URL; {} when no open tab has that URL."""
    url = await get_active_url_from_accessTree(c, config, ctx)
    if url is None:
        return None
    queries = _html_queries(config)
    try:
        page = await cdp_page(c, tab=url, expression=HTML_QUERIES_JS % json.dumps(queries))
    except CdpError as exc:
        if exc.kind == "no_tab":
            return {}
        raise GetterError(f"active_tab_html_parse: {exc}") from exc
    return html_parse_result(config, page.get("value") or [None] * len(queries), page.get("url", ""))


async def _new_page(c: ControllerClient, url: str, what: str, **kw) -> dict:
    """:func:`cdp_page` on a new tab at ``url``; without a running browser, first starts ``google-chrome
    --remote-debugging-port=1337`` (as OSWorld's page getters do when playwright cannot connect)."""
    try:
        return await cdp_page(c, new=url, **kw)
    except CdpError as exc:
        if exc.kind != "no_browser":
            raise GetterError(f"{what}: {exc}") from exc
    await c.launch(["google-chrome", "--remote-debugging-port=1337"])
    try:
        return await cdp_page(c, new=url, **kw)
    except CdpError as exc:
        raise GetterError(f"{what}: {exc}") from exc


async def get_pdf_from_url(c: ControllerClient, config: dict, ctx: EvalContext) -> str:
    """Mirrors OSWorld get_pdf_from_url (desktop-env 1.0.2; playwright's ``page.pdf()``): opens ``path`` (a URL)
    in a new tab, prints it with CDP ``Page.printToPDF`` and saves the PDF in the cache as ``dest``. OSWorld
    writes a placeholder PDF when the page cannot be had; we raise GetterError instead (a site the desktop
    cannot reach says ``needs_network``), so no score is made from a page nobody saw."""
    tmp = f"/tmp/arpo-pdf-{PurePosixPath(ctx.cache_dir).name}.pdf"
    page = await _new_page(c, config["path"], "pdf_from_url", pdf=tmp)
    try:
        data = await c.get_file(page["pdf"])
    finally:
        await c.execute(["rm", "-f", tmp], timeout=30)
    if data is None:
        raise GetterError(f"pdf_from_url: the printed PDF of {config['path']} was not written")
    return await _save(ctx, config["dest"], data)


async def get_page_info(c: ControllerClient, config: dict, ctx: EvalContext) -> dict:
    """Mirrors OSWorld get_page_info (desktop-env 1.0.2): {"title", "url", "content"} (content: the page's HTML)
    of ``url`` opened in a new tab. GetterError when it cannot be loaded (OSWorld returns a "Connection failed"
    dict then)."""
    page = await _new_page(c, config["url"], "page_info", expression="document.documentElement.outerHTML")
    return {"title": page["title"], "url": page["url"], "content": page.get("value") or ""}


INFO_JS = r"""(() => %s.map(([action, sel, attr]) => { const e = document.querySelector(sel);
  if (!e) throw new Error("no element " + sel); return action === "inner_text" ? e.innerText : e.getAttribute(attr);
}))()"""


async def get_info_from_website(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """Mirrors OSWorld get_info_from_website (desktop-env 1.0.2): for each of ``infos``, the ``inner_text`` or
    ``attribute`` of the element at ``selector`` on ``url`` (opened in a new tab); on any failure (the site
    cannot be reached: always without network; an element missing) it returns ``backups``, as OSWorld does.
    The click_and_* actions (clicking through the site) are not driven here: a task using them gets ``backups``."""
    infos = config.get("infos", [])
    if any(i.get("action", "inner_text") not in ("inner_text", "attribute") for i in infos):
        return config.get("backups")
    queries = [[i.get("action", "inner_text"), i["selector"], i.get("attribute")] for i in infos]
    try:
        page = await _new_page(c, config["url"], "info_from_website", expression=INFO_JS % json.dumps(queries))
    except GetterError:
        return config.get("backups")
    return page.get("value")


async def _extension_settings(c: ControllerClient, field: str) -> Any:
    prefs = await _chrome_json(c, "Default/Preferences")
    if prefs is None:  # OSWorld's json.loads(None) raises: "Google"
        return "Google"
    try:
        settings = prefs.get("extensions", {}).get("settings", {})
        return [s["manifest"]["name"] if field == "name" else s["path"] for s in settings.values()]
    except (KeyError, TypeError, AttributeError):
        return "Google"


async def get_find_unpacked_extension_path(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """Mirrors OSWorld get_find_unpacked_extension_path (desktop-env 1.0.2): the ``path`` of every extension in
    Preferences' extensions.settings ("Google" without readable Preferences or with a malformed entry, as
    OSWorld)."""
    return await _extension_settings(c, "path")


async def get_find_installed_extension_name(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """Mirrors OSWorld get_find_installed_extension_name (desktop-env 1.0.2): the manifest name of every extension
    in Preferences' extensions.settings ("Google" without readable Preferences or with a malformed entry, as
    OSWorld)."""
    return await _extension_settings(c, "name")


async def get_googledrive_file(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_googledrive_file (desktop-env 1.0.2) downloads a file from the task author's Google Drive
    with PyDrive and stored credentials: not possible here; always GetterError."""
    raise GetterError("googledrive_file: needs Google Drive (OSWorld's PyDrive client, its credentials and "
                      "network); not supported here")


async def get_gotoRecreationPage_and_get_html_content(c: ControllerClient, config: dict, ctx: EvalContext) -> Any:
    """OSWorld get_gotoRecreationPage_and_get_html_content (desktop-env 1.0.2) clicks through the live website
    www.recreation.gov to read today's listing: not possible without network; always GetterError."""
    raise GetterError("gotoRecreationPage_and_get_html_content: drives the live website www.recreation.gov; "
                      "needs network, which the desktops do not have")


WEB_GETTERS = {
    "active_url_from_accessTree": get_active_url_from_accessTree, "url_dashPart": get_url_dashPart,
    "active_tab_url_parse": get_active_tab_url_parse, "active_tab_html_parse": get_active_tab_html_parse,
    "pdf_from_url": get_pdf_from_url, "page_info": get_page_info, "info_from_website": get_info_from_website,
    "find_unpacked_extension_path": get_find_unpacked_extension_path,
    "find_installed_extension_name": get_find_installed_extension_name, "googledrive_file": get_googledrive_file,
    "gotoRecreationPage_and_get_html_content": get_gotoRecreationPage_and_get_html_content,
}
"""Getter type -> implementation for the browser-page getters (merged into actors.osworld.getter_table.GETTERS)."""
