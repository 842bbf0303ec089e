"""The inference-engine seam: what the learner asks of one inference server, in our terms.

Role: the learner's weight publishers (learner.train.publisher) and weight check talk to inference servers only through
:class:`InferenceEngine`, as the actors' episode loop talks to a policy only through ``actors.policy.Policy``.
One engine object stands for one server: a weight update must reach every server itself, never a router.

Implementations:

- :class:`arpo_async.sglang_engine.SGLangEngine`: SGLang 0.5.23's HTTP API (and arpo-serve, which answers the same
  routes); the one the learner builds (``arpo_async.sglang_engine.sglang_engines``, one per server).

A new engine (vLLM, TensorRT-LLM, ...) is one new module beside ``arpo_async/sglang_engine.py`` holding a class
with these methods and a builder like ``arpo_async.sglang_engine.sglang_engines`` (one engine per server), which the
learner calls instead; nothing else in learner/ changes.

Errors every implementation raises the same way: ``arpo_async.inference_client.PolicyUnavailable`` when the
server cannot be reached (the publisher skips it for this version and catches it up later),
``PolicyRequestError`` when it rejects a request outright or answers nonsense. A refusal the server explains
(an update it cannot load) is an :class:`EngineReply` with ``ok`` False, not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from arpo_async.inference_client import Generation

__all__ = ["EngineReply", "InferenceEngine", "ServedChecksums"]


@dataclass(frozen=True)
class EngineReply:
    """A server's answer to a control call: whether it did it, and its own words (logged, shown in errors)."""

    ok: bool
    message: str = ""


@dataclass(frozen=True)
class ServedChecksums:
    """What a server reports of the weights it serves, to compare with the learner's (learner.train.weight_check).

    Attributes:
        checksums: weight name (checkpoint names, or the engine's fused names) -> checksum.
        dtype: the dtype the server holds weights in, as it names it ("bfloat16", or "auto" for the checkpoint's).
        hasher: the function that computes the server's checksum of one tensor (so the learner hashes alike).
    """

    checksums: dict[str, str]
    dtype: str
    hasher: Callable[[torch.Tensor], str]


@runtime_checkable
class InferenceEngine(Protocol):
    """One inference server as the learner uses it. Every method is a coroutine; see the module docstring for
    errors. The route each maps to in SGLang 0.5.23 (python/sglang/srt/entrypoints/http_server.py) is named."""

    url: str
    """Where the server is; names it in every log line and error."""

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str) -> Generation:
        """Sample one reply with per-token behaviour log-probs and policy versions (``actors.policy.Policy``'s
        signature, so an engine is also a policy). SGLang: POST /generate."""
        ...

    async def healthy(self) -> bool:
        """True when the server answers now (one try). SGLang: GET /health."""
        ...

    async def weight_version(self) -> int:
        """The policy version of the weights it serves (0 for the run's base weights). SGLang: GET
        /get_model_info ``weight_version`` ("default" -> 0)."""
        ...

    async def pause(self, mode: str = "retract") -> EngineReply:
        """Stop scheduling generation: "retract" (running requests go back to the queue, their KV cache freed;
        they resume under the new weights), "abort" (they end with finish_reason "abort"), "in_place" (their
        cache kept). Raises ValueError for another mode. SGLang: POST /pause_generation."""
        ...

    async def resume(self) -> EngineReply:
        """Schedule generation again after :meth:`pause`. SGLang: POST /continue_generation."""
        ...

    async def load_weights_from_disk(self, path: str, version: int) -> EngineReply:
        """Load the Hugging Face folder ``path`` (a path the server can read) and serve it as ``version``,
        flushing the prefix cache. SGLang: POST /update_weights_from_disk."""
        ...

    async def weight_group_ranks(self) -> int:
        """How many of the server's ranks join a weight group (1..4096). SGLang: ``tp_size`` of GET
        /get_server_info."""
        ...

    async def join_weight_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str, timeout_s: float) -> EngineReply:
        """Join the learner's weight group (arpo_async.weight_sync) as ranks ``rank_offset..``; answers once the
        server has joined or given up, so start the learner's own join beside it. Asked once, never retried.
        SGLang: POST /init_weights_update_group."""
        ...

    async def begin_weight_update(self) -> EngineReply:
        """Open a weight-update session (not ok when one is open already). SGLang: POST /begin_weight_update."""
        ...

    async def receive_weights(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                              group_name: str, version: int | None, load_format: str | None,
                              timeout_s: float) -> EngineReply:
        """Receive one bucket over the weight group while the learner broadcasts it (one tensor per name in
        order, or one flat uint8 tensor with ``load_format`` "flattened_bucket"); ``version`` None keeps the
        served version (every bucket but the last). Asked once. SGLang: POST /update_weights_from_distributed."""
        ...

    async def end_weight_update(self) -> EngineReply:
        """Close the session (not ok when none is open). SGLang: POST /end_weight_update."""
        ...

    async def leave_weight_group(self, group_name: str) -> EngineReply:
        """Leave (destroy) the weight group ``group_name`` on the server; not ok when it has no such group. Asked
        once, never retried. SGLang: POST /destroy_weights_update_group."""
        ...

    async def served_dtype(self) -> str:
        """The dtype the server holds its weights in, as it names it ("bfloat16", "float32", or "auto": the
        checkpoint's, resolved by learner.train.weight_check.served_dtype). SGLang: GET /get_server_info ``dtype``
        (its --dtype)."""
        ...

    async def weights_checksums(self) -> ServedChecksums:
        """Checksums of every weight the server serves, its dtype and how it hashes. Raises ValueError when the
        server refuses or answers without checksums, RuntimeError when this machine cannot hash as it does.
        SGLang: POST /weights_checker {"action": "checksum"} and GET /get_server_info (``dtype``, ``device``)."""
        ...
