"""Run configuration: frozen dataclasses, loaded from one TOML file with CLI overrides.

Owns: the one description of a run that every process (learner, actors, arpo-serve, `arpo run`) reads; each key
is declared once, with its type, bounds, default and docstring.
Invariants: configs are immutable once built and validated when built, by pydantic from each field's type (strict:
a bool is no int, a str no number; an int is taken for a float, a list or a single value for a tuple) plus a
model validator for rules across fields; derived values are properties; a TOML key or override that names no
field is an error, never silently ignored. Every error, from `load_config` or from building a config directly
(``LearnerConfig(lr=0)``, ``dataclasses.replace``), is a :class:`ConfigError` naming the dotted key.

TOML layout (every section and key optional)::

    run_dir = "runs/demo"
    [transport]  endpoint = "tcp://127.0.0.1:5555"
    [learner]    group_size = 4   groups_per_step = 2   steps = 3   lr = 5e-4 ...
    [actors]     actors = 8   inference_urls = ["http://127.0.0.1:30000"] ...
    [serve]      port = 30000 ...
    [eval]       tasks = "grid4-test"   every_steps = 20   repeats = 2 ...
    [cluster]    servers = 1   learner_ranks = 2 ...   (read by `arpo launch` only)

CLI overrides use dotted keys: ``--set learner.lr=1e-3 --set actors.max_steps=5``; a value is read by its key's
type (a str key takes the text as written, ``--set run_id=2024``; any other a TOML value). An unknown key is
refused with the key it probably meant (``lr`` -> "did you mean learner.lr?"). A renamed key
(:data:`RENAMED_KEYS`) is still read under its old name, with one warning line naming the new one.
Every field needs an attribute docstring (the string right below it): `arpo config show` prints it as the key's
documentation (arpo_async.config_doc reads them from the classes' source) and tests/unit/test_config_show.py fails
without one.

Modules: the sections are declared in arpo_async.config_sections (the root RunConfig and every section but one)
and arpo_async.config_learner ([learner]), with the decorator, shared field types and error wording of
arpo_async.config_fields. This module loads them (TOML file, then overrides) and writes them back as TOML; it
re-exports the classes, ConfigError and SECTION_TYPES, so ``from arpo_async.config import X`` is the one import.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w

from arpo_async.config_fields import ConfigError, dotted_keys, suggest_keys, unknown_key
from arpo_async.config_learner import LearnerConfig
from arpo_async.config_sections import (SECTION_TYPES, ActorConfig, ClusterConfig, EvalConfig, RunConfig, ServeConfig,
                                        TransportConfig)

__all__ = ["RENAMED_KEYS", "SECTION_TYPES", "ActorConfig", "ClusterConfig", "ConfigError", "EvalConfig",
           "LearnerConfig", "RunConfig", "ServeConfig", "TransportConfig", "dotted_keys", "dump_toml", "load_config",
           "suggest_keys", "to_dict", "toml_value"]


log = logging.getLogger(__name__)

RENAMED_KEYS: dict[str, str] = {"learner.baseline_k": "learner.prepass_k",
                                "learner.baseline_min_success": "learner.prepass_min_success",
                                "learner.baseline_drop_solved": "learner.prepass_drop_solved"}
"""Old dotted key -> its new name. A config file or override with the old name is read as the new one, with a
warning; a file that gives both is refused. ARPO's task pre-pass was called the "baseline pass" here, a name that
reads as a value baseline (issue 52)."""


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> RunConfig:
    """Build a RunConfig from an optional TOML file plus ``section.key=value`` overrides.

    Raises:
        ConfigError: unreadable TOML, an unknown section or key, a value of the wrong type, a value that fails
            validation, or a key given under both its old and its new name (:data:`RENAMED_KEYS`). The message
            names the key.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"cannot read config {path}: not UTF-8 text (a binary file?): {e.reason} at byte "
                              f"{e.start}") from None
        except RecursionError:
            raise ConfigError(f"cannot read config {path}: nested too deeply") from None
        except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError is a ValueError
            raise ConfigError(f"cannot read config {path}: {e}") from e
        _rename_old_keys(data, f"config {path}")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key = key.strip()
        if key in RENAMED_KEYS:
            log.warning("override %s: the key is now called %s; read as %s", key, RENAMED_KEYS[key], RENAMED_KEYS[key])
            key = RENAMED_KEYS[key]
        _set_dotted(data, key, _parse_override(key, raw.strip()))
    known = {f.name for f in dataclasses.fields(RunConfig)}
    problems = [unknown_key(k, is_section=isinstance(v, dict)) for k, v in data.items() if k not in known]
    for name, cls in SECTION_TYPES.items():  # every section's problems at once, not the first section's only
        if name in data:
            if not isinstance(data[name], dict):
                problems.append(f"{name}: must be a table (section), got {data[name]!r}")
                continue
            try:
                data[name] = cls(**data[name])
            except ConfigError as e:
                problems.append(str(e))
    if problems:
        raise ConfigError("; ".join(problems))
    return RunConfig(**data)


