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
and ``MAX_TABLE_ROWS`` rows per table (checked from the lengths before anything is built, so no message holds the
event loop for long), rejects unknown types and schema versions,
and checks every field against the message's type hints, raising WireError with the reason. A hostile or
corrupt message therefore costs one WireError, never a crash or a half-built object.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import struct
import typing
from typing import Any, Callable

import msgpack
import numpy as np

from arpo_async.messages import FLOAT64, INT32, MESSAGE_TYPES, SCHEMA_VERSION, float_array, int_array
from arpo_async.text import encodable

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
MAX_TABLE_ROWS = 4096
"""Most rows of a table (a trajectory's steps), checked from the table's row count before any row is built; the
learner's validation then caps a trajectory at 512 steps (arpo_async.validation.Limits.max_steps)."""

_EXT_BLOB, _EXT_INT32, _EXT_FLOAT64, _EXT_INT32_FRAME, _EXT_FLOAT64_FRAME = 1, 2, 3, 4, 5
_SHORT = 64
"""Integer lists up to this long are packed by `struct` (longer ones by NumPy, faster for them)."""
_EXT_OF_DTYPE = {INT32: _EXT_INT32, FLOAT64: _EXT_FLOAT64}
_DTYPE_OF_EXT = {code: dtype for dtype, code in _EXT_OF_DTYPE.items()}
_FRAME_EXT_OF_DTYPE = {INT32: _EXT_INT32_FRAME, FLOAT64: _EXT_FLOAT64_FRAME}
_DTYPE_OF_FRAME_EXT = {code: dtype for dtype, code in _FRAME_EXT_OF_DTYPE.items()}


