"""Outside text made encodable where it enters (arpo_async.text): a lone surrogate that JSON spells must never make
a message unencodable."""

import msgpack
import pytest

from arpo_async.text import encodable, encodable_json, loads_json


def test_a_lone_surrogate_becomes_its_escape_and_clean_text_is_kept_as_it_is():
    assert encodable("ok \u00e9\u4e2d") == "ok \u00e9\u4e2d"
    text = "ascii"
    assert encodable(text) is text
    assert encodable("a\ud800b\udfff") == "a\\ud800b\\udfff"
    assert encodable("a\ud800b").encode("utf-8") == b"a\\ud800b"


def test_every_string_of_a_parsed_answer_keys_included_can_be_packed():
    answer = loads_json('{"output": "x\\ud800", "k\\udfff": ["\\ud83d", {"deep": "\\udc00y"}], "n": 5, "f": 1.5}')
    assert answer == {"output": "x\\ud800", "k\\udfff": ["\\ud83d", {"deep": "\\udc00y"}], "n": 5, "f": 1.5}
    msgpack.packb(answer)  # raised UnicodeEncodeError before
    assert loads_json('"\\ud83d\\ude00"') == "\U0001F600"  # a proper pair is one character, untouched


def test_a_deep_answer_is_walked_without_recursion():
    depth = 50_000
    value = encodable_json(_nested(depth))
    node = value
    for _ in range(depth):
        node = node[0]
    assert node == "\\ud800"


def _nested(depth: int) -> list:
    root = node = []
    for _ in range(depth - 1):
        child: list = []
        node.append(child)
        node = child
    node.append("\ud800")
    return root


def test_json_that_does_not_parse_raises_as_json_loads_does():
    with pytest.raises(ValueError):
        loads_json("{")
    with pytest.raises(ValueError):
        loads_json(b"\xff")
