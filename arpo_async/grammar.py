"""Constrained decoding, via xgrammar (the grammar backend SGLang uses by default): `arpo-serve` samples under it
and the learner finds the tokens it forced (learner.algo.forced_tokens), so it lives in the shared package.

Role: compile SGLang's ``regex`` / ``ebnf`` / ``json_schema`` sampling parameters into xgrammar grammars (cached
per distinct spec), hand out one matcher per request, and turn matcher states into a token bitmask applied to a
batch of logits on the CPU. No hand-written masks.

Invariant: a matcher that reached the end of its grammar allows only the tokenizer's stop tokens
(<|im_end|>, <|endoftext|>), so a constrained request ends by sampling one of them and its output fully matches.

Forced text. Where the grammar admits exactly one continuation string (``Action: click(start_box='(`` after the
thought, ``,`` between coordinates, the closing ``)')``), nothing the policy does changes the reply's text. Two
helpers deal with it:

- ``forced_prefix_ids`` gives that text as its canonical token ids (the tokenizer's own encoding), which
  `arpo-serve` emits instead of sampling (``jump_forward``, as SGLang's former jump-forward decoding and
  xgrammar's ``find_jump_forward_string`` do), so a reply's fixed text is always the same token sequence;
- ``forced_token_mask`` marks, for any finished reply, the tokens that lie inside such text. The learner leaves
  them out of the loss: they are not the policy's choice. SGLang (0.5.x has no jump-forward) samples the same
  text token by token under the grammar mask and reports those tokens in ``output_ids`` and
  ``output_token_logprobs`` like any other, with nothing to tell them apart; arpo-serve reports its jumped tokens
  the same way. The mask is therefore computed from the tokens and the grammar alone, so both servers' replies
  are treated alike.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import xgrammar as xgr


class GrammarError(ValueError):
    """A regex / EBNF / JSON schema that xgrammar cannot compile, or one over the bounds below."""


MAX_GRAMMAR_CHARS = 16384
"""The longest grammar text compiled (the actors' action regex is under 1,300 characters); a longer one is refused
before anything is compiled."""
COMPILE_TIMEOUT_S = 10.0
"""The most seconds a request waits for its grammar to compile. xgrammar cannot be interrupted, so a compile that
takes longer goes on in the backend's one compile thread and is dropped when done; its text is refused from then
on (``REFUSED_SIZE`` such texts are remembered). Compiles happen one at a time, so such grammars never take more
than that thread, and requests whose grammar is cached never wait for them."""
CACHE_SIZE = 64
"""Compiled grammars kept, least recently used dropped first."""
REFUSED_SIZE = 1024
"""Grammar texts remembered as refused (too slow to compile, or invalid)."""


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
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)  # the bounded cache below is ours
        self._cache: collections.OrderedDict[tuple[str, str], xgr.CompiledGrammar] = collections.OrderedDict()
        self._refused: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._pending: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[tuple[str, str], concurrent.futures.Future]] = queue.SimpleQueue()
        # one daemon thread compiles, one grammar at a time: a runaway compile never holds up the process's exit
        # (an executor's worker threads are joined at exit)
        threading.Thread(target=self._compile_jobs, daemon=True, name="grammar-compile").start()

    def compile(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache (least recently used of CACHE_SIZE dropped first) or
        compiled in the backend's compile thread, waiting at most ``timeout_s`` seconds (see COMPILE_TIMEOUT_S).

        Raises:
            GrammarError: an invalid spec, a text over MAX_GRAMMAR_CHARS, or a compile that took longer than
                ``timeout_s`` (that text is refused at once from then on).
        """
        key = spec.key
        kind, text = key
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {kind} has {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} "
                               "compiled")
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            if key in self._refused:
                raise GrammarError(self._refused[key])
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = concurrent.futures.Future()
                self._jobs.put((key, future))
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self._refuse(key, f"the {kind} did not compile within {timeout_s:g} s")
            raise GrammarError(f"the {kind} did not compile within {timeout_s:g} s") from None

    def _compile_jobs(self) -> None:
        """The compile thread's loop: each queued grammar compiled in turn, its future settled."""
        while True:
            key, future = self._jobs.get()
            try:
                future.set_result(self._compile(key))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting request (GrammarError)
                future.set_exception(error)

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        """Runs in the compile thread: compile, then cache (or remember the refusal); raises GrammarError."""
        kind, text = key
        try:
            if kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = self._compiler.compile_grammar(text)
            else:
                compiled = self._compiler.compile_json_schema(text)
        except (RuntimeError, ValueError) as e:
            self._refuse(key, f"invalid {kind}: {e}")
            raise GrammarError(f"invalid {kind}: {e}") from e
        finally:
            with self._lock:
                self._pending.pop(key, None)
        with self._lock:
            if key not in self._refused:  # one that took too long is dropped, not cached
                self._cache[key] = compiled
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return compiled

    def _refuse(self, key: tuple[str, str], reason: str) -> None:
        with self._lock:
            self._refused[key] = reason
            while len(self._refused) > REFUSED_SIZE:
                self._refused.popitem(last=False)

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
        return xgr.GrammarMatcher(self.compile(spec))

    def forced_prefix_ids(self, matcher: xgr.GrammarMatcher, tokenize: Callable[[str], list[int]]) -> list[int]:
        """Canonical token ids of the text the grammar forces next (empty when the next text is a choice).

        ``tokenize`` is the tokenizer's plain encoding (no special tokens added). The matcher is not advanced.
        """
        if matcher.is_terminated():
            return []
        text = matcher.find_jump_forward_string()
        return tokenize(text) if text else []

    def sampled_token_ids(self, spec: GrammarSpec, text: str, tokenize: Callable[[str], list[int]]) -> list[int]:
        """The token ids a sampler under ``spec`` emits for ``text`` (no end token): each stretch the grammar
        forces as its canonical ids (``forced_prefix_ids``, as arpo-serve's jump-forward emits it) and each stretch
        the policy chooses, up to where the grammar forces text again, as its own canonical ids.

        Use: a reply written elsewhere (a demonstration) tokenized as the policy would have sampled it. Its plain
        encoding can differ at the seams: ``"Thought: c"`` encodes as ``Thought``, ``:``, `` c``, but the sampler
        emits the forced ``"Thought: "`` as ``Thought``, ``:``, `` `` and the policy then chooses ``c``.

        Raises:
            GrammarError: ``spec`` does not compile, or ``text`` is not a reply it allows, complete or cut off after
                a chosen character (the message gives the position where it leaves the grammar).
        """
        matcher, ids, pos = self.matcher(spec), [], 0
        while pos < len(text):
            forced = "" if matcher.is_terminated() else matcher.find_jump_forward_string()
            if forced:
                stretch = forced if text.startswith(forced, pos) else ""
            else:  # a chosen stretch: up to where the grammar forces text again, or the end of the text
                probe, end = matcher.fork(), pos
                while end < len(text) and probe.accept_string(text[end]):
                    end += 1
                    if probe.find_jump_forward_string():
                        break
                stretch = text[pos:end]
            stretch_ids = tokenize(stretch) if stretch else []
            if not stretch_ids or not all(matcher.accept_token(t) for t in stretch_ids):
                raise GrammarError(f"the text leaves the grammar at character {pos}: {text[pos:pos + 40]!r}")
            ids += stretch_ids
            pos += len(stretch)
        return ids

    def only_stop_allowed(self, matcher: xgr.GrammarMatcher) -> bool:
        """True when the grammar is complete and can only end: every token it allows is a stop token."""
        if matcher.is_terminated() or not matcher.is_completed():
            return False
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = set(torch.nonzero(bits.flatten()[: self.vocab_size]).flatten().tolist())
        return allowed <= set(self._info.stop_token_ids)

    def forced_token_mask(self, spec: GrammarSpec, output_ids: Sequence[int]) -> list[bool]:
        """Per output token: True where it lies inside text the grammar forced (see the module docstring).

        A token is forced when its bytes are a prefix of what remains of the forced string at its position (so
        any tokenization of forced text counts, SGLang's sampled ones and arpo-serve's canonical ones alike), or
        when it is a stop token at a point where the grammar allows nothing but stop tokens. A token that covers
        forced text and chosen text together counts as chosen. Tokens after the grammar stopped matching (a reply
        that was not generated under ``spec``) count as chosen.

        Raises:
            GrammarError: ``spec`` does not compile.
        """
        matcher = self.matcher(spec)
        vocab = self._info.decoded_vocab
        stops = set(self._info.stop_token_ids)
        mask: list[bool] = []
        pending = b""
        broken = False
        for token in map(int, output_ids):  # Python ints for xgrammar (the ids may be a packed array)
            if broken or not 0 <= token < len(vocab):
                broken = True
                mask.append(False)
                continue
            if token in stops:
                mask.append(self.only_stop_allowed(matcher))
            else:
                if not pending and not matcher.is_terminated():
                    pending = matcher.find_jump_forward_string().encode()
                piece = vocab[token]
                forced = bool(pending) and len(piece) > 0 and pending.startswith(piece)
                pending = pending[len(piece):] if forced else b""
                mask.append(forced)
            if not matcher.is_terminated() and not matcher.accept_token(token):
                broken = True
        return mask

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
