"""The learner's forward pass: a micro-batch of samples -> fp32 log-probs of their completion tokens only.

Two parts:

- :func:`collate` turns samples (prompt ids, screenshots, output ids) into one right-padded batch, with the
  Qwen2.5-VL multimodal rotary positions (``arpo_async.model.inputs.rope_positions``, the sampler's) and the
  pixels of every screenshot (:class:`PixelCache`: a screenshot is decoded and resized once, however many
  samples and steps reference it);
- :class:`CompletionLogprobs`, an ``nn.Module`` around the policy (the root that FSDP2 shards, see
  learner.train.distributed), runs the decoder once and computes the log-softmax in fp32 for the rows that predict
  completion tokens, ``chunk_tokens`` rows at a time.

Memory (why chunked, completion-only log-probs): the policy's own ``forward`` returns logits for every position,
``[B, L, V]`` in the model dtype, and a log-softmax over them in fp32 doubles that. For Qwen2.5-VL-7B
(V = 152,064) one 4,096-token sequence is 4,096 x 152,064 x 4 B = 2.5 GB of fp32 logits; the prompt (system
text, screenshots: about 2,700 image tokens at 1280x720) is most of it and is never scored. Here only the
completion rows are projected (a 200-token reply: 200 x V x 4 B = 122 MB), and at most ``chunk_tokens`` of them
at once; each chunk's projection is recomputed in the backward pass (``torch.utils.checkpoint``), so what stays
alive for the backward is the chunk's hidden states (``chunk x H`` in the model dtype), not its logits. Peak
extra memory: one chunk's fp32 logits, ``chunk_tokens x V x 4 B`` (1024 x 152,064 x 4 B = 623 MB at the
default), however long the batch.

Right padding: every row is its prompt then its completion then pad tokens. With causal attention no real token
attends to a later pad, so the model runs without a padding mask and its outputs for real tokens are exactly
those of the unpadded sequence.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from arpo_async.model.inputs import ModelInputError, check_image_pads, pixel_inputs, rope_positions
from learner.algo.train_sample import TrainSample

__all__ = ["CompletionLogprobs", "MicroBatch", "PixelCache", "collate"]


class PixelCache:
    """Screenshot bytes -> ``(pixel_values [patches, 1176] float32, image_grid_thw [1, 3] int64)``, memoised.

    The learner sees the same screenshot many times: every later step of an episode repeats the earlier
    screenshots, a group's rollouts start from the same desktop, and replayed trajectories come back. Decoding
    a PNG and resizing it is most of a small policy's training step on CPU, so each distinct screenshot (by
    BLAKE2b digest of its bytes) is processed once and kept, least recently used first out, up to ``max_bytes``
    of pixel values.

    Raises (from :meth:`get`): ModelInputError for bytes that are not an image.
    """

    def __init__(self, image_processor, max_bytes: int = 256 << 20) -> None:
        self.image_processor = image_processor
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, image: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        key = hashlib.blake2b(image, digest_size=16).digest()
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        out = pixel_inputs(self.image_processor, [image])
        entry = (out["pixel_values"], out["image_grid_thw"])
        self._entries[key] = entry
        self._bytes += entry[0].numel() * entry[0].element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, (old, _) = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return entry


@dataclass
class MicroBatch:
    """One right-padded batch of samples, ready for :class:`CompletionLogprobs`.

    Attributes:
        input_ids: [B, L] int64, prompt + completion + pad of each sample.
        position_ids: [3, B, L] int64, M-RoPE positions (``rope_positions``).
        pixel_values: [patches, 1176] in the samples' image order, or None when no sample has an image.
        image_grid_thw: [images, 3] int64, or None.
        rows, cols: [N] int64, the (row, position) of the hidden state that predicts each completion token;
            N = sum of the samples' completion lengths, samples in order, tokens in order.
        targets: [N] int64, the completion token ids.
        counts: completion length per sample (splits the [N] output back into samples).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    counts: list[int]

    def to(self, device: torch.device) -> "MicroBatch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(move(self.input_ids), move(self.position_ids), move(self.pixel_values),
                          move(self.image_grid_thw), move(self.rows), move(self.cols), move(self.targets),
                          self.counts)


