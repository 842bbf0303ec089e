"""The trainer's error types, in a module of their own so that learner.train.trainer, learner.train.train_state and
``arpo export`` can all raise and catch them without importing one another (learner.train.trainer re-exports them).

Owns nothing else. Invariant: every error the trainer and its weight and checkpoint I/O raise on purpose is a
:class:`TrainerError`.
"""

from __future__ import annotations

from arpo_async.config import ConfigError

__all__ = ["TrainerConfigError", "TrainerError", "TrainerInputError"]


class TrainerError(RuntimeError):
    """Base class of the trainer's errors (also raised for file-system conflicts when saving)."""


class TrainerConfigError(TrainerError, ConfigError):
    """A learner setting this machine or this batch cannot honour, found only when training starts (learner.device
    "cuda" without CUDA, a sample longer than learner.max_tokens_per_microbatch); the message names the key. The
    ranges of the settings are checked when the config is built (arpo_async.config); this is a ConfigError too, so
    one ``except ConfigError`` catches both."""


class TrainerInputError(TrainerError, ValueError):
    """A batch or sample cannot be trained on (empty, mismatched lengths, non-finite numbers)."""
