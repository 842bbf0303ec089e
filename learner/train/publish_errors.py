"""The errors a weight publication raises (learner.train.publisher, learner.train.weight_check).

Which of them stop the learner: :class:`SyncRejected` and :class:`WeightsMismatch` (every later version would
fail or be served wrong alike); a :class:`PublishError` raised by a disk load; never :class:`CannotCheck`, which the
check itself handles (learner.train.weight_check.verify_or_resync: the server is resynced and checked again).
"""

from __future__ import annotations

__all__ = ["CannotCheck", "PublishError", "SyncRejected", "WeightsMismatch"]


class PublishError(RuntimeError):
    """An inference server did not load the new weights."""


class SyncRejected(PublishError):
    """A server refused to join the weight group (a configuration error: it stops the learner)."""


class WeightsMismatch(PublishError):
    """A server's /weights_checker checksums differ from the learner's weights after a publication, and still differ
    after that server was sent the whole weights again (it stops the learner: every later version would be served
    wrong in the same way)."""


class CannotCheck(PublishError):
    """A server gave no checksums this learner can compare: it answered /weights_checker with success=false (SGLang
    0.5.23 answers so, HTTP 400 with the exception's text as ``message``, whenever its checker raises: the server
    cannot check, which is not a mismatch), with no checksums, with a name-less or unknown dtype, with a refusal
    (4xx), or with no weight name in common with the learner's. Not a mismatch: the server is resynced and checked
    again (learner.train.weight_check.verify_or_resync)."""
