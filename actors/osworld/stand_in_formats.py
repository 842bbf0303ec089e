"""Stand-in file contents: for a file name, a small valid file of the type its extension names, deterministic
in a seed, marked as a stand-in where the format has room for a mark.

Used by :mod:`actors.osworld.stand_in_mirror` (the generator of a stand-in mirror of OSWorld's files). Every
writer here is pure Python: the standard library (zipfile, tarfile, gzip, lzma, wave, struct) and Pillow, which
the training environment has; the office formats are written as the smallest packages their specifications
allow (ECMA-376 for xlsx/docx/pptx, OASIS ODF 1.2 for odt/ods/odp, ISO 32000 for pdf), so no office library is
needed to write them. :func:`stand_in` answers the bytes; :data:`LEFT_OUT` says which extensions get no file
and why.

The mark: the text ``ARPO stand-in`` (:data:`MARK`) in the content where the format holds text (office text,
PDF text and Info, PNG tEXt, JPEG/GIF comment, ID3 comment, a file inside archives, text files' first line),
never in formats where text would change the type (BMP, WAV, raw pixels, XCF outside its layer name).
"""
from __future__ import annotations

import gzip
import io
import json
import lzma
import struct
import tarfile
import wave
from collections.abc import Callable

from PIL import Image, ImageDraw

from actors.osworld.stand_in_office import MARK, XML, docx, odp, ods, odt, pptx, rng, words, xlsx, zip_parts

LEFT_OUT: dict[str, str] = {
    ".ppt": "PowerPoint 97 binary (an OLE compound file): no writer in pure Python or Pillow",
    ".doc": "Word 97 binary (an OLE compound file): no writer in pure Python or Pillow",
    ".xls": "Excel 97 binary (an OLE compound file): no writer in pure Python or Pillow",
    ".mkv": "Matroska video: no muxer in pure Python or Pillow (OSWorld's tasks name none)",
    ".webm": "WebM video: needs a VP8/VP9 encoder (OSWorld's tasks name none)",
    ".ogg": "Ogg Vorbis audio: needs a Vorbis encoder (OSWorld's tasks name none)",
}
"""Extensions that get no stand-in, with the reason (any extension not known here or in :func:`stand_in` is
left out too, as ``unknown type``)."""


class LeftOut(Exception):
    """No stand-in for this file name; the message says why."""


