"""One generated reply to train on (:class:`TrainSample`) and the check that it can be trained on.

Owns the sample type the batcher builds (learner.algo.batcher), the forward pass collates (learner.train.policy_forward)
and the trainer trains on (learner.train.trainer, which re-exports it); no torch here, so scoring a group into samples
does not load the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from arpo_async.messages import LogprobArray, TokenArray, float_array, int_array

__all__ = ["TrainSample", "sample_problem"]


@dataclass
class TrainSample:
    """One generated reply to train on: the exact tokens the sampler saw and produced, and the rollout's advantage.

    Attributes:
        prompt_ids: the prompt token ids as sent to the sampler (image pad tokens already expanded), [P] int32.
        images: the screenshots the prompt references, encoded image bytes (PNG/JPEG; a received one is a
            memoryview of its ZeroMQ frame), in prompt order.
        output_ids: the generated token ids, [T] int32, T >= 1; the loss covers exactly these tokens.
        behaviour_logprobs: the sampler's log-prob of each output token (nats), [T] float64.
        advantage: the rollout's group-relative advantage, broadcast to all T tokens.
        replayed: True when the step belongs to a trajectory the replay buffer injected (its behaviour
            log-probs are those recorded when it was sampled); only used to report its correction separately.
        loss_mask: length T, True for the tokens the loss covers; False for tokens the action grammar forced
            (`learner.algo.forced_tokens`). None = every token. A sample with no True token adds nothing to the loss.
        demonstration: True for a step of a demonstration (arpo_async.demos: another policy's success): it has no
            behaviour log-probs of ours, so the trainer takes the pre-update policy's as its behaviour log-probs.
    """

    prompt_ids: TokenArray
    images: list[bytes]
    output_ids: TokenArray
    behaviour_logprobs: LogprobArray
    advantage: float
    replayed: bool = False
    loss_mask: list[bool] | None = None
    demonstration: bool = False

    def __post_init__(self) -> None:  # the step's arrays as they are; lists (tests, tools) become arrays
        self.prompt_ids = int_array(self.prompt_ids)
        self.output_ids = int_array(self.output_ids)
        self.behaviour_logprobs = float_array(self.behaviour_logprobs)

    def __getstate__(self) -> dict:
        """Pickled state (torch.distributed sends samples to the other ranks as objects): the images as bytes,
        since a received screenshot is a memoryview of its ZeroMQ frame, which does not pickle."""
        return {**self.__dict__, "images": [bytes(image) for image in self.images]}

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss covers (T, or the True entries of ``loss_mask``)."""
        return len(self.output_ids) if self.loss_mask is None else sum(map(bool, self.loss_mask))


def sample_problem(sample: TrainSample, proximal: Sequence[float] | None = None) -> str | None:
    """Why ``sample`` cannot be trained on (empty, mismatched lengths, non-finite numbers), or None."""
    n = len(sample.output_ids)
    if n == 0:
        return "no output tokens"
    if not len(sample.prompt_ids):
        return "no prompt tokens"
    if len(sample.behaviour_logprobs) != n:
        return f"{n} output tokens but {len(sample.behaviour_logprobs)} behaviour log-probs"
    if sample.loss_mask is not None and len(sample.loss_mask) != n:
        return f"{n} output tokens but a loss mask of {len(sample.loss_mask)}"
    if proximal is not None and len(proximal) != n:
        return f"{n} output tokens but {len(proximal)} proximal log-probs"
    if not math.isfinite(sample.advantage):
        return f"advantage {sample.advantage!r} is not finite"
    if not np.isfinite(sample.behaviour_logprobs).all():
        return "behaviour log-probs must be finite"
    if proximal is not None and not all(math.isfinite(x) for x in proximal):
        return "proximal log-probs must be finite"
    return None
