"""The reference pages of the docs site, generated from the code: docs/reference/config.md, metrics.md and cli.md.

Role: every config key (the dataclasses of arpo_async.config, with the field docstrings arpo_async.config_doc reads
for `arpo config show`), every metrics.jsonl field (arpo_async.metric_fields) and every command of `arpo` and of
the process entry points (their argparse parsers) as Markdown, so the pages cannot say what the code does not.
Run ``python -m arpo_cli.reference_docs`` to write the pages, ``python -m arpo_cli.reference_docs --check`` to
exit 1 when a page on disk differs from what the code generates (tests/unit/test_reference_docs.py does the same).
Invariants: the output depends on the code only: no date, no machine path, host name, process id or environment
variable, and no terminal width (usage lines are formatted here, not by argparse's width-dependent formatter).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any, Iterator

import annotated_types
from pydantic.fields import FieldInfo

from arpo_async.config import SECTION_TYPES, RunConfig, toml_value
from arpo_async.config_doc import SECTIONS, describe, section_doc
from arpo_async.metric_fields import METRIC_FIELDS, WHEN

ROOT = Path(__file__).resolve().parents[1]
"""The repository (the clone this module runs from): its docs/ and pyproject.toml."""
DOCS = ROOT / "docs"
REGENERATE = "python -m arpo_cli.reference_docs"
"""The command that rewrites the pages (run from the repository root)."""
GENERATED = f"<!-- Generated from the code by `{REGENERATE}`; do not edit by hand. -->"

MACHINE_DEFAULTS: dict[tuple[str, str], str] = {
    ("arpo-actors", "actor_id"): "host-pid of this process",
    ("arpo-serve", "api_key"): "$ARPO_API_KEY when set",
    ("arpo-serve", "admin_api_key"): "$ARPO_ADMIN_API_KEY when set",
}
"""Defaults computed on the machine that builds the parser ((prog, dest) -> how the page describes them): the page
never shows the builder's host name, process id or environment."""


def pages() -> dict[Path, str]:
    """``{path relative to docs/: Markdown}`` of every generated page."""
    return {Path("reference/config.md"): config_page(), Path("reference/metrics.md"): metrics_page(),
            Path("reference/cli.md"): cli_page()}


# ---------------------------------------------------------------------------------------------------------- config


def config_page() -> str:
    """The config reference: per section (top-level keys, then each of arpo_async.config.SECTION_TYPES in order)
    its docstring and a table of key, type (with bounds and choices), default and the field's docstring."""
    keys = describe()
    out = ["# Config reference", "", GENERATED, "",
           "Every key of the run file (TOML), by section. A run reads it with `--config FILE`; `--set KEY=VALUE` "
           "overrides one key (dotted, e.g. `--set learner.lr=1e-3`). `arpo config show [--config FILE] "
           "[--set KEY=VALUE ...]` prints the same keys with their current values as a run file. An unknown key or "
           "a value of the wrong type or out of bounds is an error naming the key.", "",
           "Sections: " + ", ".join(f"[{_section_title(s)}](#{_section_anchor(s)})" for s in ("", *SECTIONS)) + ".",
           ""]
    for section in ("", *SECTIONS):
        cls = RunConfig if section == "" else SECTION_TYPES[section]
        hints = typing.get_type_hints(cls, include_extras=True)
        out += [f"## {_section_heading(section)}", "", _md(section_doc(section)), "",
                "| Key | Type | Default | Description |", "| --- | --- | --- | --- |"]
        for key in (k for k in keys if k.section == section):
            out.append(f"| <a id=\"{key.key}\"></a>`{key.name}` | {_md(type_text(hints[key.name]))} | "
                       f"{_code(toml_value(key.default))} | {_md(key.doc or '(no docstring)')} |")
        out.append("")
    return "\n".join(out)


