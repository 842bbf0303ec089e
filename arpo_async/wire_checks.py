"""The codec's checks of a received message body: each field's wire value against the message's type hints.

:func:`message_from_body` turns the body of a decoded header (msgpack already unpacked by :mod:`arpo_async.codec`,
its ext types already NumPy views and blob views) into the message dataclass, checking every field against its type
hint: plain types exactly, a string enum to one of its members, an array field to a 1-D array of its dtype (a packed
array as it is, a plain msgpack list item by item), a list of dataclasses from its table of columns (schema 2) or
its list of maps (schema 1), at most :data:`MAX_TABLE_ROWS` rows. Anything else raises :class:`WireError` naming
the field's path, never another exception. The per-class dispatch is resolved once per dataclass and cached: a
wire value that already has the field's type costs one ``type()`` check.

It also holds what the codec's encoder shares with it: the resolved type hints of a message dataclass
(:func:`type_hints`), an array field's dtype (:func:`array_dtype`) and a string enum's member
(:func:`enum_member`). It never calls msgpack.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import typing
from typing import Any, Callable

import numpy as np

from arpo_async.messages import FLOAT64, INT32, float_array, int_array

MAX_TABLE_ROWS = 4096
"""Most rows of a table (a trajectory's steps), checked from the table's row count before any row is built; the
learner's validation then caps a trajectory at 512 steps (arpo_async.validation.Limits.max_steps)."""


class WireError(ValueError):
    """A message that cannot be decoded or encoded: too large, malformed, unknown type, wrong field types."""


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """Resolved type hints of a message dataclass, ``Annotated`` kept (an array field's dtype)."""
    return typing.get_type_hints(cls, include_extras=True)


def array_dtype(hint: Any) -> np.dtype | None:
    """The dtype of an array field's hint (``Annotated[np.ndarray, dtype]``; int32 for ``list[int]``), or None."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated and args[0] is np.ndarray:
        return args[1]
    return INT32 if origin is list and args == (int,) else None


_Decoder = Callable[[Any, str], Any]
"""(wire value, path) -> the checked field value; raises WireError naming ``path``."""


_PLAIN = (str, int, float, bool, bytes)
"""Field types whose wire value is used as it is when it has exactly that type."""


@functools.cache
def _fields(cls: type) -> tuple[tuple[tuple[str, _Decoder, type | None, np.dtype | None, np.dtype | None], ...],
                                frozenset[str]]:
    """Per message dataclass, once: each field's (name, decoder, plain type or None, packed dtype or None, array
    dtype of its table column or None), and the names of the required ones. Resolving type hints per field costs
    far more than checking the value, so the dispatch is done here. A wire value of the plain type, or for an array
    field a packed array of its dtype (what the codec's ext hook made), is the field's value as it is."""
    hints = type_hints(cls)
    fields = tuple((f.name, _decoder(hints[f.name]), hints[f.name] if hints[f.name] in _PLAIN else None,
                    _packed_dtype(hints[f.name]), array_dtype(hints[f.name]))
                   for f in dataclasses.fields(cls))
    required = frozenset(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    return fields, required


def _packed_dtype(hint: Any) -> np.dtype | None:
    """The dtype of an array field (``Annotated[np.ndarray, dtype]``), or None (an integer list decodes to a list)."""
    return array_dtype(hint) if typing.get_origin(hint) is not list else None


def enum_member(hint: type[enum.StrEnum], value: Any, path: str) -> enum.StrEnum:
    """``value`` as a member of the string enum ``hint`` (a member, or a string naming one)."""
    if not isinstance(value, str):
        raise WireError(f"{path}: expected str, got {type(value).__name__}")
    try:
        return hint(value)
    except ValueError:
        raise WireError(f"{path}: {value[:40]!r} is not a {hint.__name__} (one of {[m.value for m in hint]})") from None


def message_from_body(cls: type, data: Any, path: str) -> Any:
    """The message dataclass ``cls`` built from its decoded body ``data`` (a map of field name to wire value), each
    field checked against its type hint; ``path`` names the message in errors (``path.field[i]...``).

    Raises:
        WireError: not a map; an unknown or missing field; a value that does not fit its field; a value the
            dataclass's ``__post_init__`` refuses.
    """
    if not isinstance(data, dict):
        raise WireError(f"{path}: expected a map, got {type(data).__name__}")
    fields, required = _fields(cls)
    if len(data) > len(fields) or not required <= data.keys():
        unknown = set(data) - {field[0] for field in fields}
        if unknown:
            raise WireError(f"{path}: unknown field(s) {sorted(map(str, unknown))}")
        missing = next(field[0] for field in fields if field[0] in required and field[0] not in data)
        raise WireError(f"{path}: missing field {missing!r}")
    kwargs: dict[str, Any] = {}
    for name, decode_field, plain, packed, _ in fields:
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
        return lambda value, path: message_from_body(hint, value, path)
    dtype = array_dtype(hint)
    if dtype is not None and origin is not list:
        return lambda value, path: _check_array(value, dtype, path)
    if origin is list and dataclasses.is_dataclass(args[0]):
        return functools.partial(_check_table, cls=args[0])
    if origin is list:
        return functools.partial(_check_list, item=args[0], decode_item=_decoder(args[0]))
    if origin is dict or hint is dict:
        return functools.partial(_check_map, key_value=args)
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        return lambda value, path: enum_member(hint, value, path)
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
    """The rows of a table (as the codec's encoder writes it) as a list of ``cls``; each array column is split into
    read-only views of its values, one per row (no copy). A schema 1 list of maps (a checkpoint written before
    tables) is accepted too, each map checked as a single ``cls``.

    Raises:
        WireError: not ``[n, {field: column}]`` with n >= 0; an unknown or missing column; a column that does not
            hold n values; lengths that are negative or do not add up to the values; a value that does not fit its
            field (named ``path[i].field``).
    """
    if type(value) is list and all(type(row) is dict for row in value):  # schema 1: one map per row
        return [message_from_body(cls, row, f"{path}[{i}]") for i, row in enumerate(value)]
    if not (type(value) is list and len(value) == 2 and type(value[0]) is int and type(value[1]) is dict):
        raise WireError(f"{path}: expected a table [rows, {{field: column}}] of {cls.__name__}")
    n, columns = value
    if n > MAX_TABLE_ROWS:
        raise WireError(f"{path}: {n} rows, more than the {MAX_TABLE_ROWS} a table may hold")
    fields, required = _fields(cls)
    unknown = columns.keys() - {field[0] for field in fields}
    if unknown:
        raise WireError(f"{path}: unknown column(s) {sorted(map(str, unknown))}")
    if n < 0 or (n and not columns):
        raise WireError(f"{path}: {n} rows in {len(columns)} columns")
    names, cells = [], []
    for name, decode_field, plain, packed, dtype in fields:
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
