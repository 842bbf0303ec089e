"""Loss masks for the learner: which sampled tokens the action grammar forced (they are not the policy's choice).

Owns: one xgrammar backend for the policy's tokenizer (`arpo_async.grammar.GrammarBackend`, compiled
grammars cached per distinct regex). ``loss_mask`` turns a reply's output ids and the regex it was generated
under (``Trajectory.grammar``) into a per-token mask, True where the token counts in the loss.

Why: under a grammar such as UI-TARS's action regex most of a reply's text is fixed ("Action: click(start_box='(",
"," and ")')"); only the thought, the action's choice and the digits are the policy's. Training on the fixed
tokens adds noise to every update (issue 12 measured 3.8 digit tokens in a 25-token reply). The mask is computed
from the tokens and the grammar alone (`GrammarBackend.forced_token_mask`), so replies from SGLang, which samples
forced text under the mask and does not mark it, and from arpo-serve, which emits it as canonical tokens
(jump-forward), are treated alike.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from arpo_async.grammar import GrammarBackend, GrammarError, GrammarSpec
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

        eos = PromptEncoder(model_dir).eos_token_ids
        self._grammars = GrammarBackend(AutoTokenizer.from_pretrained(str(model_dir)), vocab_size, eos)
        self.bad_grammars = 0
        """Trajectories whose grammar did not compile (trained on every token, counted here)."""

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
