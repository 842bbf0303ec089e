"""The osworld image's `code` launcher (actors/desktop/profiles/osworld/code): the workbench URL it opens for a
folder, a workspace file or a file keeps every path intact, whatever characters its name holds (VS Code's web
workbench reads ?folder= and ?workspace= as paths and the payload's openFile as a URI, whose path it decodes)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import urllib.parse
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parents[2] / "actors/desktop/profiles/osworld/code"
HOSTILE_NAMES = ["a b.py", "c#d.py", "e?f=g.py", "h&i.py", "j%20k.py", "ünï cødé.py", "l:12.py", "m'n\"o.py",
                 "p+q.py"]


@pytest.fixture(scope="module")
def launcher():
    loader = importlib.machinery.SourceFileLoader("code_launcher", str(LAUNCHER))
    spec = importlib.util.spec_from_loader("code_launcher", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _query(url: str) -> dict[str, str]:
    parsed = urllib.parse.urlsplit(url)
    assert (parsed.scheme, parsed.netloc, parsed.path) == ("http", "127.0.0.1:18080", "/")
    return {k: v[0] for k, v in urllib.parse.parse_qs(parsed.query, keep_blank_values=True).items()}


def _opened_file(url: str) -> tuple[str, bool]:
    """(the file path VS Code decodes from the payload's openFile URI, whether gotoLineMode is on)."""
    q = _query(url)
    assert q["ew"] == "true"
    payload = dict(json.loads(q["payload"]))
    uri = urllib.parse.urlsplit(payload["openFile"])
    assert (uri.scheme, uri.netloc) == ("vscode-remote", "127.0.0.1:18080")
    return urllib.parse.unquote(uri.path), payload.get("gotoLineMode") == "true"


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_file_a_folder_and_a_workspace_keep_their_names(launcher, tmp_path, name):
    assert _opened_file(launcher.url_for(str(tmp_path / name))) == (str(tmp_path / name), False)
    folder = tmp_path / name.replace(".py", "")
    folder.mkdir()
    assert _query(launcher.url_for(str(folder))) == {"folder": str(folder)}
    ws = str(tmp_path / name.replace(".py", ".code-workspace"))
    assert _query(launcher.url_for(ws)) == {"workspace": ws}


def test_plain_code_relative_paths_and_goto(launcher, tmp_path, monkeypatch):
    assert launcher.url_for(None) == "http://127.0.0.1:18080/"
    monkeypatch.chdir(tmp_path)
    assert _opened_file(launcher.url_for("rel.py")) == (str(tmp_path / "rel.py"), False)
    assert _opened_file(launcher.url_for("t.py:12:3", goto=True)) == (str(tmp_path / "t.py") + ":12:3", True)
    assert _opened_file(launcher.url_for("t.py:12", goto=True)) == (str(tmp_path / "t.py") + ":12", True)
    # without -g a colon is part of the name, as VS Code's `code` reads it
    assert _opened_file(launcher.url_for("t.py:12")) == (str(tmp_path / "t.py:12"), False)


def test_a_new_code_server_pin_gives_new_layer_and_image_tags(monkeypatch):
    """The VS Code layer's tag hashes its pins and the apps layer; the osworld image's tag hashes the layer's."""
    from actors.desktop import build, vscode_layer

    base = build.base_tag("osworld")
    layer, image = vscode_layer.layer_tag(base), build.image_tag("osworld")
    assert layer.startswith("arpo-desktop-osworld-vscode:") and layer == vscode_layer.layer_tag(base)
    assert vscode_layer.layer_tag(base + "x") != layer
    monkeypatch.setattr(vscode_layer, "CODE_SERVER", "code-server@4.139.2")
    assert vscode_layer.layer_tag(base) != layer and build.image_tag("osworld") != image
