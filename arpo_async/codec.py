"""The wire codec: the only module that calls msgpack.

A message travels as a ZeroMQ multipart message: frame 0 is a msgpack map
``{"type": str, "schema": int, "body": map}``; frames 1..n hold raw blobs (screenshots and other bytes
fields of at least ``BLOB_MIN_BYTES``), referenced from the body by msgpack ExtType(1, frame index). A decoded
blob is a read-only ``memoryview`` of its frame (zero copy; bytes-like: ``len``, slicing, ``==`` with bytes,
hashing, file writes, PIL); ``bytes(value)`` makes a copy where a bytes method is needed.
Array fields (``messages.TokenArray``: int32, ``messages.LogprobArray``: float64) and integer lists travel as
little-endian int32 arrays (ExtType 2) or float64 arrays (ExtType 3), or from ``BLOB_MIN_BYTES`` on in a frame of
their own (ExtType 4 / 5 holding the frame index): an array's own bytes out, a read-only NumPy view of the received
bytes in (no per-element work on either side; a plain msgpack list is accepted too, checked item by item). A list of
dataclasses (a trajectory's steps) travels as one table (schema 2): an array column is all its rows' values joined
plus each row's length, any other column the list of the rows' values; the decoded rows' arrays are views of their
column. A string enum field (Trajectory.outcome) travels as its value, and decodes only to one of its
members. Never pickle; never base64.

Every decoder enforces a maximum total size and frame count, at most ``MAX_ITEMS`` items per msgpack array or map
and ``wire_checks.MAX_TABLE_ROWS`` rows per table (checked from the lengths before anything is built, so no message
holds the event loop for long), rejects unknown types and schema versions, and checks every field against the
message's type hints (:mod:`arpo_async.wire_checks`, which turns the unpacked body into the message), raising
WireError with the reason. A hostile or corrupt message therefore costs one WireError, never a crash or a
half-built object.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct
import typing
from typing import Any, Callable

import msgpack
import numpy as np

from arpo_async.messages import FLOAT64, INT32, MESSAGE_TYPES, SCHEMA_VERSION, float_array, int_array
from arpo_async.text import encodable
from arpo_async.wire_checks import WireError, array_dtype, enum_member, message_from_body, type_hints

BLOB_MIN_BYTES = 4096
"""bytes fields at least this long travel in their own frame (zero-copy on the receiving side)."""
READABLE_SCHEMAS = (1, SCHEMA_VERSION)
"""Schemas `decode` reads: schema 1 differs only in a list of dataclasses (a trajectory's steps), one map per item
instead of a table, so trajectories saved in checkpoints before schema 2 still load."""
MAX_FRAMES = 4096
"""Most frames one message may have (one per screenshot, plus the header)."""
MAX_ITEMS = 65536
"""Most items of one msgpack array or map in a header (msgpack refuses a longer one from its length prefix, before
building anything): a huge list costs no event-loop time. Arrays of numbers travel as ext types, not counted here."""

_EXT_BLOB, _EXT_INT32, _EXT_FLOAT64, _EXT_INT32_FRAME, _EXT_FLOAT64_FRAME = 1, 2, 3, 4, 5
_SHORT = 64
"""Integer lists up to this long are packed by `struct` (longer ones by NumPy, faster for them)."""
_EXT_OF_DTYPE = {INT32: _EXT_INT32, FLOAT64: _EXT_FLOAT64}
_DTYPE_OF_EXT = {code: dtype for dtype, code in _EXT_OF_DTYPE.items()}
_FRAME_EXT_OF_DTYPE = {INT32: _EXT_INT32_FRAME, FLOAT64: _EXT_FLOAT64_FRAME}
_DTYPE_OF_FRAME_EXT = {code: dtype for dtype, code in _FRAME_EXT_OF_DTYPE.items()}


_Encoder = Callable[[Any, list, str], Any]
"""(value, blobs, field name) -> the msgpack value of one field (blobs collects the frames of large bytes)."""


def encode(message: Any) -> list[bytes]:
    """Encode a message dataclass into multipart frames (header first, then blobs).

    Raises:
        WireError: the object is not a registered message type, a field does not fit its type, or msgpack cannot
            pack a value (a string UTF-8 cannot encode, an integer beyond 64 bits); never another exception.
    """
    msg_type = getattr(message, "TYPE", None)
    if msg_type not in MESSAGE_TYPES or not isinstance(message, MESSAGE_TYPES[msg_type]):
        raise WireError(f"not a wire message: {type(message).__name__}")
    blobs: list[bytes] = []
    try:
        body = _to_wire(message, blobs)
        header = msgpack.packb({"type": msg_type, "schema": SCHEMA_VERSION, "body": body}, use_bin_type=True)
    except WireError:
        raise
    except (ValueError, TypeError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
        raise WireError(f"{msg_type} cannot be encoded: {type(e).__name__}: {encodable(str(e))[:300]}") from e
    return [header, *blobs]


def decode(frames: list[bytes], *, max_bytes: int) -> Any:
    """Decode multipart frames into a message dataclass.

    Args:
        frames: frame 0 the msgpack header, then the blobs it references (bytes or buffers, e.g. the
            ``Frame.buffer`` of a ZeroMQ frame received with ``copy=False``; blob fields keep views of them).
        max_bytes: largest total size accepted (the sum of all frames).

    Raises:
        WireError: too large, too many frames, not msgpack, unknown type or schema, a missing, unknown or
            mistyped field, or a blob reference out of range.
    """
    if not frames:
        raise WireError("empty message")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"too many frames: {len(frames)} > {MAX_FRAMES}")
    total = sum(len(f) for f in frames)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes}")
    blobs = frames[1:]

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_BLOB:
            index = int.from_bytes(data, "little")
            if index >= len(blobs):
                raise WireError(f"blob reference {index} but only {len(blobs)} blob frames")
            return memoryview(blobs[index]).toreadonly()  # zero copy: a view of the frame
        dtype = _DTYPE_OF_EXT.get(code)
        if dtype is None and code in _DTYPE_OF_FRAME_EXT:  # an array in a frame of its own
            dtype, index = _DTYPE_OF_FRAME_EXT[code], int.from_bytes(data, "little")
            if index >= len(blobs):
                raise WireError(f"array frame reference {index} but only {len(blobs)} blob frames")
            data = blobs[index]
        if dtype is not None:
            if len(data) % dtype.itemsize:
                raise WireError(f"{dtype.name} array length is not a multiple of {dtype.itemsize}")
            return np.frombuffer(data, dtype)  # a read-only view of ``data``: no copy, no per-element work
        raise WireError(f"unknown msgpack extension type {code}")

    try:
        header = msgpack.unpackb(frames[0], raw=False, ext_hook=ext_hook, strict_map_key=True,
                                 max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated exception types on corrupt input
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WireError("header must be a map with a string 'type'")
    if type(header.get("schema")) is not int or header["schema"] not in READABLE_SCHEMAS:  # True == 1: not one
        raise WireError(f"schema {header.get('schema')!r} is not {SCHEMA_VERSION} (peers of different versions)")
    cls = MESSAGE_TYPES.get(header["type"])
    if cls is None:
        raise WireError(f"unknown message type {header['type']!r}")
    return message_from_body(cls, header.get("body"), header["type"])


def _to_wire(obj: Any, blobs: list[bytes]) -> dict[str, Any]:
    out = {}
    for name, encode_field in _encoders(type(obj)):
        value = getattr(obj, name)
        out[name] = value if encode_field is None else encode_field(value, blobs, name)
    return out


@functools.cache
def _encoders(cls: type) -> tuple[tuple[str, _Encoder | None], ...]:
    """Each field's (name, encoder), the encoder None where the value goes on the wire as it is (no call). Resolving
    type hints per field costs far more than converting the value, so the dispatch is done here, once per class."""
    hints = type_hints(cls)
    return tuple((f.name, None if (encode_field := _encoder(hints[f.name])) is _as_is else encode_field)
                 for f in dataclasses.fields(cls))


def _as_is(value: Any, blobs: list, name: str) -> Any:
    """The encoder of a field whose value msgpack packs as it is."""
    return value


@functools.cache
def _encoder(hint: Any) -> _Encoder:
    """The encoder of a field of type ``hint`` (see :data:`_Encoder`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value, blobs, name: _to_wire(value, blobs)
    dtype = array_dtype(hint)
    if dtype is not None:
        return lambda value, blobs, name: _array_ext(dtype, _bytes(_packed(value, dtype, name)), blobs)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return functools.partial(_table, cls=args[0])
    if origin is list and args == (bytes,):
        item = _encoder(args[0])
        return lambda value, blobs, name: [item(v, blobs, name) for v in value]
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return lambda value, blobs, name: enum_member(hint, value, name).value
    if hint is bytes:
        return _blob
    return _as_is


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, data)`` without its argument checks in Python (~0.35 us of ~0.6, 90 times per
    trajectory): ``code`` is one of this module's constants and ``data`` is bytes, so they hold by construction."""
    return tuple.__new__(msgpack.ExtType, (code, data))


def _blob(value: Any, blobs: list[bytes], name: str) -> Any:
    """A bytes field: inline when short, else its own frame referenced by ExtType(1, frame index)."""
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) >= BLOB_MIN_BYTES:
        blobs.append(bytes(value))
        return _ext(_EXT_BLOB, (len(blobs) - 1).to_bytes(4, "little"))
    return value


