"""The `arpo` command's argument parser: argparse's, with the two manners a mistyped command line needs.

- A mistyped choice (a subcommand such as `arpo rnu`, or a value of a flag with choices) is answered with the
  closest choice, "did you mean 'run'?" (difflib.get_close_matches, as Python 3.14's ``suggest_on_error`` does;
  the project supports 3.11, whose argparse has no such option).
- An unknown flag given to a subcommand (`arpo run --stesp 3`) is reported by that subcommand's parser, with its
  usage line and its closest flag, not by the top-level parser with the top-level usage (argparse collects a
  subparser's unknown arguments and lets the top-level parser complain about them).

Every such error exits 2, argparse's status for a usage error, which every `arpo` command also uses for a bad
config (arpo_cli.cli).
"""
from __future__ import annotations

import argparse
import difflib
from typing import Any, Sequence


def closest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate closest to ``word`` (difflib.get_close_matches, cutoff 0.6), or None when none is close."""
    found = difflib.get_close_matches(word, list(candidates), n=1)
    return found[0] if found else None


class ArpoParser(argparse.ArgumentParser):
    """An ArgumentParser whose choice errors suggest the closest choice and whose unknown arguments are reported
    by the subcommand that was given them (module docstring). Subparsers made by ``add_subparsers`` are of this
    class too (argparse uses the parent's class)."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse calls this for every value of an action with choices, subcommands included (3.11-3.13)
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError:
            choices = [str(c) for c in action.choices or ()]
            near = closest(str(value), choices)
            if near is None:
                raise
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean {near!r}? (choose from "
                                                 f"{', '.join(map(repr, choices))})") from None

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but unknown arguments are an error of the innermost subcommand given (its usage, its
        prog, exit 2), with the closest flag of that subcommand when one is close."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self.chosen_subcommand(parsed)
            chosen.error(chosen.unrecognized(extras))
        return parsed

    def chosen_subcommand(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the innermost subcommand ``namespace`` names (``self`` when it names none)."""
        parser: argparse.ArgumentParser = self
        while True:
            action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(namespace, action.dest, None) if action is not None else None
            if action is None or name not in action.choices:
                return parser
            parser = action.choices[name]

    def unrecognized(self, extras: list[str]) -> str:
        """argparse's "unrecognized arguments: ..." message, with the closest flag of this parser for the first
        unknown flag, if one is close."""
        message = f"unrecognized arguments: {' '.join(extras)}"
        flag = next((e.partition("=")[0] for e in extras if e.startswith("--")), None)
        near = closest(flag, [s for s in self._option_string_actions if s.startswith("--")]) if flag else None
        return f"{message}; did you mean {near}?" if near else message
