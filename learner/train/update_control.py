"""After a rollout batch's optimizer steps: the KL they caused sets the next learning rate (``learner.target_kl``)
and bounds the update kept (``learner.max_kl``).

Role: the torch side of learner.algo.kl_schedule, called by learner.train.trainer.Trainer.train_batch on every
rank (the scoring pass is a collective under FSDP2, and every rank reaches the same KL, so the same rate and the
same halvings).

The line search is TRPO's backtracking one (Schulman et al., "Trust Region Policy Optimization", arXiv
1502.05477, section 6 and appendix C) applied to the step the optimizer took: an update whose KL is above
``max_kl`` is halved, parameters to the midpoint of the batch's start and where they are, and the batch scored
again, until it is within the bound or :data:`MAX_HALVINGS` halvings have been made. The optimizer's moments keep
the batch's gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from arpo_async.config import LearnerConfig
from learner.algo.kl_schedule import adapt_lr, batch_kl

__all__ = ["MAX_HALVINGS", "UpdateControl"]

MAX_HALVINGS = 6
"""learner.max_kl: at most this many halvings of a batch's update (down to 1/64 of it) before it is kept as is."""


class UpdateControl:
    """One batch's KL control: create it before the batch's optimizer steps, call :meth:`after` once they are done.

    Args:
        config: the learner section (target_kl, max_kl and lr, the rate's ceiling).
        params: the trained parameters; with ``max_kl > 0`` a copy of them is kept (one model's float32 memory).
        score: the log-probs of the batch's output tokens under the current weights, one list per sample
            (Trainer.compute_logprobs on the batch).
    """

    def __init__(self, config: LearnerConfig, params: Sequence[torch.Tensor],
                 score: Callable[[], list[list[float]]]) -> None:
        self.config, self.params, self.score = config, list(params), score
        self.start = [p.detach().clone() for p in self.params] if config.max_kl > 0 else None

    def after(self, proximal: Sequence[Sequence[float]], masks: Sequence[Sequence[bool] | None],
              lr: float) -> tuple[float, dict[str, float]]:
        """The next batch's learning rate and ``{"policy_kl", "step_scale"}`` (the KL per trained token of the
        update kept, nats; the share of the optimizer's update kept). ``proximal``: the batch's log-probs before
        its steps; ``masks``: the samples' loss masks; ``lr``: the rate its steps used."""
        kl = batch_kl(proximal, self.score(), masks)
        next_lr = adapt_lr(lr, kl, self.config.target_kl, self.config.lr)
        scale = 1.0
        for _ in range(MAX_HALVINGS if self.start is not None else 0):
            if kl <= self.config.max_kl:
                break
            self._halve()
            scale /= 2
            kl = batch_kl(proximal, self.score(), masks)
        return next_lr, {"policy_kl": kl, "step_scale": scale}

    @torch.no_grad()
    def _halve(self) -> None:
        for param, start in zip(self.params, self.start):
            param.add_(start).mul_(0.5)
