"""The stand-in mirror (actors/osworld/stand_in_mirror.py, stand_in_formats.py): every supported extension gives a
file its own library opens (those the training env has: Pillow, zipfile, tarfile, wave, json, xml; the office,
PDF, audio and video libraries of the metrics env in tests/integration/test_stand_in_files.py), the layout
DownloadCache reads, the manifest, and hostile mirror folders (links, foreign files)."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import lzma
import struct
import tarfile
import wave
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from actors.osworld import stand_in_formats as formats
from actors.osworld.downloads import DownloadCache
from actors.osworld.stand_in_mirror import MANIFEST, StandInError, main, write_mirror
from actors.osworld.task_files import scan_task_files
from arpo_async.task_sets import load_task_set

DATA = Path(__file__).resolve().parents[1] / "data" / "tasks" / "osworld_files"
PILLOW = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".gif": "GIF", ".bmp": "BMP", ".webp": "WEBP",
          ".tif": "TIFF", ".tiff": "TIFF"}


def _xml_parts(data: bytes) -> dict[str, ET.Element]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        assert z.testzip() is None
        return {n: ET.fromstring(z.read(n)) for n in z.namelist() if n.endswith((".xml", ".rels", ".opf", ".xhtml"))}


def _boxes(data: bytes, start: int = 0, end: int | None = None) -> dict[bytes, tuple[int, int]]:
    """Top-level ISO BMFF boxes of data[start:end]: type -> (payload start, payload end)."""
    out, at, end = {}, start, len(data) if end is None else end
    while at < end:
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        assert size >= 8 and at + size <= end, (kind, size)
        out[kind] = (at + 8, at + size)
        at += size
    return out


def _check(ext: str, data: bytes) -> None:
    """Open ``data`` as a file of type ``ext`` with that type's library, and find the mark where there is room."""
    mark = formats.MARK.encode()
    if ext in PILLOW:
        img = Image.open(io.BytesIO(data))
        assert img.format == PILLOW[ext] and img.size == (320, 240)
        img.load()
    elif ext in (".xlsx", ".docx", ".pptx"):
        parts = _xml_parts(data)
        main_part = {".xlsx": "xl/workbook.xml", ".docx": "word/document.xml", ".pptx": "ppt/presentation.xml"}[ext]
        assert {"[Content_Types].xml", "_rels/.rels", main_part, "docProps/core.xml"} <= set(parts)
        overrides = {o.get("PartName") for o in parts["[Content_Types].xml"] if o.tag.endswith("Override")}
        assert f"/{main_part}" in overrides
        with zipfile.ZipFile(io.BytesIO(data)) as z:  # every override names a part that is there
            assert {p.lstrip("/") for p in overrides} <= set(z.namelist())
            assert any(mark in z.read(n) for n in z.namelist() if n != "docProps/core.xml")
    elif ext in (".odt", ".ods", ".odp", ".epub"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            first = z.infolist()[0]
            assert first.filename == "mimetype" and first.compress_type == zipfile.ZIP_STORED
            assert z.read("mimetype") == (b"application/epub+zip" if ext == ".epub" else
                                          b"application/vnd.oasis.opendocument." +
                                          {".odt": b"text", ".ods": b"spreadsheet", ".odp": b"presentation"}[ext])
        parts = _xml_parts(data)
        assert mark in ET.tostring(parts["content.xml" if ext != ".epub" else "OEBPS/c1.xhtml"])
    elif ext == ".pdf":
        assert data.startswith(b"%PDF-1.4") and data.rstrip().endswith(b"%%EOF")
        xref = int(data.rsplit(b"startxref\n", 1)[1].split(b"\n")[0])
        rows = data[xref:].split(b"\n")
        assert rows[0] == b"xref"
        for n, row in enumerate(rows[3:3 + 6], 1):  # each object's offset points at "<n> 0 obj"
            assert data[int(row[:10]):].startswith(b"%d 0 obj" % n)
        assert mark in data
    elif ext in (".zip", ".vsix"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            assert z.read("ARPO-STAND-IN.txt").startswith(mark)
    elif ext in (".tar.gz", ".tgz", ".tar.xz", ".tar.bz2"):
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            member = tar.getmember("ARPO-STAND-IN.txt")
            assert member.isfile() and tar.extractfile(member).read().startswith(mark)
    elif ext in (".gz", ".xz"):
        assert (gzip.decompress(data) if ext == ".gz" else lzma.decompress(data)).startswith(mark)
    elif ext == ".wav":
        with wave.open(io.BytesIO(data)) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 16000, 16000)
    elif ext == ".mp3":
        assert data.startswith(b"ID3\x03") and mark in data
        size = sum(b << (7 * (3 - i)) for i, b in enumerate(data[6:10]))
        frames = data[10 + size:]
        assert len(frames) == 39 * 417
        assert all(frames[i:i + 4] == b"\xff\xfb\x90\xc0" for i in range(0, len(frames), 417))
    elif ext == ".mp4":
        top = _boxes(data)
        assert list(top) == [b"ftyp", b"mdat", b"moov"] and data[8:12] == b"isom"
        moov = _boxes(data, *top[b"moov"])
        trak = _boxes(data, *moov[b"trak"])
        stbl = _boxes(data, *_boxes(data, *_boxes(data, *trak[b"mdia"])[b"minf"])[b"stbl"])
        sizes = struct.unpack(">10I", data[stbl[b"stsz"][0] + 12:stbl[b"stsz"][1]])
        at = struct.unpack(">I", data[stbl[b"stco"][0] + 8:stbl[b"stco"][0] + 12])[0]
        for size in sizes:  # every sample is a JPEG frame Pillow decodes
            frame = Image.open(io.BytesIO(data[at:at + size]))
            assert frame.format == "JPEG" and frame.size == (160, 120)
            at += size
        assert at == top[b"mdat"][1] and mark in data[moov[b"udta"][0]:]
    elif ext == ".xcf":
        assert data.startswith(b"gimp xcf file\0")
        w, h, base = struct.unpack(">III", data[14:26])
        layer_at = struct.unpack(">I", data[26 + 8 + 1 + 8:26 + 8 + 1 + 8 + 4])[0]
        lw, lh, kind, name_len = struct.unpack(">IIII", data[layer_at:layer_at + 16])
        assert (w, h, base, lw, lh, kind) == (64, 64, 0, 64, 64, 1)
        assert data[layer_at + 16:layer_at + 16 + name_len] == mark + b"\0"
        assert len(data) > 64 * 64 * 4
    elif ext == ".raw":
        assert len(data) == 64 * 64 * 3
    elif ext == ".svg":
        assert ET.fromstring(data).tag == "{http://www.w3.org/2000/svg}svg" and mark in data
    elif ext in (".json", ".code-workspace"):
        assert "ARPO stand-in" in json.dumps(json.loads(data))
    elif ext in (".xml", ".html", ".htm"):
        assert mark in data and (ext != ".xml" or ET.fromstring(data).tag == "arpo-stand-in")
    else:  # text
        assert mark in data and data.decode("utf-8").endswith("\n")


@pytest.mark.parametrize("ext", sorted(formats.WRITERS))
def test_every_supported_extension_gives_a_file_its_library_opens(ext):
    data = formats.stand_in(f"file{ext}", b"seed")
    _check(ext, data)
    assert formats.stand_in(f"other{ext.upper()}", b"seed") == data  # deterministic, by extension not name


def test_contents_follow_the_seed_and_extensions_are_read_as_written():
    assert formats.stand_in("a.xlsx", b"1") != formats.stand_in("a.xlsx", b"2")
    assert formats.stand_in("a.png", b"1") != formats.stand_in("a.png", b"2")
    assert [formats.extension(n) for n in ("a.TAR.GZ", "b.tar.xz", "c.gz", "Bills_gold", ".bashrc", "d.e.Docx")] \
        == [".tar.gz", ".tar.xz", ".gz", "", "", ".docx"]
    with pytest.raises(formats.LeftOut, match="OLE compound file"):
        formats.stand_in("07-cluster-kMean (1).ppt", b"1")
    with pytest.raises(formats.LeftOut, match="unknown type '.qcow2'"):
        formats.stand_in("disk.qcow2", b"1")


def _files():
    files, problems = scan_task_files(load_task_set(DATA))
    assert len(files) == 9 and not problems
    return files


def test_the_mirror_holds_each_named_file_where_the_download_cache_looks(tmp_path):
    mirror = tmp_path / "mirror"
    manifest = write_mirror(_files(), mirror, source={"tasks": str(DATA)})
    assert manifest["complete"] and manifest["stand_in"] and not manifest["left_out"]
    assert json.loads((mirror / MANIFEST).read_text()) == manifest
    cache = DownloadCache(cache_dir=tmp_path / "cache", mirror=mirror)
    for f in _files():
        path = mirror / f.relpath
        entry = next(e for e in manifest["files"] if e["path"] == f.relpath.as_posix())
        assert entry["url"] == f.url and entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        _check(formats.extension(f.name), path.read_bytes())
        # the setup step's download and the cloud_file getter find it (no network: the cache dir stays empty)
        assert asyncio.run(cache.fetch(f.url, f.name, f.task_id)) == path
    assert not (tmp_path / "cache").exists()
    shared = [e for e in manifest["files"] if "thunderbird-profile.tar.gz" in e["path"]]
    assert len(shared) == 2 and shared[0]["sha256"] == shared[1]["sha256"]  # one URL, one content
    before = {p: p.read_bytes() for p in mirror.rglob("*") if p.is_file()}
    assert write_mirror(_files(), mirror, source={"tasks": str(DATA)}) == manifest  # rerun on its own mirror
    assert {p: p.read_bytes() for p in mirror.rglob("*") if p.is_file()} == before


def test_hostile_mirror_folders_are_refused_and_nothing_outside_is_touched(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    files = _files()
    one = files[0]
    cases = 0

    def refused(mirror: Path, match: str) -> None:
        nonlocal cases
        cases += 1
        with pytest.raises(StandInError, match=match):
            write_mirror(files, mirror)
        assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
        assert (outside / "keep.txt").read_text() == "mine"

    (tmp_path / "link").symlink_to(outside, target_is_directory=True)  # MIRROR itself a link
    refused(tmp_path / "link", "symbolic link")
    foreign = tmp_path / "foreign"  # a non-empty folder this generator did not make
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    refused(foreign, "did not make")
    assert (foreign / "notes.txt").read_text() == "x" and len(list(foreign.iterdir())) == 1
    (foreign / MANIFEST).symlink_to(outside / "keep.txt")  # a manifest that is a link
    refused(foreign, "did not make")
    (foreign / MANIFEST).unlink()
    (foreign / MANIFEST).write_text(json.dumps({"generator": "someone else"}))  # another tool's manifest
    refused(foreign, "did not make")
    refused(tmp_path / "no" / "parent", "parent folder")
    assert not (tmp_path / "no").exists()

    own = tmp_path / "own"
    write_mirror(files, own)
    target = own / one.relpath
    target.unlink()
    target.symlink_to(outside / "keep.txt")  # a link planted at a file the mirror writes
    refused(own, "symbolic link")
    target.unlink()
    domain = own / one.domain
    for p in sorted(domain.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    domain.rmdir()
    domain.symlink_to(outside, target_is_directory=True)  # a link planted at a folder of the mirror
    refused(own, "symbolic link")
    domain.unlink()
    write_mirror(files, own)
    extra = own / one.domain / one.task_id / "planted.xlsx"  # a foreign file at a path a task set names
    extra.write_text("foreign")
    other = [f for f in files if f.name != one.name][0]
    renamed = type(one)(one.domain, one.task_id, "planted.xlsx", other.url, one.kind)
    cases += 1
    with pytest.raises(StandInError, match="did not write"):
        write_mirror([*files, renamed], own)
    assert extra.read_text() == "foreign"
    assert cases == 8


def test_the_command_writes_the_mirror_and_refuses_a_foreign_folder_in_one_line(tmp_path, capsys):
    assert main(["--tasks", str(DATA), "--to", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "9 stand-in files written" in out and "not that the evaluators agree" in out
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "x").write_text("x")
    assert main(["--tasks", str(DATA), "--to", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not make" in err[0] and str(tmp_path / "f") in err[0]
    assert main(["--tasks", str(DATA), "--split", str(tmp_path / "nope.json"), "--to", str(tmp_path / "g")]) == 2
    assert "no such split" in capsys.readouterr().err and not (tmp_path / "g").exists()