def type_text(hint: Any) -> str:
    """A config field's type in words from its resolved annotation: the base type (``int``, ``float``, ``str``,
    ``bool``, ``list of str``; a Literal as its choices) and its bounds (``int >= 1``, ``float in (0, 1]``,
    ``finite``, ``at least 1 item``) as pydantic checks them."""
    if typing.get_origin(hint) is typing.Annotated:
        base, *metadata = typing.get_args(hint)
        bounds: dict[str, Any] = {}
        extra: list[str] = []
        for item in metadata:
            for constraint in (item.metadata if isinstance(item, FieldInfo) else [item]):
                for name in ("gt", "ge", "lt", "le"):
                    if getattr(constraint, name, None) is not None and not isinstance(constraint, FieldInfo):
                        bounds[name] = getattr(constraint, name)
                if isinstance(constraint, annotated_types.MinLen):
                    extra.append(f"at least {constraint.min_length} item" + ("s" if constraint.min_length > 1 else ""))
                if getattr(constraint, "allow_inf_nan", None) is False:
                    extra.append("finite")
        return ", ".join([type_text(base) + _bounds(bounds), *extra])
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(f"`{toml_value(v)}`" for v in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"list of {type_text(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def _bounds(b: dict[str, Any]) -> str:
    low = ("(", b["gt"]) if "gt" in b else ("[", b["ge"]) if "ge" in b else None
    high = (")", b["lt"]) if "lt" in b else ("]", b["le"]) if "le" in b else None
    if low and high:
        return f" in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f" {'>' if low[0] == '(' else '>='} {low[1]}"
    if high:
        return f" {'<' if high[0] == ')' else '<='} {high[1]}"
    return ""


def _section_title(section: str) -> str:
    return "top-level keys" if section == "" else f"`[{section}]`"


def _section_heading(section: str) -> str:
    return "Top-level keys" if section == "" else f"`[{section}]`"


def _section_anchor(section: str) -> str:
    return "top-level-keys" if section == "" else section


# --------------------------------------------------------------------------------------------------------- metrics


def metrics_page() -> str:
    """The metrics reference: every field of arpo_async.metric_fields, grouped by which records carry it."""
    out = ["# Metrics reference", "", GENERATED, "",
           "The learner appends one JSON object per trained batch to `<run_dir>/metrics.jsonl` (one line each, "
           "flushed as written). A run that stops before `learner.steps` because every task is solved ends with "
           "one more, the evaluation record: `step`, `policy_version` and `wall_s` of its final weights and the "
           "`eval_*` fields of the held-out round on them, no training field (a reader of training fields skips "
           "it: `arpo_async.metrics.training_records`). With `learner.tensorboard` on, every number of a record "
           "is also a TensorBoard scalar in `<run_dir>/tb/` at `global_step = step`, nested keys joined with `/` (`drops/stale`); "
           "booleans, strings, lists and nulls are left out. With `learner.wandb_project` set, the same numbers go "
           "to Weights & Biases at the same step. A value that is not a finite number is written as `null`. "
           "`arpo curve` and `arpo view` draw curves from this file.", ""]
    for when, text in WHEN.items():
        fields = [(key, f) for key, f in METRIC_FIELDS.items() if f.when == when]
        if not fields:
            continue
        out += [f"## {_when_heading(when)}", "", f"Present in {_md(text)}.", "",
                "| Field | Description |", "| --- | --- |"]
        out += [f"| <a id=\"{key}\"></a>`{key}` | {_md(f.description)} |" for key, f in fields]
        out.append("")
    return "\n".join(out)


def _when_heading(when: str) -> str:
    return {"every": "Every trained batch", "pump": "Message counts", "loop": "Training-loop counters",
            "checkpoint": "Checkpoints", "resume": "Resumed runs", "eval": "Held-out evaluation"}.get(when, when)


# ------------------------------------------------------------------------------------------------------------- cli


def cli_page() -> str:
    """The CLI reference: every command and subcommand of `arpo` (arpo_cli.cli.build_parser), then each process
    entry point of pyproject's [project.scripts] (arpo-learner, arpo-actors, arpo-serve): usage, description,
    and a table of its arguments with their defaults and help."""
    from arpo_cli.cli import build_parser

    arpo = build_parser()
    commands = list(walk(arpo))
    scripts = {name: target for name, target in entry_points().items() if name != arpo.prog}
    out = ["# CLI reference", "", GENERATED, "",
           "Every command of `arpo`, and the processes it starts, with the arguments their parsers take. "
           "`arpo COMMAND --help` prints the same arguments.", "",
           "Commands: " + ", ".join(f"[`{p.prog}`](#{_anchor(p.prog)})" for p in commands[1:]) + ".", ""]
    for parser in commands:
        out += _parser_section(parser, _help_of(arpo, parser), "##")
    if scripts:
        out += ["## Process entry points", "",
                "Console scripts installed with the package ([project.scripts] in pyproject.toml). `arpo run` and "
                "`arpo launch` start them; run them by hand to place the processes yourself.", ""]
        for name, target in scripts.items():
            out += _parser_section(entry_point_parser(target), "", "###")
    return "\n".join(out)


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it, depth first, in the order they were added."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from walk(child)


def entry_points() -> dict[str, str]:
    """pyproject.toml's [project.scripts]: ``{script name: "module:function"}``; {} outside a clone."""
    path = ROOT / "pyproject.toml"
    if not path.is_file():
        return {}
    return dict(tomllib.loads(path.read_text(encoding="utf-8"))["project"].get("scripts", {}))


def entry_point_parser(target: str) -> argparse.ArgumentParser:
    """The argparse parser of a console script ``"module:function"``: the ``build_parser()`` of its module
    (each entry point's module has one, and its ``main`` parses with it).

    Raises:
        RuntimeError: the module has no ``build_parser``.
    """
    module = importlib.import_module(target.partition(":")[0])
    build = getattr(module, "build_parser", None)
    if build is None:
        raise RuntimeError(f"{target}: its module has no build_parser() to document")
    return build()


def _help_of(root: argparse.ArgumentParser, parser: argparse.ArgumentParser) -> str:
    """The one-line help a parent parser gives ``parser`` (its subcommand list's entry), or ""."""
    for candidate in walk(root):
        for action in candidate._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if action.choices.get(choice.dest) is parser:
                        return choice.help or ""
    return ""


def _parser_section(parser: argparse.ArgumentParser, summary: str, level: str) -> list[str]:
    out = [f"{level} `{parser.prog}`", ""]
    for text in dict.fromkeys(t for t in (summary, parser.description) if t):
        out += [_md(text), ""]
    out += ["```text", "usage: " + usage(parser), "```", ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += ["| Subcommand | Description |", "| --- | --- |"]
            out += [f"| [`{parser.prog} {c.dest}`](#{_anchor(f'{parser.prog} {c.dest}')}) | {_md(c.help or '')} |"
                    for c in action._choices_actions]
            out.append("")
    for group in parser._action_groups:
        rows = [a for a in group._group_actions
                if a.help is not argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction,
                                                                          argparse._SubParsersAction))]
        if not rows:
            continue
        title = {"positional arguments": "Arguments", "options": "Options",
                 "optional arguments": "Options"}.get(group.title or "", group.title or "")
        out += [f"**{_md(title)}**", "", "| Argument | Default | Description |", "| --- | --- | --- |"]
        out += [f"| {_code(_invocation(a))} | {_default(parser.prog, a)} | {_md(_help(parser, a))} |" for a in rows]
        out.append("")
    if parser.epilog:
        out += [_md(parser.epilog), ""]
    return out


