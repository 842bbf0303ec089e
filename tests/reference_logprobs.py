"""Reference log-probs for tests: one plain full forward pass of the policy per reply.

The product computes log-probs in two optimised places, arpo-serve's decode loop (arpo_serve.engine) and the
trainer's chunked forward (learner.train.policy_forward); tests compare both with this plain computation, which uses the
same model inputs (arpo_async.model.inputs) and nothing else.
"""

from __future__ import annotations

from arpo_async.model.inputs import ModelInputError, check_image_pads, forward_kwargs, pixel_inputs


def completion_logits(model, image_processor, input_ids: list[int], images: list, completion_ids: list[int]):
    """Logits that predict each completion token from the prompt and the completion tokens before it.

    Args: as `token_logprobs`.
    Returns:
        tensor [len(completion_ids), vocab_size] (the model's dtype), differentiable; row i scores token i.
    Raises:
        ModelInputError: empty completion, or image pads that do not match the images.
    """
    import torch

    if not len(completion_ids):
        raise ModelInputError("completion_ids is empty")
    pixels = pixel_inputs(image_processor, images)
    ids = torch.tensor([list(input_ids) + list(completion_ids)], dtype=torch.long)
    check_image_pads(model, ids, pixels)
    kw = forward_kwargs(model, ids, None, pixels)
    kw.pop("_next_position")
    logits = model(**kw, use_cache=False).logits[0]
    p = len(input_ids)
    return logits[p - 1 : p - 1 + len(completion_ids)]


def token_logprobs(model, image_processor, input_ids: list[int], images: list, completion_ids: list[int]):
    """log pi(completion token | prompt + previous completion tokens) for each completion token.

    Args:
        model: the policy (`load_policy`); image_processor: its image processor.
        input_ids: prompt ids, image pads already expanded (`PromptEncoder.encode`).
        images: the prompt's images as PNG/JPEG bytes (or PIL images), in prompt order.
        completion_ids: sampled ids (non-empty).
    Returns:
        float32 tensor [len(completion_ids)], differentiable w.r.t. the model parameters. This is the unmasked
        model distribution at temperature 1, the same quantity `arpo-serve` reports as output_token_logprobs.
    Raises:
        ModelInputError: empty completion, or image pads that do not match the images.
    """
    import torch

    logits = completion_logits(model, image_processor, input_ids, images, completion_ids)
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(completion_ids, dtype=torch.long).unsqueeze(-1)
    return logp.gather(-1, target).squeeze(-1)
