"""Checkpoint names: the names ``save_pretrained`` writes, which SGLang's ``load_weights`` and every hub checkpoint use.

transformers >= 4.52 names Qwen2.5-VL's parameters differently inside the module (``model.language_model.layers.N``,
``model.visual...``) than in the checkpoint (``model.layers.N``, ``visual...``); ``save_pretrained`` reverts the
class's key mapping on the way out. SGLang (0.5.23 python/sglang/srt/models/qwen2_5_vl.py ``load_weights``) matches
checkpoint names only: a stacked q/k/v or gate/up name it does not know raises KeyError (the update fails,
"partially updated"), any other unknown name is skipped without a word. So weights that travel by name (the
distributed weight sync) travel under checkpoint names, and arpo-serve accepts only those.

The mapping is transformers' own: ``transformers.core_model_loading.revert_weight_conversion`` (transformers 5),
or the reverse of the class's ``_checkpoint_conversion_mapping`` as 4.52-4.57's ``save_pretrained`` applies it.
Tied parameters (``lm_head.weight`` when the embeddings are tied) are left out, as ``save_pretrained`` leaves them.
"""

from __future__ import annotations

import re

import torch

__all__ = ["checkpoint_name_map", "to_checkpoint_names", "tied_names"]


def tied_names(model: torch.nn.Module) -> set[str]:
    """Module names of parameters that are another parameter under a second name (e.g. ``lm_head.weight`` when the
    embeddings are tied); save_pretrained leaves them out."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _revert_legacy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 4.52-4.57: ``save_pretrained``'s reversal of ``_checkpoint_conversion_mapping``."""
    mapping = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    reverse = {replacement: pattern for pattern, replacement in mapping.items()}
    out = {}
    for key, tensor in state.items():
        for pattern, replacement in reverse.items():
            replacement = re.sub(r"\(.*\)", "", replacement.lstrip("^"))
            key, hits = re.subn(pattern, replacement, key)
            if hits:
                break
        out[key] = tensor
    return out


def to_checkpoint_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (module names -> tensors, as ``model.state_dict()`` names them) under checkpoint names, tied
    parameters left out, tensors unchanged; the order follows ``state``.

    Args:
        model: the module ``state`` comes from (its class picks the mapping; only names are read).
        state: module name -> tensor; may lack tied names already.

    Raises:
        ValueError: two module names map to one checkpoint name.
    """
    tied = tied_names(model)
    kept = {k: v for k, v in state.items() if k not in tied}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x
        renamed = _revert_legacy(model, kept)
    else:
        renamed = revert_weight_conversion(model, dict(kept))
    if len(renamed) != len(kept):
        raise ValueError(f"{len(kept)} module names map to {len(renamed)} checkpoint names")
    return renamed


def checkpoint_name_map(model: torch.nn.Module) -> dict[str, str]:
    """Checkpoint name -> module name for every parameter and buffer ``save_pretrained`` would write."""
    state = model.state_dict()
    module_name = {id(t): name for name, t in state.items()}
    return {ck: module_name[id(t)] for ck, t in to_checkpoint_names(model, state).items()}
