"""The Policy protocol: what the episode loop (actors.episode.EpisodeRunner) asks of a policy, and adapters.

Role: lets anything that can answer a prompt drive our episodes. The loop calls, once per step::

    await policy.generate(input_ids=..., images=..., sampling_params=..., rid=..., episode_id=...)

and expects a :class:`~arpo_async.inference_client.Generation`. Implementations:

- :class:`~arpo_async.inference_client.PolicyClient`: SGLang's (or arpo-serve's) HTTP API; the training default;
- any async callable with the same keyword signature, wrapped by :func:`as_policy` in :class:`CallablePolicy`;
  it may return a Generation, or just the reply text (then the step records no sampled tokens: fine for
  evaluation and data collection, useless for training, since the learner trains on sampled token ids).

Invariant: :func:`as_policy` returns an object whose ``generate`` is a coroutine function, or raises TypeError.
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Protocol, Sequence, runtime_checkable

from arpo_async.inference_client import Generation, PolicyUnavailable


@runtime_checkable
class Policy(Protocol):
    """Anything the episode loop can ask for a reply (see the module docstring).

    ``generate`` gets the prompt as token ids with one ``<|image_pad|>`` per image (the form SGLang's /generate
    takes; ``PromptEncoder.expand_image_pads`` gives the ids the learner trains on), one PNG/JPEG per image
    in the prompt (in prompt order), SGLang sampling params (``max_new_tokens``, ``temperature``, ``regex``...),
    a request id unique per step and the episode id (the same for every step of one episode). It returns a
    Generation whose ``text`` is a UI-TARS reply (``Thought: ...\\nAction: click(start_box='(x,y)')``).
    It raises ``PolicyUnavailable`` / ``PolicyRequestError`` / ``GenerationAborted`` (arpo_async.inference_client)
    to end the episode as ABORTED; any other exception propagates out of the episode.
    """

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str) -> Generation: ...


class PolicyTimeout(PolicyUnavailable):
    """A policy call of an episode got no reply within its deadline (``actors.policy_timeout_s``), retries and
    backoff included: the server accepts requests and never answers, or is far too slow. A PolicyUnavailable, so
    the episode ends ABORTED (not trained on; an errored episode in ``arpo eval``) with this type and message."""


GenerateFn = Callable[..., Awaitable["Generation | str"]]
"""An async callable taking ``generate``'s keyword arguments, returning a Generation or the reply text."""


def text_generation(text: str, *, prompt_tokens: int = 0, latency_s: float = 0.0) -> Generation:
    """A Generation that carries only reply text: no sampled tokens, policy version 0, finish reason "stop".

    For policies that are not a sampler (scripts, remote APIs that return text). Trajectories built from it
    have empty ``output_ids`` and cannot be trained on.
    """
    return Generation(text=text, output_ids=[], logprobs=[], weight_version=0, token_versions=[],
                      finish_reason="stop", prompt_tokens=prompt_tokens, latency_s=latency_s, url="local")


class CallablePolicy:
    """Adapts an async callable (:data:`GenerateFn`) to :class:`Policy`.

    Raises:
        TypeError: at construction, ``fn`` is not an async function (or an object with an async ``__call__``);
            at a call, ``fn`` returned something other than a Generation or a str.
    """

    def __init__(self, fn: GenerateFn) -> None:
        if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
            raise TypeError(f"a policy must be an async function taking generate()'s keyword arguments "
                            f"(input_ids, images, sampling_params, rid, episode_id), got {fn!r}")
        self.fn = fn

    def __repr__(self) -> str:
        return f"CallablePolicy({self.fn!r})"

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str) -> Generation:
        """Call ``fn`` with the same keywords; a str answer becomes :func:`text_generation` of it."""
        answer: Any = await self.fn(input_ids=input_ids, images=images, sampling_params=sampling_params,
                                    rid=rid, episode_id=episode_id)
        if isinstance(answer, Generation):
            return answer
        if isinstance(answer, str):
            return text_generation(answer)  # prompt_tokens 0: not counted by a server
        raise TypeError(f"policy {self.fn!r} returned {type(answer).__name__}; expected a Generation or the "
                        f"reply text (str)")


def as_policy(policy: Policy | GenerateFn) -> Policy:
    """``policy`` itself when it has an async ``generate`` (PolicyClient, your own class), else
    :class:`CallablePolicy` of it.

    Raises:
        TypeError: neither an object with an async ``generate`` nor an async callable.
    """
    if inspect.iscoroutinefunction(getattr(policy, "generate", None)):
        return policy  # type: ignore[return-value]
    return CallablePolicy(policy)  # type: ignore[arg-type]
