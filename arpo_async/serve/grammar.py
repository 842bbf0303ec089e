"""Constrained decoding for `arpo-serve`, via xgrammar (the grammar backend SGLang uses by default).

Role: compile SGLang's ``regex`` / ``ebnf`` / ``json_schema`` sampling parameters into xgrammar grammars (cached
per distinct spec), hand out one matcher per request, and turn matcher states into a token bitmask applied to a
batch of logits on the CPU. No hand-written masks.

Invariant: a matcher that reached the end of its grammar allows only the tokenizer's stop tokens
(<|im_end|>, <|endoftext|>), so a constrained request ends by sampling one of them and its output fully matches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import xgrammar as xgr


class GrammarError(ValueError):
    """A regex / EBNF / JSON schema that xgrammar cannot compile."""


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint from sampling_params; exactly one field is set."""

    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """Cache key: (kind, text)."""
        for kind in ("regex", "ebnf", "json_schema"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        raise GrammarError("empty grammar spec")


class GrammarBackend:
    """Compiles grammar specs for one tokenizer and applies their token bitmasks.

    Args:
        hf_tokenizer: a transformers tokenizer (xgrammar reads its vocabulary and decoder).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: tokens that end a completed grammar.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self._info)
        self._cache: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile (or fetch from cache). Raises GrammarError on an invalid spec."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        kind, text = key
        try:
            if kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(text)
            else:
                compiled = self._compiler.compile_json_schema(text)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {kind}: {e}") from e
        with self._lock:
            self._cache[key] = compiled
        return compiled

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        return xgr.GrammarMatcher(self.compile(spec))

    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Set to -inf, in place, every logit the row's matcher forbids. logits: [B, vocab_size] float32 CPU;
        rows whose matcher is None are left alone."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
