"""The run config described key by key: name, type, value, default and docstring (`arpo config show`).

Role: make every config key discoverable from the command line. The docstrings are the attribute docstrings of
arpo_async.config's dataclasses (the string literal right after each field), read from each class's source with
`ast` (wherever the class is declared: arpo_async.config_sections, arpo_async.config_learner), so the documentation
lives in one place, next to the field.
Invariants: `describe` lists every field of every section, in declaration order; `render_toml` writes TOML that
`load_config` reads back to the same config, each key preceded by its docstring as comments.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from arpo_async.config import SECTION_TYPES, RunConfig, toml_value

SECTIONS: tuple[str, ...] = tuple(SECTION_TYPES)
"""The config sections (TOML tables) in declaration order, e.g. "learner"; top-level keys have section ""."""


@dataclass(frozen=True)
class KeyDoc:
    """One config key: ``section`` ("" for top-level keys such as run_dir), ``name``, the type as written in
    its class, the current ``value``, the dataclass ``default`` and the field's attribute ``doc`` ("" if none)."""

    section: str
    name: str
    type: str
    value: Any
    default: Any
    doc: str

    @property
    def key(self) -> str:
        """The dotted name ``--set`` takes, e.g. "learner.lr" or "run_dir"."""
        return f"{self.section}.{self.name}" if self.section else self.name


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field name: attribute docstring}`` of a dataclass, read from its source with `ast`: the string literal
    statement right after an annotated assignment (PEP 257's attribute docstrings, as Sphinx reads them). Fields
    without one are absent. Text is dedented (`inspect.cleandoc`).

    Raises:
        TypeError: ``cls`` is not a class whose source `inspect` can read.
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs: dict[str, str] = {}
    for stmt, after in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def section_doc(section: str) -> str:
    """The class docstring of a section's dataclass (``""``: RunConfig's). Raises KeyError for an unknown one."""
    cls = RunConfig if section == "" else SECTION_TYPES[_known(section)]
    return inspect.cleandoc(cls.__doc__ or "")


def describe(config: RunConfig | None = None) -> list[KeyDoc]:
    """Every key of ``config`` (default: the defaults), top-level keys first, then each section's in order."""
    config = config or RunConfig()
    defaults = RunConfig()
    keys = _keys(RunConfig, "", config, defaults)
    for section in SECTIONS:
        keys += _keys(type(getattr(defaults, section)), section, getattr(config, section), getattr(defaults, section))
    return keys


def render_toml(config: RunConfig | None = None, width: int = 110,
                sections: typing.Collection[str] | None = None) -> str:
    """The whole config as commented TOML: each section's docstring, then per key its docstring as ``#`` lines
    wrapped at ``width`` characters and ``key = value  # (default)``, or ``# default: X`` after a value that
    differs from its default. ``sections``: only these ("" = the top-level keys; default all). `load_config` reads
    the text back to ``config``.

    Raises:
        KeyError: a name in ``sections`` is no config section.
    """
    wanted = None if sections is None else {s if s == "" else _known(s) for s in sections}
    out: list[str] = []
    current = None
    for key in describe(config):
        if wanted is not None and key.section not in wanted:
            continue
        if key.section != current:
            current = key.section
            if current:
                out += ["", f"[{current}]"]
            out += _comment(section_doc(current), width) + [""]
        out += _comment(key.doc or "(no docstring)", width)
        default = "(default)" if key.value == key.default else f"default: {toml_value(key.default)}"
        out += [f"{key.name} = {toml_value(key.value)}  # {default}", ""]
    return "\n".join(out).strip() + "\n"


def add_config_arguments(parser: argparse.ArgumentParser, reads: typing.Sequence[str]) -> argparse.ArgumentParser:
    """Give a command the run-file flags every arpo process takes, ``--config FILE`` (args.config, a Path or
    None) and repeatable ``--set KEY=VALUE`` (args.overrides, a list of str), and an epilog in its ``--help``
    naming the config sections it reads (``reads``: "" for the top-level keys, else names in `SECTIONS`) and
    pointing to ``arpo config show``. Returns ``parser``; ``arpo_async.config.load_config(args.config,
    args.overrides)`` builds the config.

    Raises:
        KeyError: a name in ``reads`` is no config section.
    """
    names = ", ".join("top-level keys (run_dir, model, run_id)" if s == "" else f"[{_known(s)}]" for s in reads)
    parser.add_argument("--config", type=Path, metavar="FILE",
                        help="run TOML file (examples/run-default.toml, examples/run-multihost.toml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set learner.lr=1e-3 (repeatable; wins over --config)")
    parser.epilog = (f"Config: reads the run file's {names}. Every key with its value, default and meaning: "
                     "`arpo config show [--config FILE] [--set KEY=VALUE ...]`.")
    return parser


def _keys(cls: type, section: str, values: Any, defaults: Any) -> list[KeyDoc]:
    docs = field_docs(cls)
    return [KeyDoc(section, f.name, str(f.type), _plain(getattr(values, f.name)), _plain(getattr(defaults, f.name)),
                   docs.get(f.name, ""))
            for f in dataclasses.fields(cls) if section or f.name not in SECTIONS]  # actors.actors is a key


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _comment(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for paragraph in text.splitlines() or [""]:
        lines += textwrap.wrap(paragraph, width - 2, break_on_hyphens=False) or [""]
    return [f"# {line}".rstrip() for line in lines]


def _known(section: str) -> str:
    if section not in SECTIONS:
        raise KeyError(f"unknown config section {section!r}; known: {sorted(SECTIONS)}")
    return section