def _packed(values: Any, dtype: np.dtype, name: str) -> bytes | np.ndarray:
    """``values`` (an array, or a list of numbers) as a bytes-like 1-D array of ``dtype`` (int32 or float64): bytes,
    or a C-contiguous array of ``dtype`` itself (its buffer is the bytes; ``b"".join`` and msgpack take it as is).

    Raises:
        WireError: values that are not integers in int32's range (int32) or not numbers (float64).
    """
    if type(values) is list and dtype == INT32 and len(values) <= _SHORT and all(type(v) is int for v in values):
        try:  # a short list of ints (image indices): struct packs it ~10x faster than a NumPy round trip
            return struct.pack(f"<{len(values)}i", *values)
        except struct.error:
            pass  # outside int32: the path below names the values
    try:
        arr = int_array(values) if dtype == INT32 else float_array(values)
    except TypeError as e:
        raise WireError(f"{name}: {e}") from None
    if arr.dtype != dtype:
        raise WireError(f"{name}: values must be int32 integers (found {arr.min()}..{arr.max()})")
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _table(rows: Any, blobs: list[bytes], name: str, *, cls: type) -> list:
    """A list of ``cls`` dataclasses as one table, ``[n, {field: column}]`` (schema 2): an array field (or integer
    list) is one column ``[ExtType(values of all rows, joined), ExtType(int32 length of each row)]``, so a trajectory's
    steps travel as a handful of arrays instead of one map and four arrays per step; any other field is the list of
    its n values, each encoded as in a single message.

    Raises:
        WireError: ``rows`` is not a list of ``cls``, or a value does not fit its field (named ``name[i].field``).
    """
    if not isinstance(rows, list) or not all(type(row) is cls for row in rows):
        raise WireError(f"{name}: expected a list of {cls.__name__}")
    columns: dict[str, Any] = {}
    for field, encode_field, dtype in _columns(cls):
        values = [getattr(row, field) for row in rows]
        if dtype is not None:
            joined = _joined(values, dtype)
            if joined is None:  # not all arrays of the column's dtype: convert (and check) each value
                packed = [_packed(v, dtype, f"{name}[{i}].{field}") for i, v in enumerate(values)]
                joined = b"".join(packed)
                values = [len(v) // dtype.itemsize if type(v) is bytes else v for v in packed]
            lengths = [v if type(v) is int else len(v) for v in values]
            columns[field] = [_array_ext(dtype, joined, blobs),
                              _ext(_EXT_INT32, struct.pack(f"<{len(lengths)}i", *lengths))]
        elif encode_field is None:
            columns[field] = values
        else:
            columns[field] = [encode_field(v, blobs, f"{name}[{i}].{field}") for i, v in enumerate(values)]
    return [len(rows), columns]


def _array_ext(dtype: np.dtype, data: bytes, blobs: list[bytes]) -> msgpack.ExtType:
    """The ExtType of an array's bytes: inline (ExtType 2 / 3) when short; from ``BLOB_MIN_BYTES`` on, in a frame of
    its own (ExtType 4 / 5 holding the frame index), so that msgpack copies none of it and the receiver's array is
    a view of the frame."""
    if len(data) < BLOB_MIN_BYTES:
        return _ext(_EXT_OF_DTYPE[dtype], data)
    blobs.append(data)
    return _ext(_FRAME_EXT_OF_DTYPE[dtype], (len(blobs) - 1).to_bytes(4, "little"))


def _joined(values: list, dtype: np.dtype) -> bytes | None:
    """The bytes of ``values`` joined, when each is a contiguous 1-D array of ``dtype`` (what an actor's steps hold:
    one copy, no per-value conversion); else None."""
    if not all(type(v) is np.ndarray and v.dtype is dtype and v.ndim == 1 for v in values):
        return None
    try:
        return b"".join(values)
    except (BufferError, TypeError, ValueError):  # a non-contiguous view
        return None


@functools.cache
def _columns(cls: type) -> tuple[tuple[str, _Encoder | None, np.dtype | None], ...]:
    """Each field of a table's rows: (name, encoder or None for a value sent as it is, dtype of an array column or
    None)."""
    hints = type_hints(cls)
    return tuple((name, encode_field, array_dtype(hints[name])) for name, encode_field in _encoders(cls))


def _bytes(packed: bytes | np.ndarray) -> bytes:
    return packed if type(packed) is bytes else packed.tobytes()
