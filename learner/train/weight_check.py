"""Checking what a server serves after a weight sync: its checksums against the learner's tensors.

An inference engine reports a checksum per weight it serves (arpo_async.engine ``weights_checksums``; SGLang
0.5.23's ``/weights_checker``, utils/weight_checker.py, which arpo-serve answers too, read by
arpo_async.sglang_engine). arpo-serve keys them by checkpoint name. SGLang keys
them by its own parameter names, which for Qwen2.5-VL fuse what the checkpoint keeps apart (models/qwen2_5_vl.py
``load_weights``, one tensor-parallel rank): ``...self_attn.qkv_proj`` is q, k and v concatenated along dim 0,
``...mlp.gate_up_proj`` is gate then up (visual blocks too), and a vision block's ``attn.qkv`` is
``attn.qkv_proj``. :func:`expected_checksums` computes the learner's checksum under either kind of name; names it
cannot compute (buffers, another architecture's fused names) are left out of the comparison and counted.

After a publication (``learner.verify_weights_every``), :func:`verify_or_resync` checks one server: a server that
cannot check (:class:`~learner.train.publish_errors.CannotCheck`: SGLang answers /weights_checker with
success=false whenever its checker raises, e.g. a server that came back after being down) or whose checksums differ
(a server restarted after it took the weights serves the base weights) is sent the whole current weights again and
checked once more; only checksums that still differ stop the learner (WeightsMismatch). A server that still cannot
check is left, with one warning, for the next verification.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Sequence

import torch

from arpo_async.engine import InferenceEngine
from arpo_async.inference_client import PolicyRequestError, PolicyUnavailable
from arpo_async.weight_sync import DTYPE_NAMES, dtype_from_name, tensor_checksum
from learner.train.publish_errors import CannotCheck, PublishError, WeightsMismatch
from learner.train.train_engine import TrainEngine

__all__ = ["WeightCheck", "compare_checksums", "expected_checksums", "served_dtype", "verify_or_resync",
           "verify_server"]

log = logging.getLogger("arpo.learner.publish")

Hasher = Callable[[torch.Tensor], str]


def _fused(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if ".qkv_proj." in name:
        if name.startswith("visual."):
            return tensors.get(name.replace(".attn.qkv_proj.", ".attn.qkv."))
        parts = [tensors.get(name.replace(".qkv_proj.", f".{p}_proj.")) for p in "qkv"]
    elif ".gate_up_proj." in name:
        parts = [tensors.get(name.replace(".gate_up_proj.", f".{p}_proj.")) for p in ("gate", "up")]
    else:
        return None
    return torch.cat(parts, dim=0) if all(p is not None for p in parts) else None


VOCAB_PADDING = 64
"""SGLang pads the rows of ``embed_tokens`` and ``lm_head`` to a multiple of this with zeros
(layers/vocab_parallel_embedding.py ``DEFAULT_VOCAB_PADDING_SIZE``); its checksum covers the padded tensor."""


def expected_checksums(name: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                       hasher: Hasher = tensor_checksum) -> tuple[str, ...]:
    """The checksums a server may report for ``name``, from the learner's ``tensors`` (checkpoint names) cast to
    the server's ``dtype``: the tensor's own, and for a vocabulary matrix whose rows are not a multiple of
    :data:`VOCAB_PADDING` also the zero-padded one SGLang holds. Empty when ``name`` is neither a checkpoint name
    nor one of SGLang's fused names built from them."""
    tensor = tensors.get(name)
    if tensor is None:
        tensor = _fused(name, tensors)
    if tensor is None:
        return ()
    tensor = tensor.to(dtype)
    out = (hasher(tensor),)
    rows = tensor.shape[0] if tensor.dim() == 2 else 0
    if name.endswith(("embed_tokens.weight", "lm_head.weight")) and rows % VOCAB_PADDING:
        padded = torch.zeros((rows + VOCAB_PADDING - rows % VOCAB_PADDING, tensor.shape[1]), dtype=dtype)
        padded[:rows] = tensor
        out += (hasher(padded),)
    return out


def served_dtype(name: str, model_dir: Path) -> torch.dtype:
    """The dtype a server holds its weights in, from the name it reports (SGLang's --dtype). "auto" resolves as
    SGLang 0.5.23 resolves it (configs/model_config.py ``_get_and_verify_dtype``): the dtype in ``model_dir``'s
    config.json, except that a float32 checkpoint is served in float16 (bfloat16 for Gemma).

    Raises:
        ValueError: a name that is not one of arpo_async.weight_sync.DTYPE_NAMES, or "auto" and no readable
            config.json in ``model_dir``.
    """
    name = str(name or "auto").lower()
    if name != "auto":
        return dtype_from_name(name)
    config_file = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except OSError as error:  # a malformed file is a ValueError already
        raise ValueError(f"cannot read {config_file} to resolve dtype \"auto\": {error}") from error
    configured = DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)
    if configured == torch.float32:
        return torch.bfloat16 if str(config.get("model_type", "")).startswith("gemma") else torch.float16
    return configured


