"""Stand-in office documents: the smallest valid packages of ECMA-376 (xlsx, docx, pptx) and OASIS ODF 1.2
(odt, ods, odp), written with zipfile, deterministic in a seed, marked with :data:`MARK`; and the helpers the
other stand-in writers share (:func:`rng`, :func:`words`, :func:`zip_parts`). Used through
:func:`actors.osworld.stand_in_formats.stand_in`. No office library is needed to write them; the metrics env's
openpyxl, python-docx, python-pptx and odfpy open them (tests/integration/test_stand_in_files.py), as does
LibreOffice in the osworld image.
"""
from __future__ import annotations

import io
import random
import zipfile
from xml.sax.saxutils import escape

MARK = "ARPO stand-in"
"""The text every marked stand-in file holds."""


def rng(seed: bytes) -> random.Random:
    """The random generator of a stand-in's content."""
    return random.Random(seed)


def words(gen: random.Random, n: int) -> list[str]:
    """``n`` words drawn by ``gen`` from a fixed list."""
    vocab = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit", "lumen", "pixel",
             "table", "north", "amber", "quartz", "echo")
    return [gen.choice(vocab) for _ in range(n)]


def zip_parts(parts: list[tuple[str, bytes]], stored_first: bool = False) -> bytes:
    """A zip of ``parts`` in order with fixed timestamps (deterministic); the first part stored uncompressed
    when ``stored_first`` (ODF's and EPUB's ``mimetype``)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for i, (name, data) in enumerate(parts):
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED if stored_first and i == 0 else zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    return buf.getvalue()


XML = '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
PKG_REL = "http://schemas.openxmlformats.org/package/2006/relationships"
DOC_REL = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"
OFFICE_CT = "application/vnd.openxmlformats-officedocument"


def _content_types(overrides: dict[str, str]) -> bytes:
    body = "".join(f'<Override PartName="{p}" ContentType="{t}"/>' for p, t in overrides.items())
    return (XML + '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
            '<Default Extension="xml" ContentType="application/xml"/>'
            f'<Override PartName="/docProps/core.xml" ContentType="application/vnd.openxmlformats-package.'
            f'core-properties+xml"/>{body}</Types>').encode()


def _rels(targets: list[tuple[str, str]]) -> bytes:
    """Relationships ``rId1..`` of (type, target); a type without ``/`` is an officeDocument relationship."""
    rows = "".join(f'<Relationship Id="rId{i}" Type="{t if "/" in t else DOC_REL + "/" + t}" Target="{target}"/>'
                   for i, (t, target) in enumerate(targets, 1))
    return (XML + f'<Relationships xmlns="{PKG_REL}">{rows}</Relationships>').encode()


def _core(title: str) -> bytes:
    return (XML + '<cp:coreProperties xmlns:cp="http://schemas.openxmlformats.org/package/2006/metadata/'
            'core-properties" xmlns:dc="http://purl.org/dc/elements/1.1/">'
            f'<dc:title>{escape(title)}</dc:title><dc:description>{MARK}: not OSWorld\'s file</dc:description>'
            '</cp:coreProperties>').encode()


def _ooxml(main: str, main_type: str, parts: list[tuple[str, bytes]], overrides: dict[str, str],
           title: str) -> bytes:
    rels = _rels([("officeDocument", main), (f"{PKG_REL}/metadata/core-properties", "docProps/core.xml")])
    return zip_parts([("[Content_Types].xml", _content_types({f"/{main}": main_type, **overrides})),
                 ("_rels/.rels", rels), ("docProps/core.xml", _core(title)), *parts])


def docx(seed: bytes) -> bytes:
    """A Word document (ECMA-376 WordprocessingML): a title paragraph with the mark and a few seeded ones."""
    gen = rng(seed)
    paras = [MARK] + [" ".join(words(gen, 8)).capitalize() + "." for _ in range(3)]
    body = "".join(f"<w:p><w:r><w:t>{escape(p)}</w:t></w:r></w:p>" for p in paras)
    doc = (XML + '<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
           f"<w:body>{body}<w:sectPr/></w:body></w:document>").encode()
    return _ooxml("word/document.xml", f"{OFFICE_CT}.wordprocessingml.document.main+xml",
                  [("word/document.xml", doc)], {}, MARK)


def xlsx(seed: bytes) -> bytes:
    """An Excel workbook (ECMA-376 SpreadsheetML): sheet ``Sheet1``, A1 the mark, then a header row and 5
    seeded rows of a word and two integers (inline strings: no shared-strings part)."""
    gen = rng(seed)
    rows = [[MARK], ["name", "a", "b"]] + [[words(gen, 1)[0], gen.randint(0, 99), gen.randint(0, 99)]
                                             for _ in range(5)]

    def cell(r: int, c: int, v: object) -> str:
        ref = f"{'ABC'[c]}{r}"
        if isinstance(v, int):
            return f'<c r="{ref}"><v>{v}</v></c>'
        return f'<c r="{ref}" t="inlineStr"><is><t>{escape(str(v))}</t></is></c>'
    data = "".join(f'<row r="{r}">' + "".join(cell(r, c, v) for c, v in enumerate(row)) + "</row>"
                   for r, row in enumerate(rows, 1))
    main = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
    sheet = (XML + f'<worksheet xmlns="{main}"><sheetData>{data}</sheetData></worksheet>').encode()
    book = (XML + f'<workbook xmlns="{main}" xmlns:r="{DOC_REL}"><sheets>'
            '<sheet name="Sheet1" sheetId="1" r:id="rId1"/></sheets></workbook>').encode()
    return _ooxml("xl/workbook.xml", f"{OFFICE_CT}.spreadsheetml.sheet.main+xml",
                  [("xl/workbook.xml", book), ("xl/_rels/workbook.xml.rels",
                                               _rels([("worksheet", "worksheets/sheet1.xml")])),
                   ("xl/worksheets/sheet1.xml", sheet)],
                  {"/xl/worksheets/sheet1.xml": f"{OFFICE_CT}.spreadsheetml.worksheet+xml"}, MARK)


_PML = ('xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main" '
        f'xmlns:r="{DOC_REL}" xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main"')
_TREE = ('<p:nvGrpSpPr><p:cNvPr id="1" name=""/><p:cNvGrpSpPr/><p:nvPr/></p:nvGrpSpPr><p:grpSpPr/>')


def _theme() -> bytes:
    colours = "".join(f"<a:{n}><a:srgbClr val=\"{v}\"/></a:{n}>" for n, v in (
        ("dk1", "000000"), ("lt1", "FFFFFF"), ("dk2", "1F497D"), ("lt2", "EEECE1"), ("accent1", "4F81BD"),
        ("accent2", "C0504D"), ("accent3", "9BBB59"), ("accent4", "8064A2"), ("accent5", "4BACC6"),
        ("accent6", "F79646"), ("hlink", "0000FF"), ("folHlink", "800080")))
    font = '<a:latin typeface="Liberation Sans"/><a:ea typeface=""/><a:cs typeface=""/>'
    fill = '<a:solidFill><a:schemeClr val="phClr"/></a:solidFill>'
    return (XML + '<a:theme xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main" name="Stand-in">'
            f'<a:themeElements><a:clrScheme name="Stand-in">{colours}</a:clrScheme>'
            f'<a:fontScheme name="Stand-in"><a:majorFont>{font}</a:majorFont><a:minorFont>{font}</a:minorFont>'
            f'</a:fontScheme><a:fmtScheme name="Stand-in"><a:fillStyleLst>{fill * 3}</a:fillStyleLst>'
            f'<a:lnStyleLst>{("<a:ln>" + fill + "</a:ln>") * 3}</a:lnStyleLst>'
            f'<a:effectStyleLst>{"<a:effectStyle><a:effectLst/></a:effectStyle>" * 3}</a:effectStyleLst>'
            f'<a:bgFillStyleLst>{fill * 3}</a:bgFillStyleLst></a:fmtScheme></a:themeElements></a:theme>').encode()


def pptx(seed: bytes) -> bytes:
    """A PowerPoint presentation (ECMA-376 PresentationML): one master, one layout, a theme and one slide with
    a text box holding the mark and seeded words."""
    gen = rng(seed)
    text = "".join(f'<a:p><a:r><a:rPr lang="en-US"/><a:t>{escape(t)}</a:t></a:r></a:p>'
                   for t in (MARK, " ".join(words(gen, 5))))
    shape = ('<p:sp><p:nvSpPr><p:cNvPr id="2" name="TextBox 1"/><p:cNvSpPr txBox="1"/><p:nvPr/></p:nvSpPr>'
             '<p:spPr><a:xfrm><a:off x="457200" y="457200"/><a:ext cx="8229600" cy="1143000"/></a:xfrm>'
             '<a:prstGeom prst="rect"><a:avLst/></a:prstGeom></p:spPr>'
             f'<p:txBody><a:bodyPr/><a:lstStyle/>{text}</p:txBody></p:sp>')
    clr = ('<p:clrMap bg1="lt1" tx1="dk1" bg2="lt2" tx2="dk2" accent1="accent1" accent2="accent2" '
           'accent3="accent3" accent4="accent4" accent5="accent5" accent6="accent6" hlink="hlink" '
           'folHlink="folHlink"/>')
    pres = (XML + f'<p:presentation {_PML}><p:sldMasterIdLst><p:sldMasterId id="2147483648" r:id="rId1"/>'
            '</p:sldMasterIdLst><p:sldIdLst><p:sldId id="256" r:id="rId2"/></p:sldIdLst>'
            '<p:sldSz cx="9144000" cy="6858000"/><p:notesSz cx="6858000" cy="9144000"/></p:presentation>')
    master = (XML + f'<p:sldMaster {_PML}><p:cSld><p:spTree>{_TREE}</p:spTree></p:cSld>{clr}'
              '<p:sldLayoutIdLst><p:sldLayoutId id="2147483649" r:id="rId1"/></p:sldLayoutIdLst></p:sldMaster>')
    layout = (XML + f'<p:sldLayout {_PML}><p:cSld><p:spTree>{_TREE}</p:spTree></p:cSld>'
              '<p:clrMapOvr><a:masterClrMapping/></p:clrMapOvr></p:sldLayout>')
    slide = (XML + f'<p:sld {_PML}><p:cSld><p:spTree>{_TREE}{shape}</p:spTree></p:cSld>'
             '<p:clrMapOvr><a:masterClrMapping/></p:clrMapOvr></p:sld>')
    pml = f"{OFFICE_CT}.presentationml"
    return _ooxml("ppt/presentation.xml", f"{pml}.presentation.main+xml", [
        ("ppt/presentation.xml", pres.encode()),
        ("ppt/_rels/presentation.xml.rels", _rels([("slideMaster", "slideMasters/slideMaster1.xml"),
                                                   ("slide", "slides/slide1.xml"), ("theme", "theme/theme1.xml")])),
        ("ppt/slideMasters/slideMaster1.xml", master.encode()),
        ("ppt/slideMasters/_rels/slideMaster1.xml.rels", _rels([("slideLayout", "../slideLayouts/slideLayout1.xml"),
                                                                ("theme", "../theme/theme1.xml")])),
        ("ppt/slideLayouts/slideLayout1.xml", layout.encode()),
        ("ppt/slideLayouts/_rels/slideLayout1.xml.rels", _rels([("slideMaster", "../slideMasters/slideMaster1.xml")])),
        ("ppt/slides/slide1.xml", slide.encode()),
        ("ppt/slides/_rels/slide1.xml.rels", _rels([("slideLayout", "../slideLayouts/slideLayout1.xml")])),
        ("ppt/theme/theme1.xml", _theme())],
        {"/ppt/slideMasters/slideMaster1.xml": f"{pml}.slideMaster+xml",
         "/ppt/slideLayouts/slideLayout1.xml": f"{pml}.slideLayout+xml",
         "/ppt/slides/slide1.xml": f"{pml}.slide+xml",
         "/ppt/theme/theme1.xml": f"{OFFICE_CT}.theme+xml"}, MARK)


_ODF_NS = ('xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
           'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
           'xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0" '
           'xmlns:draw="urn:oasis:names:tc:opendocument:xmlns:drawing:1.0" '
           'xmlns:svg="urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0" '
           'xmlns:meta="urn:oasis:names:tc:opendocument:xmlns:meta:1.0" '
           'xmlns:dc="http://purl.org/dc/elements/1.1/"')


def _odf(kind: str, body: str) -> bytes:
    """An OpenDocument package (ODF 1.2 part 3): ``mimetype`` stored first, the manifest, meta and content."""
    mime = f"application/vnd.oasis.opendocument.{kind}"
    manifest = (XML + '<manifest:manifest xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0" '
                f'manifest:version="1.2"><manifest:file-entry manifest:full-path="/" manifest:version="1.2" '
                f'manifest:media-type="{mime}"/><manifest:file-entry manifest:full-path="content.xml" '
                'manifest:media-type="text/xml"/><manifest:file-entry manifest:full-path="meta.xml" '
                'manifest:media-type="text/xml"/></manifest:manifest>')
    meta = (XML + f'<office:document-meta {_ODF_NS} office:version="1.2"><office:meta><dc:title>{MARK}</dc:title>'
            "</office:meta></office:document-meta>")
    content = (XML + f'<office:document-content {_ODF_NS} office:version="1.2"><office:body>{body}'
               "</office:body></office:document-content>")
    return zip_parts([("mimetype", mime.encode()), ("META-INF/manifest.xml", manifest.encode()),
                 ("meta.xml", meta.encode()), ("content.xml", content.encode())], stored_first=True)


def odt(seed: bytes) -> bytes:
    """An OpenDocument text: the mark and seeded paragraphs."""
    gen = rng(seed)
    paras = "".join(f"<text:p>{escape(p)}</text:p>" for p in [MARK] + [" ".join(words(gen, 8)) for _ in range(3)])
    return _odf("text", f"<office:text>{paras}</office:text>")


def ods(seed: bytes) -> bytes:
    """An OpenDocument spreadsheet: sheet ``Sheet1``, A1 the mark, then 5 seeded rows (a word, an integer)."""
    gen = rng(seed)

    def row(*cells: object) -> str:
        out = ""
        for v in cells:
            if isinstance(v, int):
                out += f'<table:table-cell office:value-type="float" office:value="{v}"><text:p>{v}</text:p>' \
                       "</table:table-cell>"
            else:
                out += f'<table:table-cell office:value-type="string"><text:p>{escape(str(v))}</text:p>' \
                       "</table:table-cell>"
        return f"<table:table-row>{out}</table:table-row>"
    rows = row(MARK) + "".join(row(words(gen, 1)[0], gen.randint(0, 99)) for _ in range(5))
    return _odf("spreadsheet", f'<office:spreadsheet><table:table table:name="Sheet1">{rows}</table:table>'
                               "</office:spreadsheet>")


def odp(seed: bytes) -> bytes:
    """An OpenDocument presentation: one page with a text frame holding the mark and seeded words."""
    gen = rng(seed)
    frame = ('<draw:frame svg:x="2cm" svg:y="2cm" svg:width="20cm" svg:height="3cm"><draw:text-box>'
             f"<text:p>{MARK}</text:p><text:p>{' '.join(words(gen, 5))}</text:p></draw:text-box></draw:frame>")
    return _odf("presentation", f'<office:presentation><draw:page draw:name="page1">{frame}</draw:page>'
                                "</office:presentation>")
