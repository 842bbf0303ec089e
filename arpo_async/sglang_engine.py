"""SGLangEngine: the learner's inference engine (arpo_async.engine.InferenceEngine) over SGLang's HTTP API.

Role: the one place that knows SGLang 0.5.23's control routes and their shapes (python/sglang/srt/entrypoints/
http_server.py, managers/io_struct.py): pause and continue, loading weights from disk, the weight group and
session of a distributed update, the weight version, and /weights_checker. arpo-serve answers the same routes,
so it is served by this class too. One object per server; every object of a run shares one
:class:`~arpo_async.inference_client.PolicyClient` (its aiohttp session and retry policy).

Invariants: calls that are part of a collective (joining a group, receiving a bucket) and the session calls are
sent once, never retried (a partner must not be asked twice); the others are retried by the client's policy.
A refusal SGLang explains (HTTP 400 with ``{"success": false, "message"}``) is an ``EngineReply`` with ``ok``
False; a server that cannot be reached is ``PolicyUnavailable``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from arpo_async.engine import EngineReply, ServedChecksums
from arpo_async.inference_client import Generation, PolicyClient, PolicyRequestError, parse_version
from arpo_async.weight_sync import tensor_checksum

__all__ = ["SGLangEngine", "served_checksums", "sglang_engines"]

PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's ``/pause_generation`` modes (io_struct.PauseGenerationReqInput)."""


def _reply(answer: dict, *, unsaid: bool = False) -> EngineReply:
    """SGLang's ``{"success", "message"}`` -> EngineReply; an answer without ``success`` is ``unsaid`` (True only
    for pause and continue, which SGLang answers ``{"message", "status"}`` after HTTP 200)."""
    return EngineReply(bool(answer.get("success", unsaid)), str(answer.get("message", answer)))


def served_checksums(answer: dict) -> dict[str, str]:
    """Name -> checksum from a /weights_checker answer (every rank's ``checksums`` merged; sglang 0.5.23
    utils/weight_checker.py).

    Raises:
        ValueError: the answer is not success, or has no ``ranks`` with ``checksums``.
    """
    if not answer.get("success"):
        raise ValueError(f"weights_checker answered success=false: {answer.get('message', answer)}")
    ranks = answer.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("weights_checker answer has no 'ranks'")
    merged: dict[str, str] = {}
    for rank in ranks:
        checksums = rank.get("checksums") if isinstance(rank, dict) else None
        if not isinstance(checksums, dict):
            raise ValueError("a weights_checker rank has no 'checksums' map")
        merged.update({str(k): str(v) for k, v in checksums.items()})
    return merged


def _hasher(info: dict) -> Callable[[torch.Tensor], str]:
    """How the server hashes: on a CUDA server SGLang hashes with its own GPU kernel (mm_utils.tensor_hash), which
    only sglang itself computes; on a CPU server, sha256 (arpo_async.weight_sync.tensor_checksum).

    Raises:
        RuntimeError: a CUDA server and no sglang on this machine (the message says what to install).
    """
    if str(info.get("device", "cpu")).startswith("cuda"):
        try:
            from sglang.srt.managers.mm_utils import tensor_hash
        except ImportError as error:
            raise RuntimeError("learner.verify_weights_every with a CUDA SGLang server needs sglang installed on "
                               f"the learner (pip install -e '.[gpu]' in the clone) to hash as the server does: "
                               f"{error}") from error
        return lambda t: f"{tensor_hash(t.cuda()):016x}"
    return tensor_checksum


