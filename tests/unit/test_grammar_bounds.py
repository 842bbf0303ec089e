"""The grammar backend's bounds (issue 39 item 8): a grammar text over MAX_GRAMMAR_CHARS is refused before it is
compiled, a compile that takes longer than its timeout is refused (and its text refused at once afterwards, without
a second compile), and the compiled grammars kept are the CACHE_SIZE most recently used."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from arpo_async import grammar
from arpo_async.grammar import GrammarBackend, GrammarError, GrammarSpec


@pytest.fixture(scope="module")
def backend(tiny_model) -> GrammarBackend:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_a_grammar_over_the_cap_is_refused_before_it_is_compiled(backend):
    text = "a" * (grammar.MAX_GRAMMAR_CHARS + 1)
    with pytest.raises(GrammarError, match=f"more than the {grammar.MAX_GRAMMAR_CHARS}"):
        backend.compile(GrammarSpec(regex=text))
    assert ("regex", text) not in backend._pending and ("regex", text) not in backend._refused  # never queued
    assert backend.compile(GrammarSpec(regex="a" * 100)) is backend.compile(GrammarSpec(regex="a" * 100))  # cached


def test_a_compile_past_its_timeout_is_refused_and_never_tried_twice(backend):
    spec = GrammarSpec(regex="(" + "|".join(f"slow{i:05d}" for i in range(1500)) + ")")
    with pytest.raises(GrammarError, match="did not compile within"):
        backend.compile(spec, timeout_s=0.0)
    with pytest.raises(GrammarError, match="did not compile within"):
        backend.compile(spec)  # refused at once, whatever the timeout
    assert backend.compile(GrammarSpec(regex="(yes|no)")) is not None  # the compile thread is free again


def test_the_cache_keeps_the_most_recently_used(backend, monkeypatch):
    monkeypatch.setattr(grammar, "CACHE_SIZE", 3)
    first = backend.compile(GrammarSpec(regex="first"))
    for i in range(3):
        backend.compile(GrammarSpec(regex=f"other{i}"))
    assert len(backend._cache) == 3 and ("regex", "first") not in backend._cache
    assert backend.compile(GrammarSpec(regex="first")) is not first  # compiled again, not kept