def pdf(seed: bytes) -> bytes:
    """A one-page PDF 1.4 (Helvetica text: the mark and a seeded line; Info /Title the mark) with a correct
    cross-reference table."""
    gen = rng(seed)
    line = " ".join(words(gen, 6))
    stream = f"BT /F1 14 Tf 72 720 Td ({MARK}) Tj 0 -24 Td ({line}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
               f"<< /Title ({MARK}) /Subject (not OSWorld's file) >>".encode()]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R /Info 6 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _picture(seed: bytes, size: tuple[int, int] = (320, 240)) -> Image.Image:
    gen = rng(seed)
    img = Image.new("RGB", size, tuple(gen.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = gen.randrange(size[0] - 40), gen.randrange(size[1] - 40)
        draw.rectangle((x0, y0, x0 + gen.randint(20, 120), y0 + gen.randint(20, 80)),
                       fill=tuple(gen.randrange(256) for _ in range(3)))
    draw.text((8, 8), MARK, fill=(0, 0, 0))
    return img


def image(fmt: str) -> Callable[[bytes], bytes]:
    """A writer of a 320x240 seeded picture (background, 4 rectangles, the mark drawn) in Pillow's ``fmt``."""
    def write(seed: bytes) -> bytes:
        from PIL import PngImagePlugin
        img, buf = _picture(seed), io.BytesIO()
        if fmt == "PNG":
            info = PngImagePlugin.PngInfo()
            info.add_text("Comment", MARK)
            img.save(buf, fmt, pnginfo=info)
        elif fmt == "JPEG":
            img.save(buf, fmt, quality=85, comment=MARK.encode())
        elif fmt == "GIF":
            img.save(buf, fmt, comment=MARK.encode())
        else:
            img.save(buf, fmt)
        return buf.getvalue()
    return write


def svg(seed: bytes) -> bytes:
    """An SVG picture: a seeded rectangle and the mark as text."""
    gen = rng(seed)
    colour = "#%06x" % gen.randrange(1 << 24)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="320" '
            f'height="240"><rect x="20" y="40" width="200" height="120" fill="{colour}"/>'
            f'<text x="8" y="20">{MARK}</text></svg>\n').encode()


def xcf(seed: bytes) -> bytes:
    """A GIMP image (XCF version 0, the format of GIMP's xcf-save for plain RGB images): 64x64 RGB, one RGBA
    layer named with the mark, filled with one seeded colour; tiles uncompressed (PROP_COMPRESSION 0).
    Layout per GIMP's devel-docs/xcf.txt: header, image properties, layer and channel pointer lists, the layer
    (its properties, hierarchy and level pointers), the hierarchy, the level with one tile."""
    gen = rng(seed)
    w = h = 64
    pixel = bytes(gen.randrange(256) for _ in range(3)) + b"\xff"
    name = MARK.encode() + b"\0"

    def props(*items: tuple[int, bytes]) -> bytes:
        return b"".join(struct.pack(">II", t, len(p)) + p for t, p in items) + struct.pack(">II", 0, 0)
    head = b"gimp xcf file\0" + struct.pack(">III", w, h, 0) + props((17, b"\0"))  # PROP_COMPRESSION none
    layer_at = len(head) + 12  # after the layer list (one pointer, 0) and the empty channel list (0)
    layer_props = props((8, struct.pack(">I", 1)),   # PROP_VISIBLE
                        (6, struct.pack(">I", 255)))  # PROP_OPACITY
    layer = struct.pack(">III", w, h, 1) + struct.pack(">I", len(name)) + name + layer_props
    hier_at = layer_at + len(layer) + 8
    level_at = hier_at + 12 + 8
    tile_at = level_at + 8 + 8
    hierarchy = struct.pack(">III", w, h, 4) + struct.pack(">II", level_at, 0)
    level = struct.pack(">II", w, h) + struct.pack(">II", tile_at, 0)
    tile = pixel * (w * h)  # COMPRESS_NONE: the tile's pixels interleaved, row by row
    return (head + struct.pack(">III", layer_at, 0, 0) + layer + struct.pack(">II", hier_at, 0)
            + hierarchy + level + tile)


def wav(seed: bytes) -> bytes:
    """A 1 s 16-bit mono 16 kHz WAV of a seeded tone (220-880 Hz)."""
    import math
    freq, rate = rng(seed).randint(220, 880), 16000
    frames = b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * i / rate))) for i in range(rate))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def mp3(seed: bytes) -> bytes:
    """An MP3: an ID3v2.3 tag (TIT2 and COMM the mark), then 1 s of silent MPEG-1 Layer III frames (44.1 kHz,
    128 kbit/s, mono; side info and main data all zero, which decoders play as silence: ISO 11172-3 2.4.1)."""
    def frame(fid: bytes, data: bytes) -> bytes:
        return fid + struct.pack(">I", len(data)) + b"\0\0" + data
    text = MARK.encode("latin-1")
    frames = frame(b"TIT2", b"\0" + text) + frame(b"COMM", b"\0eng\0" + text + b": not OSWorld's file")
    size = len(frames)
    syncsafe = bytes(((size >> s) & 0x7F) for s in (21, 14, 7, 0))
    tag = b"ID3\x03\x00\x00" + syncsafe + frames
    header = bytes((0xFF, 0xFB, 0x90, 0xC0))  # MPEG-1 L3, no CRC, 128 kbit/s, 44100 Hz, no padding, mono
    length = 144 * 128000 // 44100  # 417 bytes a frame
    return tag + (header + bytes(length - 4)) * 39  # 39 frames x 1152 samples = 1.02 s


