"""How a run-config section is declared and checked: the section decorator, the field types sections share, the
error every config problem raises and its wording.

Role: :func:`config_section` makes a class a frozen pydantic dataclass, validated strictly when built, and records
it under its TOML table name ("" for RunConfig's top-level keys), so that an unknown key in any section is answered
with the known keys of all of them (:func:`suggest_keys`). The sections themselves are declared in
arpo_async.config_sections and arpo_async.config_learner; arpo_async.config loads them from TOML.
Invariant: every validation error of a section is one :class:`ConfigError` that names each key as ``section.key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Annotated, Any

import pydantic.dataclasses
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

__all__ = ["MAX_SECONDS", "ConfigError", "Fraction", "Strings", "config_section", "dotted_keys", "section_types",
           "suggest_keys", "unknown_key"]


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the reason."""


def _as_tuple(value: Any) -> Any:
    """A TOML list becomes a tuple and a single value a 1-tuple (``--set actors.inference_urls=http://x``)."""
    return tuple(value) if isinstance(value, list) else value if isinstance(value, tuple) else (value,)


Strings = Annotated[tuple[str, ...], BeforeValidator(_as_tuple)]
"""A list of strings in TOML, a tuple here."""
Fraction = Annotated[float, Field(ge=0, le=1)]
"""A probability or fraction, in [0, 1]."""

MAX_SECONDS = 30 * 24 * 3600.0
"""The bound of every duration key (a name ending in ``_s``): at least 0 and at most 30 days. An infinite or
NaN number is refused for every float key."""

DECLARED: dict[str, type] = {}
"""Every class made by :func:`config_section`, by section name ("" = RunConfig, the root)."""

_TYPE_NAMES = {"int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str",
               "tuple_type": "a list"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


@typing.dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, Field))
def config_section(section: str) -> typing.Callable[[type], type]:
    """Make ``cls`` a frozen pydantic dataclass validated strictly when built, whose validation errors are raised as
    one :class:`ConfigError` naming each key as ``section.key`` (``section`` "" for RunConfig's top-level keys).
    It stays a dataclass: `dataclasses.fields`, `replace` (which validates again) and `asdict` work on it."""
    def make(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(cls, frozen=True,
                                             config=ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
        validate = cls.__init__
        durations = [f.name for f in dataclasses.fields(cls) if f.name.endswith("_s")]

        @functools.wraps(validate)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                validate(self, *args, **kwargs)
            except ValidationError as error:
                raise _config_error(error, section, cls) from error
            prefix = f"{section}." if section else ""
            problems = [f"{prefix}{name}: must be in [0, {MAX_SECONDS:,.0f}] seconds (30 days), got {value!r}"
                        for name in durations if not 0 <= (value := getattr(self, name)) <= MAX_SECONDS]
            if problems:
                raise ConfigError("; ".join(problems))

        cls.__init__ = __init__
        DECLARED[section] = cls
        return cls
    return make


def section_types() -> dict[str, type]:
    """The config sections (TOML tables) in the root's (RunConfig's) declaration order and their dataclasses; before
    the root is declared (a section module imported on its own), the sections declared so far."""
    if "" not in DECLARED:
        return {name: cls for name, cls in DECLARED.items() if name}
    return {name: hint for name, hint in typing.get_type_hints(DECLARED[""]).items() if dataclasses.is_dataclass(hint)}


def _config_error(error: ValidationError, section: str, cls: type) -> ConfigError:
    """One ConfigError for the ValidationError raised building ``cls``: each unknown key with the known key it
    probably meant (:func:`suggest_keys`), then every other problem as ``section.key: reason`` (a model validator's
    reason starts with its key)."""
    prefix = f"{section}." if section else ""
    problems = []
    for e in error.errors():
        if e["type"] == "unexpected_keyword_argument":
            problems.append(unknown_key(prefix + str(e["loc"][0]), is_section=isinstance(e["input"], dict)))
    for e in error.errors():
        if e["type"] != "unexpected_keyword_argument":
            key = ".".join(str(part) for part in e["loc"] if isinstance(part, str))  # without a list index
            problems.append(f"{prefix}{key}: {_reason(e)}" if key else prefix + _reason(e))
    return ConfigError("; ".join(problems))


def dotted_keys() -> list[str]:
    """Every key a run file or ``--set`` may name, in declaration order: the top-level keys (the section names
    among them, e.g. "learner"), then each section's keys as ``section.key`` (e.g. "learner.lr")."""
    keys = [f.name for f in dataclasses.fields(DECLARED[""])] if "" in DECLARED else []
    for name, cls in section_types().items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def suggest_keys(key: str, sections_only: bool = False) -> list[str]:
    """The known dotted keys an unknown ``key`` probably meant, best first (at most 3; [] when none is close).

    A key whose last part is a known key's name in another place is pointed there (``lr`` and ``actors.lr`` ->
    ``learner.lr``, ``learner.run_dir`` -> ``run_dir``); otherwise difflib's close matches (ratio >= 0.6) of the
    last part over the names of the same section's keys (``learner.lrr`` -> ``learner.lr``), then over every
    key's name (``lrr`` -> ``learner.lr``). ``sections_only``: ``key`` is a TOML table, so only section names are
    candidates (``lerner`` -> ``learner``).
    """
    if sections_only:
        return difflib.get_close_matches(key, list(section_types()), n=3)
    keys = [k for k in dotted_keys() if k not in section_types() and k != key]
    section, _, name = key.rpartition(".")
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    if same_name:
        return same_name
    here = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    close = difflib.get_close_matches(name, here, n=3)
    if close:
        return [f"{section}.{k}" if section else k for k in close]
    by_name: dict[str, list[str]] = {}
    for k in keys:
        by_name.setdefault(k.rpartition(".")[2], []).append(k)
    return [k for near in difflib.get_close_matches(name, list(by_name), n=3) for k in by_name[near]][:3]


def unknown_key(key: str, is_section: bool) -> str:
    """The message for one unknown key or section: what it probably meant, else where the known keys are listed."""
    kind = "section" if is_section else "key"
    near = suggest_keys(key, sections_only=is_section)
    if near:
        return f"unknown config {kind} {key!r}; did you mean {' or '.join(near)}?"
    section = key.rpartition(".")[0]
    where = f"arpo config show --section {section}" if section in section_types() else "arpo config show"
    return f"unknown config {kind} {key!r} (`{where}` lists the known keys)"


def _reason(e: ErrorDetails) -> str:
    """Why one value failed, in words like "must be >= 2, got 1" or "must be 'a' or 'b', got 'c'"."""
    kind, ctx, got = e["type"], e.get("ctx", {}), f", got {e['input']!r}"
    if kind in _TYPE_NAMES:
        return f"must be {_TYPE_NAMES[kind]}{got}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound:g}{got}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "too_short":
        return f"needs at least {ctx['min_length']} item(s)"
    if kind == "value_error":
        return str(ctx["error"])
    return f"{e['msg']}{got}"