class WireError(ValueError):
    """A message that cannot be decoded or encoded: too large, malformed, unknown type, wrong field types."""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a message dataclass, ``Annotated`` kept (an array field's dtype)."""
    return typing.get_type_hints(cls, include_extras=True)


def _array_dtype(hint: Any) -> np.dtype | None:
    """The dtype of an array field's hint (``Annotated[np.ndarray, dtype]``; int32 for ``list[int]``), or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated and args[0] is np.ndarray:
        return args[1]
    return INT32 if origin is list and args == (int,) else None


_Encoder = Callable[[Any, list, str], Any]
"""(value, blobs, field name) -> the msgpack value of one field (blobs collects the frames of large bytes)."""
_Decoder = Callable[[Any, str], Any]
"""(wire value, path) -> the checked field value; raises WireError naming ``path``."""


_PLAIN = (str, int, float, bool, bytes)
"""Field types whose wire value is used as it is when it has exactly that type."""


@functools.cache
def _plan(cls: type) -> tuple[tuple[tuple[str, _Encoder, _Decoder, type | None, np.dtype | None], ...],
                              frozenset[str]]:
    """Per message dataclass, once: each field's (name, encoder, decoder, plain type or None, packed dtype or None),
    and the names of the required ones. Resolving type hints per field costs far more than converting the value, so
    the dispatch is done here. A wire value of the plain type, or for an array field a packed array of its dtype
    (what the ext hook made), is the field's value as it is."""
    hints = _hints(cls)
    fields = tuple((f.name, _encoder(hints[f.name]), _decoder(hints[f.name]),
                    hints[f.name] if hints[f.name] in _PLAIN else None, _packed_dtype(hints[f.name]))
                   for f in dataclasses.fields(cls))
    required = frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return fields, required


def _packed_dtype(hint: Any) -> np.dtype | None:
    """The dtype of an array field (``Annotated[np.ndarray, dtype]``), or None (an integer list decodes to a list)."""
    return _array_dtype(hint) if typing.get_origin(hint) is not list else None


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
    return _from_wire(cls, header.get("body"), header["type"])


def _to_wire(obj: Any, blobs: list[bytes]) -> dict[str, Any]:
    out = {}
    for name, encode_field in _encoders(type(obj)):
        value = getattr(obj, name)
        out[name] = value if encode_field is None else encode_field(value, blobs, name)
    return out


@functools.cache
def _encoders(cls: type) -> tuple[tuple[str, _Encoder | None], ...]:
    """Each field's (name, encoder), the encoder None where the value goes on the wire as it is (no call)."""
    return tuple((name, None if encode_field is _as_is else encode_field) for name, encode_field, *_ in _plan(cls)[0])


def _as_is(value: Any, blobs: list, name: str) -> Any:
    """The encoder of a field whose value msgpack packs as it is."""
    return value


@functools.cache
def _encoder(hint: Any) -> _Encoder:
    """The encoder of a field of type ``hint`` (see :data:`_Encoder`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value, blobs, name: _to_wire(value, blobs)
    dtype = _array_dtype(hint)
    if dtype is not None:
        return lambda value, blobs, name: _array_ext(dtype, _bytes(_packed(value, dtype, name)), blobs)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return functools.partial(_table, cls=args[0])
    if origin is list and args == (bytes,):
        item = _encoder(args[0])
        return lambda value, blobs, name: [item(v, blobs, name) for v in value]
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return lambda value, blobs, name: _member(hint, value, name).value
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
    hints = _hints(cls)
    return tuple((name, encode_field, _array_dtype(hints[name])) for name, encode_field in _encoders(cls))


def _bytes(packed: bytes | np.ndarray) -> bytes:
    return packed if type(packed) is bytes else packed.tobytes()


def _member(hint: type[enum.StrEnum], value: Any, path: str) -> enum.StrEnum:
    """``value`` as a member of the string enum ``hint`` (a member, or a string naming one)."""
    if not isinstance(value, str):
        raise WireError(f"{path}: expected str, got {type(value).__name__}")
    try:
        return hint(value)
    except ValueError:
        raise WireError(f"{path}: {value[:40]!r} is not a {hint.__name__} (one of {[m.value for m in hint]})") from None


def _from_wire(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{path}: expected a map, got {type(data).__name__}")
    fields, required = _plan(cls)
    if len(data) > len(fields) or not required <= data.keys():
        unknown = set(data) - {field[0] for field in fields}
        if unknown:
            raise WireError(f"{path}: unknown field(s) {sorted(map(str, unknown))}")
        missing = next(field[0] for field in fields if field[0] in required and field[0] not in data)
        raise WireError(f"{path}: missing field {missing!r}")
    kwargs: dict[str, Any] = {}
    for name, _, decode_field, plain, packed in fields:
        if name in data:
            value = data[name]
            if type(value) is plain or (packed is not None and type(value) is np.ndarray and value.dtype == packed):
                kwargs[name] = value
            else:
                kwargs[name] = decode_field(value, f"{path}.{name}")
    if len(kwargs) != len(data):
        raise WireError(f"{path}: unknown field(s) {sorted(map(str, set(data) - kwargs.keys()))}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # a __post_init__ refusing a value the checks above let through
        raise WireError(f"{path}: {e}") from None


def _check(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked (and converted) as a field of type ``hint``; raises WireError naming ``path``."""
    return _decoder(hint)(value, path)


@functools.cache
def _decoder(hint: Any) -> _Decoder:
    """The decoder of a field of type ``hint`` (see :data:`_Decoder`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return lambda value, path: _from_wire(hint, value, path)
    dtype = _array_dtype(hint)
    if dtype is not None and origin is not list:
        return lambda value, path: _check_array(value, dtype, path)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return functools.partial(_check_table, cls=args[0])
    if origin is list:
        return functools.partial(_check_list, item=args[0], decode_item=_decoder(args[0]))
    if origin is dict or hint is dict:
        return functools.partial(_check_map, key_value=args)
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return lambda value, path: _member(hint, value, path)
    if hint in (float, int, str, bytes, bool):
        return functools.partial(_check_scalar, hint=hint)
    raise WireError(f"unsupported field type {hint!r}")


def _check_list(value: Any, path: str, *, item: Any, decode_item: _Decoder) -> list:
    if item is int and type(value) is np.ndarray and value.dtype == INT32:
        return value.tolist()  # a short packed list (image indices)
    if not isinstance(value, list):
        raise WireError(f"{path}: expected a list, got {type(value).__name__}")
    if _all_of_type(value, item):
        return list(value)  # fast path: nothing to convert (the per-item loop costs ~1 us per item)
    return [decode_item(v, f"{path}[{i}]") for i, v in enumerate(value)]


def _check_table(value: Any, path: str, *, cls: type) -> list:
    """The rows of a table (see `_table`) as a list of ``cls``; each array column is split into read-only views of
    its values, one per row (no copy). A schema 1 list of maps (a checkpoint written before tables) is accepted too,
    each map checked as a single ``cls``.

    Raises:
        WireError: not ``[n, {field: column}]`` with n >= 0; an unknown or missing column; a column that does not
            hold n values; lengths that are negative or do not add up to the values; a value that does not fit its
            field (named ``path[i].field``).
    """
    if type(value) is list and all(type(row) is dict for row in value):  # schema 1: one map per row
        return [_from_wire(cls, row, f"{path}[{i}]") for i, row in enumerate(value)]
    if not (type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is dict):
        raise WireError(f"{path}: expected a table [rows, {{field: column}}] of {cls.__name__}")
    n, columns = value
    if n > MAX_TABLE_ROWS:
        raise WireError(f"{path}: {n} rows, more than the {MAX_TABLE_ROWS} a table may hold")
    fields, required = _plan(cls)
    unknown = columns.keys() - {field[0] for field in fields}
    if unknown:
        raise WireError(f"{path}: unknown column(s) {sorted(map(str, unknown))}")
    if n < 0 or (n and not columns):
        raise WireError(f"{path}: {n} rows in {len(columns)} columns")
    names, cells = [], []
    for (name, _, decode_field, plain, packed), (_, _, dtype) in zip(fields, _columns(cls)):
        if name not in columns:
            if name in required and n:
                raise WireError(f"{path}: missing column {name!r}")
            continue
        where = f"{path}.{name}"
        if dtype is not None:
            column = _split(columns[name], n, dtype, where)
            if packed is None:  # an integer list (image indices): lists of ints
                column = [row.tolist() for row in column]
        else:
            column = columns[name]
            if type(column) is not list or len(column) != n:
                raise WireError(f"{where}: expected a list of {n} values")
            if plain is None or not _all_of_type(column, plain):
                column = [decode_field(v, f"{path}[{i}].{name}") for i, v in enumerate(column)]
        names.append(name)
        cells.append(column)
    try:
        if len(names) == len(fields):
            return [cls(*row) for row in zip(*cells)]
        return [cls(**dict(zip(names, row))) for row in zip(*cells)]
    except (TypeError, ValueError) as e:  # a __post_init__ refusing a value the checks above let through
        raise WireError(f"{path}: {e}") from None


def _split(column: Any, n: int, dtype: np.dtype, path: str) -> list[np.ndarray]:
    """An array column ``[values, lengths]`` as its n rows (views of ``values``)."""
    if type(column) is not list or len(column) != 2:
        raise WireError(f"{path}: expected [values, lengths]")
    values = _check_array(column[0], dtype, path)
    lengths = _check_array(column[1], INT32, f"{path} lengths")
    if len(lengths) != n:
        raise WireError(f"{path}: {len(lengths)} lengths for {n} rows")
    sizes = lengths.tolist()  # a few Python ints: cheaper to check and add up than NumPy calls
    if lengths.dtype != INT32 or (n and min(sizes) < 0):
        raise WireError(f"{path}: lengths must be int32 integers >= 0")
    ends = list(itertools.accumulate(sizes))
    if (ends[-1] if n else 0) != len(values):
        raise WireError(f"{path}: lengths add up to {ends[-1] if n else 0}, not the {len(values)} values")
    return [values[start:end] for start, end in zip([0, *ends], ends)]


def _check_map(value: Any, path: str, *, key_value: tuple) -> dict:
    if not isinstance(value, dict):
        raise WireError(f"{path}: expected a map, got {type(value).__name__}")
    if key_value:
        return {_check(k, key_value[0], path): _check(v, key_value[1], f"{path}[{k!r}]") for k, v in value.items()}
    return value


def _check_scalar(value: Any, path: str, *, hint: type) -> Any:
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{path}: expected a number, got {type(value).__name__}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise WireError(f"{path}: expected an integer, got {type(value).__name__}")
        return value
    if not isinstance(value, hint) and not (hint is bytes and type(value) is memoryview):  # a blob's view
        raise WireError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def _check_array(value: Any, dtype: np.dtype, path: str) -> np.ndarray:
    """An array field's value as a 1-D array: a packed array of ``dtype`` as it is (an int32 one also for a
    float64 field), or a plain msgpack list of integers (int32 field) / numbers (float64 field) converted.

    Raises:
        WireError: anything else (a float array or float item for an int32 field, a bool, a string, a map).
    """
    if type(value) is np.ndarray:
        if value.dtype == dtype:
            return value
        if dtype == FLOAT64 and value.dtype == INT32:
            return value.astype(FLOAT64)
        raise WireError(f"{path}: expected a packed {dtype.name} array, got a {value.dtype.name} array")
    if not isinstance(value, list):
        raise WireError(f"{path}: expected a packed {dtype.name} array or a list, got {type(value).__name__}")
    item = int if dtype == INT32 else float
    if not _all_of_type(value, item):
        value = [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    try:
        return int_array(value) if dtype == INT32 else float_array(value)
    except (TypeError, OverflowError) as e:  # integers past 64 bits
        raise WireError(f"{path}: {e}") from None


def _all_of_type(values: list, hint: Any) -> bool:
    """True when every item of ``values`` is exactly of the primitive type ``hint`` (so `_check` would return it
    unchanged); False means "check item by item" (which converts ints to floats or raises the precise error)."""
    if hint is bytes:  # a blob decodes to a read-only memoryview of its frame (see `_check_scalar`)
        return all(type(v) is bytes or type(v) is memoryview for v in values)
    if hint in (int, float, str, bool):
        return all(type(v) is hint for v in values)
    return False
