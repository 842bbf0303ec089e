"""The action grammar's view of a reply's tokens, for the learner: which tokens it forced (they are not the policy's
choice), and how a demonstration's reply is tokenized so that it is the token sequence the policy samples.

Owns: one xgrammar backend for the policy's tokenizer (`arpo_async.grammar.GrammarBackend`, compiled
grammars cached per distinct regex) and the demonstrations it re-tokenized (per demonstration and grammar).
``loss_mask`` turns a reply's output ids and the regex it was generated under (``Trajectory.grammar``) into a
per-token mask, True where the token counts in the loss. ``as_sampled`` gives a demonstration the output ids a
rollout under a given regex would have for its replies (the success replay's demonstrations, learner.algo.batcher).

Why: under a grammar such as UI-TARS's action regex most of a reply's text is fixed ("Action: click(start_box='(",
"," and ")')"); only the thought, the action's choice and the digits are the policy's. Training on the fixed
tokens adds noise to every update (issue 12 measured 3.8 digit tokens in a 25-token reply). The mask is computed
from the tokens and the grammar alone (`GrammarBackend.forced_token_mask`), so replies from SGLang, which samples
forced text under the mask and does not mark it, and from arpo-serve, which emits it as canonical tokens
(jump-forward), are treated alike.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from arpo_async.demos import END_OF_REPLY, is_demonstration
from arpo_async.grammar import GrammarBackend, GrammarError, GrammarSpec
from arpo_async.messages import Trajectory
from arpo_async.model.inputs import PromptEncoder

log = logging.getLogger(__name__)


class ForcedTokens:
    """Per-token loss masks from the grammar a reply was sampled under.

    Args:
        model_dir: the policy's checkpoint folder (its tokenizer is read).
        vocab_size: the model's logits width (``config.text_config.vocab_size``).
    """

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        from transformers import AutoTokenizer

        self._encoder = PromptEncoder(model_dir)
        self._grammars = GrammarBackend(AutoTokenizer.from_pretrained(str(model_dir)), vocab_size,
                                        self._encoder.eos_token_ids)
        self._sampled: dict[tuple[str, str, tuple[str, ...]], Trajectory] = {}
        self.bad_grammars = 0
        """Trajectories whose grammar did not compile (trained on every token, counted here)."""
        self.off_grammar_demonstrations = 0
        """Demonstrations whose replies a rollout's grammar does not allow (kept with their plain tokens)."""

    def loss_mask(self, grammar: str, output_ids: Sequence[int]) -> list[bool] | None:
        """True for each output token the loss should cover (chosen by the policy), False for a forced one.

        Returns None (every token counts) for an unconstrained reply (``grammar == ""``) or a grammar that does
        not compile (logged once per call and counted in ``bad_grammars``). Shape: ``len(output_ids)``.
        """
        if not grammar:
            return None
        try:
            forced = self._grammars.forced_token_mask(GrammarSpec(regex=grammar), output_ids)
        except GrammarError as e:
            self.bad_grammars += 1
            log.warning("trajectory grammar does not compile; training on every token: %s", e)
            return None
        return [not f for f in forced]

    def as_sampled(self, demonstration: Trajectory, grammar: str) -> Trajectory:
        """``demonstration`` with each step's output ids as a rollout sampled under ``grammar`` has them, and that
        grammar, so its loss mask and its tokens match the rollouts of the group it is injected into.

        Why: a demonstration's replies are text (arpo_async.demos encodes each with the tokenizer's plain
        encoding), but the policy emits a reply under the action grammar: forced text as its canonical tokens
        (arpo-serve's jump-forward) and its own choices between them
        (`arpo_async.grammar.GrammarBackend.sampled_token_ids`). The two differ at the seams (``" c"`` against
        ``" "`` then ``"c"`` after ``"Thought:"``), and a policy trained on the plain encoding learns a sequence
        it never samples: measured on the menu family, the demonstration's own tokens reached a log-prob of -0.6
        while the same reply as the sampler emits it stayed at -290, and the task never learned.

        Returns the demonstration unchanged for ``grammar == ""``, for a trajectory that is not a demonstration,
        and for a demonstration whose replies ``grammar`` does not allow (logged once per demonstration and
        grammar, counted in ``off_grammar_demonstrations``). Results are cached per demonstration (id and replies) and
        grammar.
        """
        if not grammar or not is_demonstration(demonstration):
            return demonstration
        key = (demonstration.trajectory_id, grammar, tuple(step.text for step in demonstration.steps))
        if key not in self._sampled:
            self._sampled[key] = self._retokenized(demonstration, grammar)
        return self._sampled[key]

    def _retokenized(self, demonstration: Trajectory, grammar: str) -> Trajectory:
        end = self._encoder.tokenize(END_OF_REPLY)
        try:
            outputs = [self._grammars.sampled_token_ids(GrammarSpec(regex=grammar), step.text,
                                                        self._encoder.tokenize) + end for step in demonstration.steps]
        except GrammarError as e:
            self.off_grammar_demonstrations += 1
            log.warning("demonstration %s: its replies are not what the rollouts' grammar allows, so it is trained "
                        "with its plain tokens: %s", demonstration.trajectory_id, e)
            return demonstration
        steps = [replace(step, output_ids=ids, logprobs=np.zeros(len(ids)), versions=np.zeros(len(ids), np.int32))
                 for step, ids in zip(demonstration.steps, outputs)]
        return replace(demonstration, steps=steps, grammar=grammar)
