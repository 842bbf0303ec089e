"""The metrics we implement ourselves (fast, no separate environment): the general ones the built-in tasks use,
with the semantics of OSWorld's desktop_env/evaluators/metrics/general.py. Every other OSWorld metric runs
OSWorld's own code (actors.osworld.metrics). Signature: ``(result, [expected], **options) -> float`` in [0, 1].
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any


class MetricOptionError(ValueError):
    """A metric's options are invalid (e.g. literal_match with an unknown type)."""



def exact_match(result: Any, rules: dict) -> float:
    """1.0 iff result == rules["expected"]."""
    return float(result == rules["expected"])


def check_include_exclude(result: Any, rules: dict) -> float:
    """1.0 iff every rules["include"] item is in result and no rules["exclude"] item is; 0.0 for None."""
    if result is None:
        return 0.0
    include, exclude = rules.get("include", []), rules.get("exclude", [])
    return float(all(r in result for r in include) and all(r not in result for r in exclude))


def is_in_list(result: Any, rules: dict) -> float:
    """1.0 iff rules["expected"] is in result."""
    return float(result is not None and rules["expected"] in result)


def literal_match(result: Any, expected: Any, **options: Any) -> float:
    """String (or list of strings) equality; options ``type`` ("str"|"list"), ``ignore_case``."""
    norm = (lambda s: str(s).lower()) if options.get("ignore_case", False) else str
    kind = options.get("type", "str")
    if kind == "str":
        return float(norm(result) == norm(expected))
    if kind == "list":
        if not isinstance(result, (list, tuple)) or not isinstance(expected, (list, tuple)):
            return 0.0
        return float([norm(s) for s in result] == [norm(s) for s in expected])
    raise MetricOptionError(f"literal_match: unknown type {kind!r}")


def fuzzy_match(result: Any, rules: dict) -> float:
    """Similarity in [0, 1] of result and rules["expected"] (difflib ratio; OSWorld uses rapidfuzz's
    fuzz.ratio / 100, which agrees on identical and disjoint strings and is close in between)."""
    if result is None:
        return 0.0
    return difflib.SequenceMatcher(a=str(result), b=str(rules["expected"])).ratio()


def _read_text(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def file_contains(file_path: str | None, config: dict) -> float:
    """1.0 iff the file exists and contains every string in config["expected"] (a string or a list)."""
    text = _read_text(file_path)
    if text is None:
        return 0.0
    expected = config["expected"]
    expected = [expected] if isinstance(expected, str) else expected
    return float(all(e in text for e in expected))


def check_list(result: str | None, rules: dict) -> float:
    """File at ``result``: every regex in rules["expect"] matches some line, none in rules["unexpect"] does."""
    text = _read_text(result)
    if text is None:
        return 0.0
    lines = text.splitlines()
    expect = [re.compile(p) for p in rules.get("expect", [])]
    unexpect = [re.compile(p) for p in rules.get("unexpect", [])]
    ok = all(any(p.search(line) for line in lines) for p in expect)
    return float(ok and not any(p.search(line) for p in unexpect for line in lines))


def diff_text_file(result: str | None, expect: str | None) -> float:
    """Line-level difflib ratio of two files; 0.0 when the result file is missing."""
    a, b = _read_text(result), _read_text(expect)
    if a is None or b is None:
        return 0.0
    return difflib.SequenceMatcher(a=a.splitlines(), b=b.splitlines()).ratio()


def compare_text_file(file1: str | None, file2: str | None, **options: Any) -> float:
    """1.0 iff the two files' texts are equal (options ``ignore_blanks``: collapse whitespace;
    ``ignore_case``)."""
    a, b = _read_text(file1), _read_text(file2)
    if a is None or b is None:
        return 0.0
    if options.get("ignore_blanks", False):
        a, b = re.sub(r"\s+", " ", a).strip(), re.sub(r"\s+", " ", b).strip()
    if options.get("ignore_case", False):
        a, b = a.lower(), b.lower()
    return float(a == b)


NATIVE_METRICS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "check_include_exclude": check_include_exclude,
    "is_in_list": is_in_list,
    "literal_match": literal_match,
    "fuzzy_match": fuzzy_match,
    "file_contains": file_contains,
    "check_list": check_list,
    "diff_text_file": diff_text_file,
    "compare_text_file": compare_text_file,
}
"""Metric name -> our implementation."""