def _rename_old_keys(data: dict[str, Any], source: str) -> None:
    """Move each old key of :data:`RENAMED_KEYS` in the parsed file ``data`` to its new name, with one warning
    line each (``source`` names the file).

    Raises:
        ConfigError: the file gives a key under both names (which one is meant is unclear).
    """
    for old, new in RENAMED_KEYS.items():
        section, _, old_name = old.rpartition(".")
        new_name = new.rpartition(".")[2]
        table = data.get(section) if section else data
        if not isinstance(table, dict) or old_name not in table:
            continue
        if new_name in table:
            raise ConfigError(f"{source}: both {old} and {new} are given; {old} is the old name of {new}, "
                              f"keep only {new}")
        log.warning("%s: %s is now called %s; read as %s (rename it in the file)", source, old, new, new)
        table[new_name] = table.pop(old_name)


def _parse_scalar(raw: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, lists, quoted strings), else keep the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except (ValueError, RecursionError):  # not TOML (TOMLDecodeError), or nested too deeply
        return raw


def _parse_override(key: str, raw: str) -> Any:
    """An override's value, parsed by the type of the field ``key`` names: for a str field (a Literal of strs
    included) the text itself, or the string it spells when quoted as TOML (``run_id=2024`` and
    ``run_id="2024"`` both give "2024"); for a list of strs the same, unless the text is a TOML list (one value
    becomes a 1-tuple); for any other field, or a key that names no field, the TOML value (:func:`_parse_scalar`).
    """
    value = _parse_scalar(raw)
    kind = _field_kind(key)
    if kind == "str" or (kind == "strs" and not isinstance(value, list)):
        return value if isinstance(value, str) else raw
    return value


def _field_kind(key: str) -> str:
    """"str" for a str field (or a Literal of strs), "strs" for a tuple of strs, "" for any other type or a key
    that names no field."""
    section, _, name = key.rpartition(".")
    cls = RunConfig if not section else SECTION_TYPES.get(section)
    hint = typing.get_type_hints(cls).get(name) if cls is not None else None
    if hint is str or (typing.get_origin(hint) is Literal and all(isinstance(a, str) for a in typing.get_args(hint))):
        return "str"
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[:1] == (str,):
        return "strs"
    return ""


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain TOML-compatible data (for the run folder and for child processes)."""
    return dataclasses.asdict(config)


def dump_toml(config: RunConfig) -> str:
    """Serialise a RunConfig as TOML (tomli_w) that `load_config` reads back to an equal config."""
    return tomli_w.dumps(to_dict(config))


def toml_value(value: Any) -> str:
    """One value as a TOML literal (bool, int, float, str, list/tuple of these), as tomli_w writes it.

    Raises:
        ConfigError: another type.
    """
    if isinstance(value, (list, tuple)):  # on one line, as `arpo config show` prints it
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    try:
        return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()
    except TypeError as error:
        raise ConfigError(f"cannot write {value!r} as TOML") from error
