"""Request forms for the controller: multipart/form-data bodies (/setup/upload, /file) split into fields.

Owns nothing but the parsing; the splitting itself is werkzeug's sans-IO multipart decoder (Debian's
python3-werkzeug, in packages.txt, which server.py runs on; werkzeug's own form parser does not decode
Content-Transfer-Encoding and spools files to disk). Invariants: the
body is fed to the decoder in MULTIPART_CHUNK slices, so besides the body only the fields' bytes are held
(limits.BODY_EXPANSION counts the two); a malformed body is a ValueError, never a partial form.
"""
from __future__ import annotations

import base64
import quopri

from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

MULTIPART_CHUNK = 64 * 1024


def is_multipart(content_type: str) -> bool:
    """Whether a Content-Type header names multipart/form-data."""
    return content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


def _decode(data: bytearray, encoding: str) -> bytes | bytearray:
    """A part's bytes after its Content-Transfer-Encoding (base64, quoted-printable; anything else as sent)."""
    if encoding == "base64":
        return base64.b64decode(data)
    if encoding == "quoted-printable":
        return quopri.decodestring(bytes(data))
    return data


def parse_multipart(content_type: str, body: bytes) -> dict[str, bytes | bytearray]:
    """Form fields of a multipart/form-data body -> {name: bytes}; ValueError when it is malformed (no
    boundary, a part without Content-Disposition, a body that does not end with its closing boundary).
    Parts without a name are skipped; base64 and quoted-printable parts are decoded."""
    boundary = parse_options_header(content_type)[1].get("boundary")
    if not boundary:
        raise ValueError("multipart/form-data without a boundary")
    decoder = MultipartDecoder(boundary.encode("latin-1"))
    fields: dict[str, bytes | bytearray] = {}
    name, encoding, data = None, "", bytearray()
    view = memoryview(body)
    for start in range(0, len(body) + MULTIPART_CHUNK, MULTIPART_CHUNK):
        decoder.receive_data(bytes(view[start:start + MULTIPART_CHUNK]) if start < len(body) else None)
        while not isinstance(event := decoder.next_event(), (NeedData, Epilogue)):
            if isinstance(event, (Field, File)):
                name, data = event.name, bytearray()
                encoding = event.headers.get("Content-Transfer-Encoding", "").strip().lower()
            elif isinstance(event, Data):
                data += event.data
                if not event.more_data and name is not None:
                    fields[name] = _decode(data, encoding)
        if isinstance(event, Epilogue):
            return fields
    raise ValueError("multipart body is not terminated by its boundary")  # the decoder says so first
