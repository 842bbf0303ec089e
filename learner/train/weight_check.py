"""Checking what a server serves after a weight sync: its checksums against the learner's tensors.

An inference engine reports a checksum per weight it serves (arpo_async.engine ``weights_checksums``; SGLang
0.5.23's ``/weights_checker``, utils/weight_checker.py, which arpo-serve answers too, read by
arpo_async.sglang_engine). arpo-serve keys them by checkpoint name. SGLang keys
them by its own parameter names, which for Qwen2.5-VL fuse what the checkpoint keeps apart (models/qwen2_5_vl.py
``load_weights``, one tensor-parallel rank): ``...self_attn.qkv_proj`` is q, k and v concatenated along dim 0,
``...mlp.gate_up_proj`` is gate then up (visual blocks too), and a vision block's ``attn.qkv`` is
``attn.qkv_proj``. :func:`expected_checksums` computes the learner's checksum under either kind of name; names it
cannot compute (buffers, another architecture's fused names) are left out of the comparison and counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from arpo_async.weight_sync import DTYPE_NAMES, dtype_from_name, tensor_checksum

__all__ = ["WeightCheck", "compare_checksums", "expected_checksums", "served_dtype"]

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
