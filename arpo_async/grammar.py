"""Constrained decoding, via xgrammar (the grammar backend SGLang uses by default): `arpo-serve` samples under it
and the learner finds the tokens it forced (learner.algo.forced_tokens), so it lives in the shared package.

Role: compile SGLang's ``regex`` / ``ebnf`` / ``json_schema`` sampling parameters into xgrammar grammars (cached
per distinct spec), hand out one matcher per request, and turn matcher states into a token bitmask applied to a
batch of logits on the CPU. No hand-written masks.

Bounds (issue 48 item 3; arpo_async.grammar_cache): a grammar used by PIN_AFTER_REQUESTS requests is pinned (never
evicted by other grammars), compiles wait in per-client queues served in turn with COMPILES_PER_CLIENT per client
(one more is refused with GrammarBusy), and a compile that outlasts its request's wait is kept when done, never
refused for it. Only a grammar xgrammar rejects is remembered as refused.

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

import asyncio
import collections
import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import xgrammar as xgr

from arpo_async.grammar_cache import CompileQueue, PinnedCache


class GrammarError(ValueError):
    """A regex / EBNF / JSON schema that xgrammar cannot compile, or one over the bounds below."""


class GrammarBusy(GrammarError):
    """The grammar cannot be had now, though nothing is wrong with it: its client already has
    COMPILES_PER_CLIENT compiles pending, or it did not compile within the request's wait (the compile goes on and
    its result is kept). Retry after ``retry_after_s`` seconds (arpo-serve answers HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 0.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


MAX_GRAMMAR_CHARS = 16384
"""The longest grammar text compiled (the actors' action regex is under 1,300 characters); a longer one is refused
before anything is compiled."""
COMPILE_TIMEOUT_S = 10.0
"""The most seconds a request waits for its grammar to compile (queue and compile). xgrammar cannot be interrupted:
a compile that takes longer goes on in the backend's one compile thread and its grammar is cached when done, so
the same grammar asked again later is served (nothing is refused for being slow). The request that waited gets
GrammarBusy (HTTP 503). Requests whose grammar is cached never wait for compiles."""
CACHE_SIZE = 64
"""Compiled grammars kept besides the pinned ones, least recently used dropped first."""
PINNED_MAX = 16
"""Most grammars pinned (kept for the life of the process; arpo_async.grammar_cache.PinnedCache)."""
PIN_AFTER_REQUESTS = 4
"""Requests after which a grammar is pinned (the run's action grammar: after its first steps)."""
COMPILES_PER_CLIENT = 4
"""Most compiles one client may have queued or running; one more distinct grammar is refused with GrammarBusy.
A client is what the caller names (arpo-serve: the peer's IP address)."""
RETRY_AFTER_S = 2.0
"""The Retry-After a GrammarBusy carries."""
REFUSED_SIZE = 1024
"""Grammar texts remembered as invalid (xgrammar refused them), so they are not compiled twice."""


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

    Compiled grammars are kept in a `PinnedCache` (CACHE_SIZE least recently used, plus up to PINNED_MAX pinned
    after PIN_AFTER_REQUESTS requests) and compiled one at a time in the backend's thread, from a `CompileQueue`
    (per-client queues served in turn, COMPILES_PER_CLIENT per client).

    Args:
        hf_tokenizer: a transformers tokenizer (xgrammar reads its vocabulary and decoder).
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        stop_token_ids: tokens that end a completed grammar.
        cache_size, pinned_max, pin_after, per_client: the bounds above (defaults: the module's constants).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *, cache_size: int = CACHE_SIZE,
                 pinned_max: int = PINNED_MAX, pin_after: int = PIN_AFTER_REQUESTS,
                 per_client: int = COMPILES_PER_CLIENT):
        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)  # the bounded cache below is ours
        self._cache: PinnedCache[tuple[str, str], xgr.CompiledGrammar] = PinnedCache(cache_size, pinned_max,
                                                                                    pin_after)
        self._refused: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._queue: CompileQueue[tuple[str, str]] = CompileQueue(per_client)
        self._lock = threading.Condition()
        # one daemon thread compiles, one grammar at a time: a runaway compile never holds up the process's exit
        # (an executor's worker threads are joined at exit)
        threading.Thread(target=self._compile_jobs, daemon=True, name="grammar-compile").start()

    def compile(self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S,
                client: str = "") -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``, from the cache or compiled in the backend's compile thread, waiting
        (blocking) at most ``timeout_s`` seconds (see COMPILE_TIMEOUT_S). ``client`` names the asker for the
        per-client bound.

        Raises:
            GrammarBusy: ``client`` has COMPILES_PER_CLIENT compiles pending, or the wait ran out (nothing is
                remembered against the grammar: asked again, it is served from the compile that went on).
            GrammarError: an invalid spec (remembered: refused at once from then on) or a text over
                MAX_GRAMMAR_CHARS.
        """
        compiled, future = self._lookup(spec, client)
        if compiled is not None:
            return compiled
        try:
            future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._still_compiling(spec, timeout_s) from None
        return self._cached(spec.key, future)

    async def compile_async(self, spec: GrammarSpec, client: str = "",
                            timeout_s: float = COMPILE_TIMEOUT_S) -> xgr.CompiledGrammar:
        """`compile` for an event loop: waits without holding a thread, so requests that wait for compiles never
        take the worker threads that prepare and decode other requests. Cancelling the caller leaves the compile
        going on. Raises as `compile`."""
        compiled, future = self._lookup(spec, client)
        if compiled is not None:
            return compiled
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            raise self._still_compiling(spec, timeout_s) from None
        return self._cached(spec.key, future)

    def state(self) -> dict[str, int]:
        """Counts for /get_server_info: ``grammars_cached`` (pinned included), ``grammars_pinned`` and
        ``grammar_compiles_pending`` (queued or running)."""
        with self._lock:
            return {"grammars_cached": len(self._cache), "grammars_pinned": len(self._cache.pinned),
                    "grammar_compiles_pending": self._queue.pending}

    def _lookup(self, spec: GrammarSpec,
                client: str) -> tuple[xgr.CompiledGrammar | None, concurrent.futures.Future | None]:
        """(the cached grammar, None), or (None, the future of its pending compile). Raises as `compile`."""
        key = spec.key
        kind, text = key
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the {kind} has {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} "
                               "compiled")
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                return compiled, None
            if key in self._refused:
                raise GrammarError(self._refused[key])
            future = self._queue.submit(key, client)
            if future is None:
                raise GrammarBusy(f"this client ({client or 'local'}) already has {self._queue.per_client} "
                                  f"grammars waiting to compile, the most per client; retry after "
                                  f"{RETRY_AFTER_S:g} s", RETRY_AFTER_S)
            self._lock.notify()
        return None, future

    def _cached(self, key: tuple[str, str], future: concurrent.futures.Future) -> xgr.CompiledGrammar:
        """After a wait: count the use (the cache may pin it) and return the compiled grammar; raises the
        compile's GrammarError."""
        compiled = future.result()
        with self._lock:
            self._cache.get(key)
        return compiled

    def _still_compiling(self, spec: GrammarSpec, timeout_s: float) -> GrammarBusy:
        kind = spec.key[0]
        with self._lock:
            queued = len(self._queue)
        return GrammarBusy(f"the {kind} did not compile within {timeout_s:g} s ({queued} compiles queued); its "
                           f"compile goes on and its result is kept: retry after {RETRY_AFTER_S:g} s", RETRY_AFTER_S)

    def _compile_jobs(self) -> None:
        """The compile thread's loop: queued grammars compiled in the queue's order, cached (or remembered as
        invalid) before their future is settled."""
        while True:
            with self._lock:
                job = self._queue.next_job()
                while job is None:
                    self._lock.wait()
                    job = self._queue.next_job()
            key, future = job
            try:
                compiled = self._compile(key)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting requests (GrammarError)
                with self._lock:
                    if isinstance(error, GrammarError):
                        self._refused[key] = str(error)
                        while len(self._refused) > REFUSED_SIZE:
                            self._refused.popitem(last=False)
                    self._queue.done(key)
                future.set_exception(error)
                continue
            with self._lock:
                self._cache.put(key, compiled, uses=0)  # the waiters count their own uses (_cached)
                self._queue.done(key)
            future.set_result(compiled)

    def _compile(self, key: tuple[str, str]) -> xgr.CompiledGrammar:
        """Runs in the compile thread: one xgrammar compile; raises GrammarError for an invalid grammar."""
        kind, text = key
        try:
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compiler.compile_json_schema(text)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {kind}: {e}") from e

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