def collate(policy, samples: Sequence[TrainSample], pixels: PixelCache, pad_id: int) -> MicroBatch:
    """Right-pad ``samples`` into one :class:`MicroBatch` on the CPU.

    Raises:
        ModelInputError: a sample's image pad tokens do not match its images, or an image cannot be decoded.
    """
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    width = max(lengths)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for b, (s, n) in enumerate(zip(samples, lengths)):
        ids[b, :n] = _long(np.concatenate([s.prompt_ids, s.output_ids]))
        mask[b, :n] = 1
    images = [pixels.get(image) for s in samples for image in s.images]
    pixel_values = torch.cat([p for p, _ in images]) if images else None
    grid = torch.cat([g for _, g in images]) if images else None
    check_image_pads(policy, ids, {} if grid is None else {"image_grid_thw": grid})
    position_ids, _ = rope_positions(policy, ids, mask, grid)
    counts = [len(s.output_ids) for s in samples]
    rows = np.repeat(np.arange(len(samples)), counts)
    cols = np.concatenate([len(s.prompt_ids) - 1 + np.arange(t) for s, t in zip(samples, counts)])
    targets = np.concatenate([s.output_ids for s in samples])
    return MicroBatch(ids, position_ids, pixel_values, grid, _long(rows), _long(cols), _long(targets), counts)


def _long(values: np.ndarray) -> torch.Tensor:
    """A 1-D integer array as a new int64 tensor (a copy: a decoded step's arrays are read-only views)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


class CompletionLogprobs(torch.nn.Module):
    """``forward(batch) -> [N] float32``: log pi(token | everything before it) for every completion token.

    ``forward(batch, with_entropy=True)`` returns ``(logprobs, entropy)``, ``entropy`` [N] float32 detached: the
    entropy in nats of the policy's whole next-token distribution at each completion position,
    ``H = logsumexp(z) - sum softmax(z) * z`` over the vocabulary (before any grammar mask; the "actor/entropy"
    that verl logs). It costs no extra projection: it comes from the same chunk of logits.

    Args:
        policy: a Qwen2.5-VL / Qwen2-VL ``ForConditionalGeneration`` (``arpo_async.model.inputs.load_policy``).
        chunk_tokens: completion rows projected to the vocabulary at once (fp32 logits of ``chunk_tokens x V``).

    The value equals one plain full forward of the policy with an fp32 log-softmax (tests/reference_logprobs.py) for
    each sample alone, and what arpo-serve and SGLang report as ``output_token_logprobs`` at temperature 1.
    """

    def __init__(self, policy, chunk_tokens: int = 1024) -> None:
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.policy = policy
        self.chunk_tokens = chunk_tokens

    def forward(self, batch: MicroBatch,
                with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kwargs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False}
        if batch.pixel_values is not None:
            kwargs.update(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw)
        hidden = self.policy.model(**kwargs).last_hidden_state  # [B, L, H], after the final norm
        scored = hidden[batch.rows, batch.cols]  # [N, H]
        parts, entropies = [], []
        for start in range(0, scored.shape[0], self.chunk_tokens):
            h = scored[start: start + self.chunk_tokens]
            t = batch.targets[start: start + self.chunk_tokens]
            if torch.is_grad_enabled():
                logprobs, entropy = checkpoint(self._chunk_logprobs, h, t, use_reentrant=False)
            else:
                logprobs, entropy = self._chunk_logprobs(h, t)
            parts.append(logprobs)
            entropies.append(entropy)
        return (torch.cat(parts), torch.cat(entropies)) if with_entropy else torch.cat(parts)

    def _chunk_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs of ``targets``, detached entropies), both [n] fp32, from one chunk's logits."""
        logits = self.policy.lm_head(hidden).float()  # [n, V] fp32, this chunk only
        norm = torch.logsumexp(logits, dim=-1)
        with torch.no_grad():
            entropy = norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - norm, entropy


def image_pad_problem(policy, sample: TrainSample, pixels: PixelCache) -> str | None:
    """Why ``sample``'s screenshots cannot go with its prompt (an image that does not decode, or a count of image
    pad tokens that differs from what its screenshots make), or None."""
    try:
        grids = [pixels.get(image)[1] for image in sample.images]
        ids = _long(sample.prompt_ids)[None]
        check_image_pads(policy, ids, {"image_grid_thw": torch.cat(grids)} if grids else {})
    except ModelInputError as error:
        return str(error)
    return None


def check_pad_id(policy) -> int:
    """The id right padding uses: the text config's ``pad_token_id``, else 0 (never attended to, never scored).

    Raises:
        ModelInputError: the pad id is outside the vocabulary.
    """
    text = getattr(policy.config, "text_config", policy.config)
    pad = getattr(text, "pad_token_id", None)
    pad = 0 if pad is None else int(pad)
    if not 0 <= pad < text.vocab_size:
        raise ModelInputError(f"pad_token_id {pad} is outside the vocabulary of {text.vocab_size}")
    return pad