class SGLangEngine:
    """One SGLang (or arpo-serve) server as an :class:`~arpo_async.engine.InferenceEngine`.

    Args:
        client: the shared HTTP client (session, retry policy, API key).
        url: the server's base URL (``http://host:port``).
        owner: sent as ``rid`` (SGLang's request-id field) with every weight-group and weight-update-session call
            (join, begin, receive, end, leave), so that arpo-serve lets no other client use or end them ("": no
            rid; SGLang itself keeps no owner).
    """

    def __init__(self, client: PolicyClient, url: str, owner: str = "") -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.owner = owner

    def __repr__(self) -> str:
        return f"SGLangEngine({self.url!r})"

    def _at(self, route: str) -> str:
        return f"{self.url}/{route}"

    # ------------------------------------------------------------------------------------------ the protocol

    async def generate(self, *, input_ids: list[int], images: Sequence[bytes], sampling_params: dict,
                       rid: str, episode_id: str = "") -> Generation:
        """POST /generate on this server (PolicyClient.generate_on); ``episode_id`` is unused (one server)."""
        return await self.client.generate_on(self.url, input_ids=input_ids, images=images,
                                             sampling_params=sampling_params, rid=rid)

    async def healthy(self) -> bool:
        """GET /health answers 200 (one try)."""
        return await self.client.health(self.url)

    async def weight_version(self) -> int:
        """``weight_version`` of GET /get_model_info, where SGLang 0.5.23 reports the version a weight update set
        (/get_server_info keeps the startup value); "default" is 0. Raises PolicyRequestError for a version that
        is not a non-negative integer."""
        return parse_version((await self.model_info()).get("weight_version", "default"))

    async def pause(self, mode: str = "retract") -> EngineReply:
        """POST /pause_generation {mode} (modes: :meth:`~arpo_async.engine.InferenceEngine.pause`; ``retract`` lets
        the following update flush the cache). Raises ValueError for another mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        return _reply(await self.client.post_json(self._at("pause_generation"), {"mode": mode}), unsaid=True)

    async def resume(self) -> EngineReply:
        """POST /continue_generation {}."""
        return _reply(await self.client.post_json(self._at("continue_generation"), {}), unsaid=True)

    async def load_weights_from_disk(self, path: str, version: int) -> EngineReply:
        """POST /update_weights_from_disk {model_path, weight_version: str(version), flush_cache: true}; a refused
        update (SGLang: HTTP 400) is a reply with ok False and the server's message."""
        return _reply(await self.client.post_json(
            self._at("update_weights_from_disk"),
            {"model_path": path, "weight_version": str(int(version)), "flush_cache": True}, accept_failure_body=True))

    async def weight_group_ranks(self) -> int:
        """``tp_size`` of GET /get_server_info (1 when it does not say): SGLang's ranks join as ``rank_offset +
        tp_rank``. Raises PolicyRequestError for a value that is not a rank count."""
        tp_size = (await self.server_info()).get("tp_size") or 1
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= 4096:
            raise PolicyRequestError(f"{self.url} get_server_info reports tp_size {tp_size!r}: not a rank count",
                                     url=self.url)
        return tp_size

    async def join_weight_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str, timeout_s: float) -> EngineReply:
        """POST /init_weights_update_group (SGLang's fields, and rid; arpo_async.weight_sync) once."""
        return _reply(await self.client.post_once(self._at("init_weights_update_group"), {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend, **self._rid()}, timeout_s))

    async def begin_weight_update(self) -> EngineReply:
        """POST /begin_weight_update {"selector": "all"} once: SGLang 0.5.23 loads distributed updates only inside
        this session."""
        return _reply(await self.client.post_once(self._at("begin_weight_update"),
                                                  {"selector": "all", **self._rid()}))

    def _rid(self) -> dict[str, str]:
        return {"rid": self.owner} if self.owner else {}

    async def receive_weights(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                              group_name: str, version: int | None, load_format: str | None,
                              timeout_s: float) -> EngineReply:
        """POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache: true,
        abort_all_requests: false, weight_version?, load_format?, rid?} once."""
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": True, "abort_all_requests": False, **self._rid()}
        if version is not None:
            payload["weight_version"] = str(int(version))
        if load_format is not None:
            payload["load_format"] = load_format
        return _reply(await self.client.post_once(self._at("update_weights_from_distributed"), payload, timeout_s))

    async def end_weight_update(self) -> EngineReply:
        """POST /end_weight_update {rid?} once."""
        return _reply(await self.client.post_once(self._at("end_weight_update"), self._rid()))

    async def served_dtype(self) -> str:
        """GET /get_server_info ``dtype`` (SGLang's --dtype; "auto" when it names none)."""
        return str((await self.server_info()).get("dtype") or "auto")

    async def weights_checksums(self) -> ServedChecksums:
        """POST /weights_checker {"action": "checksum"} and GET /get_server_info (``dtype``: SGLang's --dtype,
        "auto" by default; ``device``: how it hashes). Raises ValueError (refused, no checksums), RuntimeError
        (a CUDA server and no sglang here to hash alike)."""
        info = await self.server_info()
        checksums = served_checksums(await self.checksum_answer())
        return ServedChecksums(checksums, str(info.get("dtype") or "auto"), _hasher(info))

    # ------------------------------------------------------------------------------------------ SGLang's own

    async def server_info(self) -> dict:
        """GET /get_server_info as the server answers it (server arguments, ``weight_version``, ...)."""
        return await self.client.get_json(self._at("get_server_info"))

    async def model_info(self) -> dict:
        """GET /get_model_info as the server answers it (``model_path``, ``weight_version``, ...)."""
        return await self.client.get_json(self._at("get_model_info"))

    async def checksum_answer(self, skip: Sequence[str] = ()) -> dict:
        """POST /weights_checker {"action": "checksum", "skip_tensor_list"?} -> SGLang's answer {success, message,
        ranks: [{checksums, per_gpu_checksum, parallelism_info}], per_engine_checksum}; a refusal comes back with
        success false."""
        payload: dict[str, Any] = {"action": "checksum"}
        if skip:
            payload["skip_tensor_list"] = list(skip)
        return await self.client.post_json(self._at("weights_checker"), payload, accept_failure_body=True)

    async def leave_weight_group(self, group_name: str) -> EngineReply:
        """POST /destroy_weights_update_group {group_name, rid?} once (not ok when the server has no such group)."""
        return _reply(await self.client.post_once(self._at("destroy_weights_update_group"),
                                                  {"group_name": group_name, **self._rid()}))


def sglang_engines(client: PolicyClient, owner: str = "") -> list[SGLangEngine]:
    """One :class:`SGLangEngine` per server of ``client`` (its ``urls``, in order), each with ``owner``."""
    return [SGLangEngine(client, url, owner) for url in client.urls]