@dataclass(frozen=True)
class WeightCheck:
    """The outcome of one comparison: names compared, names that differ (sorted), names the learner could not
    compute (left out)."""

    compared: int
    mismatched: list[str]
    skipped: int

    @property
    def ok(self) -> bool:
        return self.compared > 0 and not self.mismatched


def compare_checksums(served: dict[str, str], tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                      hasher: Hasher = tensor_checksum) -> WeightCheck:
    """Compare a server's checksums with the learner's ``tensors`` (checkpoint names) cast to ``dtype``.
    ``compared`` 0 (no name in common) is not ok: nothing was checked."""
    mismatched, compared, skipped = [], 0, 0
    for name, checksum in served.items():
        expected = expected_checksums(name, tensors, dtype, hasher)
        if not expected:
            skipped += 1
            continue
        compared += 1
        if checksum not in expected:
            mismatched.append(name)
    return WeightCheck(compared, sorted(mismatched), skipped)


async def verify_server(engine: InferenceEngine, tensors: dict[str, torch.Tensor], trainer: TrainEngine) -> WeightCheck:
    """Compare ``engine``'s checksums (``weights_checksums``) with ``tensors`` (checkpoint names, the weights just
    published), cast to the dtype it serves (``trainer.model_dir``'s config resolves "auto").

    Raises:
        WeightsMismatch: a checksum differs (the message names the server and the first names that differ).
        CannotCheck: the server gave nothing comparable: /weights_checker answered success=false (SGLang: its
            checker raised), no checksums, a refusal (4xx), a dtype we do not know, or no name in common.
        PublishError: the server cannot be hashed alike here (a CUDA SGLang server and no sglang on the learner).
        PolicyUnavailable: the server did not answer.
    """
    try:
        served = await engine.weights_checksums()
    except PolicyUnavailable:
        raise
    except (ValueError, PolicyRequestError) as error:
        raise CannotCheck(f"{engine.url} cannot report its weights' checksums: {str(error)[:300]}") from error
    except RuntimeError as error:  # it cannot be hashed alike here
        raise PublishError(f"{engine.url}: {error}") from error
    try:
        dtype = served_dtype(served.dtype, Path(trainer.model_dir))
    except ValueError as error:
        raise CannotCheck(f"{engine.url}: cannot tell its weights' dtype: {error}") from error
    check = await asyncio.to_thread(compare_checksums, served.checksums, tensors, dtype, served.hasher)
    if check.mismatched:
        raise WeightsMismatch(f"{engine.url} weights checksums: {len(check.mismatched)} of {check.compared} weights "
                              f"differ from the learner's after the publication (first: {check.mismatched[:5]}; "
                              f"{check.skipped} names not comparable)")
    if not check.ok:
        raise CannotCheck(f"{engine.url} reported no checksum of a weight the learner has ({check.skipped} names "
                          "not comparable)")
    log.info("%s serves the published weights: %d checksums agree (%d names not comparable)", engine.url,
             check.compared, check.skipped)
    return check


Resync = Callable[[TrainEngine, int, Sequence[InferenceEngine]], Awaitable[list[str]]]
"""A publisher's ``catch_up(trainer, version, behind)``: sends the whole weights of ``version`` to ``behind`` and
returns the URLs that took them."""


async def verify_or_resync(engine: InferenceEngine, tensors: dict[str, torch.Tensor], trainer: TrainEngine,
                           version: int, resync: Resync) -> bool:
    """Check ``engine`` after the publication of ``version`` (:func:`verify_server`); when it cannot check or its
    checksums differ, send it the whole weights again (``resync``) and check once more. One WARNING line per step.

    Returns:
        True when the checksums were compared and agree (at once or after the resync); False when the server was
        not checked this time: it does not answer (PolicyUnavailable: down or restarting, as a publication skips
        it), the resync did not go through (the next resync, learner.resync_interval_s, tries again), or it still
        cannot check after the resync (checked again at the next verification).

    Raises:
        WeightsMismatch: the checksums still differ after the resync (the learner stops).
        PublishError: the server cannot be hashed alike here (see :func:`verify_server`).
    """
    try:
        return await _verified(engine, tensors, trainer, version)
    except (CannotCheck, WeightsMismatch) as error:
        log.warning("%s; sending %s the whole weights of version %d again and checking once more", error,
                    engine.url, version)
    if engine.url not in await resync(trainer, version, [engine]):
        log.warning("checking the weights of version %d on %s skipped: the resync did not go through; the next "
                    "resync tries again", version, engine.url)
        return False
    try:
        return await _verified(engine, tensors, trainer, version)
    except CannotCheck as error:
        log.warning("checking the weights of version %d on %s skipped: %s, even after it was sent the whole "
                    "weights again; checked again at the next verification", version, engine.url, error)
        return False


async def _verified(engine: InferenceEngine, tensors: dict[str, torch.Tensor], trainer: TrainEngine,
                    version: int) -> bool:
    """:func:`verify_server`: True when the checksums agree, False (one WARNING line) when the server does not
    answer; raises as :func:`verify_server` otherwise."""
    try:
        await verify_server(engine, tensors, trainer)
    except PolicyUnavailable as error:
        log.warning("checking the weights of version %d on %s skipped: it does not answer (%s); it is caught up "
                    "once it does", version, engine.url, error)
        return False
    return True