def mp4(seed: bytes) -> bytes:
    """An MP4 (ISO/IEC 14496-12 boxes): one video track of 10 JPEG frames (sample entry ``jpeg``, Motion JPEG
    as QuickTime and ffmpeg read it), 160x120 at 5 frames/s (2 s), ``ftyp isom``; the mark in a ``udta``
    ``©cmt`` box."""
    w, h, n, timescale = 160, 120, 10, 5
    frames = []
    for i in range(n):
        buf = io.BytesIO()
        _picture(seed + bytes([i]), (w, h)).save(buf, "JPEG", quality=70)
        frames.append(buf.getvalue())

    def box(kind: bytes, *payload: bytes) -> bytes:
        body = b"".join(payload)
        return struct.pack(">I", 8 + len(body)) + kind + body

    def full(kind: bytes, version_flags: int, *payload: bytes) -> bytes:
        return box(kind, struct.pack(">I", version_flags), *payload)
    matrix = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    ftyp = box(b"ftyp", b"isom", struct.pack(">I", 512), b"isomiso2mp41")
    mdat_header = 8
    chunk_at = len(ftyp) + mdat_header
    mdat = box(b"mdat", *frames)
    entry = (bytes(6) + struct.pack(">H", 1) + bytes(16) + struct.pack(">HH", w, h)
             + struct.pack(">II", 0x480000, 0x480000) + bytes(4) + struct.pack(">H", 1)
             + bytes([len(b"Photo - JPEG")]) + b"Photo - JPEG".ljust(31, b"\0") + struct.pack(">Hh", 24, -1))
    stbl = box(b"stbl", full(b"stsd", 0, struct.pack(">I", 1), box(b"jpeg", entry)),
               full(b"stts", 0, struct.pack(">III", 1, n, 1)),
               full(b"stsc", 0, struct.pack(">IIII", 1, 1, n, 1)),
               full(b"stsz", 0, struct.pack(">II", 0, n), *(struct.pack(">I", len(f)) for f in frames)),
               full(b"stco", 0, struct.pack(">II", 1, chunk_at)))
    minf = box(b"minf", full(b"vmhd", 1, bytes(8)),
               box(b"dinf", full(b"dref", 0, struct.pack(">I", 1), full(b"url ", 1))), stbl)
    mdia = box(b"mdia", full(b"mdhd", 0, struct.pack(">IIII", 0, 0, timescale, n), struct.pack(">HH", 0x55C4, 0)),
               full(b"hdlr", 0, bytes(4), b"vide", bytes(12), b"VideoHandler\0"), minf)
    tkhd = full(b"tkhd", 3, struct.pack(">IIII", 0, 0, 1, 0), struct.pack(">I", n), bytes(8),
                struct.pack(">hhhH", 0, 0, 0, 0), matrix, struct.pack(">II", w << 16, h << 16))
    mvhd = full(b"mvhd", 0, struct.pack(">IIII", 0, 0, timescale, n), struct.pack(">IH", 0x10000, 0x100),
                bytes(10), matrix, bytes(24), struct.pack(">I", 2))
    udta = box(b"udta", box(b"\xa9cmt", struct.pack(">HH", len(MARK), 0), MARK.encode()))
    moov = box(b"moov", mvhd, box(b"trak", tkhd, mdia), udta)
    return ftyp + mdat + moov


def _text_member(seed: bytes) -> bytes:
    return f"{MARK}: a placeholder for one of OSWorld's files, not its content.\n{seed.hex()[:16]}\n".encode()


def zip_archive(seed: bytes) -> bytes:
    """A zip holding ``ARPO-STAND-IN.txt`` (the mark)."""
    return zip_parts([("ARPO-STAND-IN.txt", _text_member(seed))])


def tar_archive(compression: str) -> Callable[[bytes], bytes]:
    """A writer of a tar (``compression``: ``gz``, ``xz`` or ``bz2``) holding ``ARPO-STAND-IN.txt``."""
    def write(seed: bytes) -> bytes:
        data, buf = _text_member(seed), io.BytesIO()
        with tarfile.open(fileobj=buf, mode=f"w:{compression}") as tar:
            info = tarfile.TarInfo("ARPO-STAND-IN.txt")
            info.size, info.mtime, info.mode = len(data), 1704067200, 0o644
            tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()
    return write


def epub(seed: bytes) -> bytes:
    """An EPUB 2 book: ``mimetype`` stored first, the container, an OPF package and one XHTML chapter."""
    opf = (XML + '<package xmlns="http://www.idpf.org/2007/opf" version="2.0" unique-identifier="id"><metadata '
           f'xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:title>{MARK}</dc:title><dc:identifier id="id">'
           f'{seed.hex()[:16]}</dc:identifier><dc:language>en</dc:language></metadata><manifest>'
           '<item id="c1" href="c1.xhtml" media-type="application/xhtml+xml"/></manifest>'
           '<spine><itemref idref="c1"/></spine></package>')
    container = (XML + '<container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                 '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                 "</rootfiles></container>")
    chapter = (XML + f'<html xmlns="http://www.w3.org/1999/xhtml"><head><title>{MARK}</title></head>'
               f"<body><p>{MARK}</p></body></html>")
    return zip_parts([("mimetype", b"application/epub+zip"), ("META-INF/container.xml", container.encode()),
                 ("OEBPS/content.opf", opf.encode()), ("OEBPS/c1.xhtml", chapter.encode())], stored_first=True)