def usage(parser: argparse.ArgumentParser) -> str:
    """``parser``'s usage on one line, options first as argparse orders them (``prog [-h] --out RUN_DIR
    [--steps STEPS] {a,b} ...``), formatted here so that it does not depend on the terminal's width or the Python
    version's argparse."""
    options, positionals = [], []
    for action in parser._actions:
        if action.help is argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            positionals.append("{" + ",".join(action.choices) + "} ...")
        elif not action.option_strings:
            positionals.append(_args(action))
        else:
            flag = _invocation(action, first_only=True)
            options.append(flag if action.required else f"[{flag}]")
    return " ".join([parser.prog, *options, *positionals])


def _invocation(action: argparse.Action, first_only: bool = False) -> str:
    if not action.option_strings:
        return _args(action)
    if isinstance(action, argparse.BooleanOptionalAction):
        return " | ".join(action.option_strings)
    if action.nargs == 0:
        return action.option_strings[0] if first_only else ", ".join(action.option_strings)
    flags = action.option_strings[:1] if first_only else action.option_strings
    return ", ".join(flags) + " " + _args(action)


def _args(action: argparse.Action) -> str:
    if action.metavar is not None:
        metavar = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    else:
        metavar = action.dest if not action.option_strings else action.dest.upper()
    nargs = action.nargs
    if nargs == "?":
        return f"[{metavar}]"
    if nargs == "*":
        return f"[{metavar} ...]"
    if nargs == "+":
        return f"{metavar} [{metavar} ...]"
    if isinstance(nargs, int):  # a tuple metavar names each argument already (argparse's usage line)
        return metavar if isinstance(action.metavar, tuple) else " ".join([metavar] * nargs)
    return metavar


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%" in text:
        params = {**vars(action), "prog": parser.prog}
        if params.get("choices") is not None:
            params["choices"] = ", ".join(str(c) for c in params["choices"])
        text = text % params
    notes = []
    if action.choices is not None and action.metavar is not None:
        notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.required and action.option_strings:
        notes.append("required")
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _default(prog: str, action: argparse.Action) -> str:
    if (prog, action.dest) in MACHINE_DEFAULTS:
        return _md(MACHINE_DEFAULTS[(prog, action.dest)])
    value = action.default
    if value is None or value is argparse.SUPPRESS or value is False or value == [] or not action.option_strings:
        return ""
    return _code(str(value))


