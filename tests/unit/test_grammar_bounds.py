"""The grammar backend's bounds (issue 39 item 8, issue 48 item 3): a grammar text over MAX_GRAMMAR_CHARS is refused
before it is compiled; a compile that outlasts its request's wait answers GrammarBusy and is served when asked again
(never refused for being slow); an invalid grammar is remembered as refused; the compiled grammars kept are the
cache_size most recently used plus the pinned ones; and one client's compiles are bounded while another client's
grammar is compiled in turn."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from arpo_async import grammar
from arpo_async.grammar import GrammarBackend, GrammarBusy, GrammarError, GrammarSpec


def slow_regex(n: int, tag: str) -> str:
    """A regex of about 11 n characters whose compile takes seconds on the tiny tokenizer (0.7 s for n=60, 2 s for
    n=100 on one core: ambiguous runs of letters); ``tag`` makes it distinct."""
    return "".join(f"[a-z]{{1,{i}}}" for i in range(1, n)) + tag


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def test_a_grammar_over_the_cap_is_refused_before_it_is_compiled(backend):
    text = "a" * (grammar.MAX_GRAMMAR_CHARS + 1)
    with pytest.raises(GrammarError, match=f"more than the {grammar.MAX_GRAMMAR_CHARS}"):
        backend.compile(GrammarSpec(regex=text))
    assert backend._queue.held("") == 0 and ("regex", text) not in backend._refused  # never queued
    assert backend.compile(GrammarSpec(regex="a" * 100)) is backend.compile(GrammarSpec(regex="a" * 100))  # cached


def test_a_compile_past_its_wait_is_busy_and_served_when_asked_again(backend):
    """b190f2c refused such a grammar from then on (HTTP 400 until restart): the action grammar, timed out behind a
    flood, stopped every actor. Now the compile goes on and its result is kept."""
    spec = GrammarSpec(regex=slow_regex(40, "late"))
    with pytest.raises(GrammarBusy, match="did not compile within") as busy:
        backend.compile(spec, timeout_s=0.0)
    assert busy.value.retry_after_s > 0
    compiled = backend.compile(spec, timeout_s=120.0)  # asked again: the same compile, not a refusal
    assert compiled is backend.compile(spec, timeout_s=0.0)  # and kept


def test_an_invalid_grammar_is_remembered_as_refused(backend):
    spec = GrammarSpec(regex="(unclosed")
    with pytest.raises(GrammarError, match="invalid regex") as first:
        backend.compile(spec)
    assert not isinstance(first.value, GrammarBusy)
    with pytest.raises(GrammarError, match="invalid regex"):
        backend.compile(spec, timeout_s=0.0)  # refused at once: never queued again
    assert len(backend._queue) == 0


def test_the_cache_keeps_the_most_recently_used(tokenizer):
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=3, pin_after=100)
    first = backend.compile(GrammarSpec(regex="first"))
    for i in range(3):
        backend.compile(GrammarSpec(regex=f"other{i}"))
    assert ("regex", "first") not in backend._cache
    assert backend.compile(GrammarSpec(regex="first")) is not first  # compiled again, not kept


def test_a_grammar_asked_often_stays_compiled_through_a_flood_of_others(tokenizer):
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=3, pin_after=3)
    run = GrammarSpec(regex="(yes|no)")
    first = backend.compile(run)
    backend.compile(run)
    backend.compile(run)
    for i in range(20):
        backend.compile(GrammarSpec(regex=f"flood{i}"))
    assert backend.compile(run, timeout_s=0.0) is first  # pinned: never compiled again


def test_one_clients_compiles_are_bounded_and_another_clients_grammar_is_compiled_in_turn(tokenizer):
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], per_client=2)
    for i in range(2):  # each takes about 2 s: both still pending when the third comes
        with pytest.raises(GrammarBusy, match="did not compile within"):
            backend.compile(GrammarSpec(regex=slow_regex(100, f"flood{i}")), timeout_s=0.0, client="10.0.0.9")
    with pytest.raises(GrammarBusy, match=r"already has 2 grammars waiting to compile") as busy:
        backend.compile(GrammarSpec(regex=slow_regex(100, "flood2")), timeout_s=0.0, client="10.0.0.9")
    assert busy.value.retry_after_s > 0
    assert backend.compile(GrammarSpec(regex="(left|right)"), timeout_s=120.0, client="10.0.0.7") is not None
    assert backend._queue.held("10.0.0.9") <= 1  # served after at most one flood compile (in turn), not both