def text(ext: str) -> Callable[[bytes], bytes]:
    """A writer of a small text file valid for ``ext`` (JSON parses, a shell script exits 0, Python runs, ...)
    with the mark in a comment or field."""
    def write(seed: bytes) -> bytes:
        line = " ".join(words(rng(seed), 6))
        note = f"{MARK}: not OSWorld's file"
        if ext in (".json", ".code-workspace"):
            body = json.dumps({"folders": [], "arpo_stand_in": note} if ext == ".code-workspace"
                              else {"arpo_stand_in": note, "words": line.split()}, indent=1)
        elif ext in (".py", ".sh", ".yaml", ".yml", ".toml", ".conf", ".ini", ".cfg"):
            body = ("#!/bin/sh\n" if ext == ".sh" else "") + f"# {note}\n# {line}\n" + \
                   ("exit 0\n" if ext == ".sh" else "")
        elif ext == ".csv":
            gen = rng(seed)
            body = f"name,value\n{MARK},0\n" + "".join(f"{words(gen, 1)[0]},{gen.randint(0, 99)}\n" for _ in range(5))
        elif ext in (".html", ".htm"):
            body = f"<!DOCTYPE html>\n<html><head><title>{MARK}</title></head><body><p>{line}</p></body></html>"
        elif ext in (".xml", ".svg"):
            body = f'<?xml version="1.0" encoding="UTF-8"?>\n<arpo-stand-in note="{note}">{line}</arpo-stand-in>'
        elif ext in (".js", ".css", ".c", ".java", ".cpp", ".h"):
            body = f"/* {note} */\n/* {line} */\n"
        elif ext in (".tex", ".bib"):
            body = f"% {note}\n% {line}\n"
        elif ext == ".srt":
            body = f"1\n00:00:00,000 --> 00:00:01,000\n{MARK}\n"
        elif ext == ".eml":
            body = (f"From: stand-in@example.invalid\nTo: user@example.invalid\nSubject: {MARK}\n"
                    f"Date: Mon, 01 Jan 2024 00:00:00 +0000\nMIME-Version: 1.0\n"
                    f"Content-Type: text/plain; charset=utf-8\n\n{note}\n{line}\n")
        else:
            body = f"{note}\n{line}\n"
        return (body if body.endswith("\n") else body + "\n").encode()
    return write


TEXT_EXTENSIONS = (".txt", ".csv", ".json", ".py", ".html", ".htm", ".md", ".xml", ".sh", ".js", ".css", ".tex",
                   ".bib", ".srt", ".eml", ".code-workspace", ".log", ".yaml", ".yml", ".toml", ".conf", ".ini",
                   ".cfg", ".c", ".cpp", ".h", ".java", "")
"""Extensions written as text ("" = a name with no extension, as OSWorld's ``Bills_gold``)."""

WRITERS: dict[str, Callable[[bytes], bytes]] = {
    ".xlsx": xlsx, ".docx": docx, ".pptx": pptx, ".odt": odt, ".ods": ods, ".odp": odp, ".pdf": pdf,
    ".png": image("PNG"), ".jpg": image("JPEG"), ".jpeg": image("JPEG"), ".gif": image("GIF"),
    ".bmp": image("BMP"), ".webp": image("WEBP"), ".tif": image("TIFF"), ".tiff": image("TIFF"), ".svg": svg,
    ".xcf": xcf, ".raw": lambda seed: _picture(seed, (64, 64)).tobytes(),
    ".wav": wav, ".mp3": mp3, ".mp4": mp4,
    ".zip": zip_archive, ".vsix": zip_archive, ".epub": epub,
    ".tar.gz": tar_archive("gz"), ".tgz": tar_archive("gz"), ".tar.xz": tar_archive("xz"),
    ".tar.bz2": tar_archive("bz2"),
    ".gz": lambda seed: gzip.compress(_text_member(seed), mtime=0),
    ".xz": lambda seed: lzma.compress(_text_member(seed)),
    **{e: text(e) for e in TEXT_EXTENSIONS},
}
"""The writer of each supported extension (lower case, with the dot; ``.tar.gz`` style double extensions)."""


def extension(name: str) -> str:
    """The extension :func:`stand_in` goes by: lower case, ``.tar.gz``/``.tar.xz``/``.tar.bz2`` kept whole,
    "" for a name without one (a leading dot, as ``.bashrc``, is not an extension)."""
    low = name.lower()
    for double in (".tar.gz", ".tar.xz", ".tar.bz2"):
        if low.endswith(double) and len(low) > len(double):
            return double
    stem, dot, ext = low.rpartition(".")
    return f".{ext}" if dot and stem else ""


def stand_in(name: str, seed: bytes) -> bytes:
    """The stand-in content for a file called ``name``, deterministic in ``seed``.

    Raises:
        LeftOut: the extension has no writer (:data:`LEFT_OUT` says why, else ``unknown type``).
    """
    ext = extension(name)
    writer = WRITERS.get(ext)
    if writer is None:
        raise LeftOut(LEFT_OUT.get(ext, f"unknown type {ext!r}: no stand-in writer"))
    return writer(seed)