def _anchor(heading: str) -> str:
    """The id MkDocs' toc gives a heading of this text (lower case, words joined by "-")."""
    return "-".join(re.sub(r"[^\w\s-]", "", heading).lower().split())


# -------------------------------------------------------------------------------------------------------- markdown


_CODE = re.compile(r"``(.+?)``|`([^`]+)`")


def _md(text: str) -> str:
    """``text`` (a docstring or help text) as one line of Markdown safe in a table cell: code spans (`x` or
    ``x``) kept as code, and outside them ``<`` (an HTML tag otherwise), ``|``, ``*`` and a word-boundary ``_``
    escaped."""
    out, last = [], 0
    flat = " ".join(text.split())
    for match in _CODE.finditer(flat):
        out.append(_escape(flat[last:match.start()]))
        out.append(_code(match.group(1) or match.group(2)))
        last = match.end()
    out.append(_escape(flat[last:]))
    return "".join(out)


def _escape(text: str) -> str:
    text = text.replace("<", "&lt;")
    text = text.replace("|", "\\|").replace("*", "\\*")
    return re.sub(r"(?<!\w)_|_(?!\w)", r"\\_", text)


def _code(text: str) -> str:
    """``text`` as an inline code span. A ``|`` in it stays as it is: Python-Markdown's tables (MkDocs) split no
    cell inside a code span, and would show a backslash before it."""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}" if text else '`""`'


# ------------------------------------------------------------------------------------------------------------ main


def stale_pages(docs: Path = DOCS) -> list[Path]:
    """The generated pages whose file under ``docs`` is missing or differs from what the code generates now."""
    return [path for path, text in pages().items()
            if not (docs / path).is_file() or (docs / path).read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    """``python -m arpo_cli.reference_docs [--check] [--docs DIR]``: write the pages (0), or with --check list the
    pages that differ and exit 1 (0 when all are current)."""
    parser = argparse.ArgumentParser(prog="python -m arpo_cli.reference_docs",
                                     description="Write docs/reference/*.md from the code (config classes, metric "
                                                 "fields, CLI parsers).")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a page differs from what the code generates")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the docs folder (default: this clone's docs/)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages(args.docs)
        for path in stale:
            print(f"{args.docs / path}: differs from what the code generates", file=sys.stderr)
        if stale:
            print(f"regenerate with `{REGENERATE}` (from the repository root) and commit the pages",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages().items():
        (args.docs / path).parent.mkdir(parents=True, exist_ok=True)
        (args.docs / path).write_text(text, encoding="utf-8")
        print(args.docs / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
