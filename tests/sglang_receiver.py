"""SGLang 0.5.23's server side of weight sync, built from SGLang's own code, for tests (run it with the python of
tests/sglang_env.py: ``<sglang env>/bin/python tests/sglang_receiver.py --model DIR --port P --out DIR``).

What is SGLang's own code here, and what stands in for the rest of a server:

- The model: SGLang's ``Qwen2_5_VLForConditionalGeneration`` (models/qwen2_5_vl.py), built on the CPU by SGLang's
  loader (``model_loader.loader._initialize_model``) from SGLang's ``ModelConfig`` of ``--model``, after the
  process set up what a scheduler process has: a one-rank gloo world (``distributed.parallel_state
  .init_distributed_environment`` + ``initialize_model_parallel``) and its runtime context (``runtime_context
  .publish(ServerArgs(..., device="cpu", dtype=--dtype), role="scheduler")``). Its parameters start as NaN, so a
  test can tell which ones a publication wrote. As on a real server, ``--dtype auto`` serves a float32 checkpoint
  in float16 (configs/model_config.py ``_get_and_verify_dtype``), and the vocabulary dimension of
  ``embed_tokens`` / ``lm_head`` is padded to a multiple of 64 (layers/vocab_parallel_embedding.py). One
  placeholder is needed: the rotary embedding's constructor imports ``vllm._custom_ops.rotary_embedding`` on a
  platform that is neither CUDA nor SGLang's CPU engine (layers/rotary_embedding/base.py, line 138); the
  placeholder raises if called, and nothing here runs a forward pass.
  (``SGLANG_USE_CPU_ENGINE=1`` would avoid that import but needs sgl_kernel's CPU build, which PyPI lacks.)
- Weight sync: SGLang's model-runner ``WeightUpdater`` (model_executor/model_runner_components/weight_updater.py:
  ``init_weights_update_group`` -> ``init_custom_process_group``; ``receive_weights_from_distributed`` with one
  broadcast per tensor or, for ``load_format="flattened_bucket"``, ``FlattenedTensorBucket.empty`` + one broadcast
  + ``reconstruct_tensors``; ``load_weights_from_distributed`` -> the model's ``load_weights``), driven by SGLang's
  ``SchedulerWeightUpdaterManager`` (managers/scheduler_components/weight_updater.py: the begin/end session rules,
  update without a session, flush after load, weight version). Stand-ins replace the tensor-parallel worker (its
  ``init_weights_update_group`` forwards the request's fields as managers/tp_worker.py does), the scheduler (it
  records the weight version) and the cache flush (always succeeds: no request ever runs here).
- /weights_checker: SGLang's ``WeightChecker`` (utils/weight_checker.py) over the model, answered as
  tokenizer_control_mixin.check_weights and http_server.check_weights answer.
- Requests: each body is decoded as SGLang's HTTP layer decodes it (FastAPI/pydantic through the request type's
  ``msgspec_struct_pydantic_core_schema``, which ignores unknown keys and coerces types laxly); on top of that the
  receiver refuses (HTTP 400, success false, the field named, recorded in /receiver_state) a key that is not a
  field of the type (``msgspec.structs.fields``), a missing required field, and a value that
  ``msgspec.convert(..., strict=True)`` does not accept for the field's type. (``msgspec.convert(body, Type)`` on
  the body itself cannot be used: io_struct's ``BaseReq`` is ``array_like=True``, so msgspec decodes these types
  from arrays only, "Expected `array`, got `object`"; the strict check converts the tagged array form instead.)
  Answers (status and JSON) are those of entrypoints/http_server.py.

Output (``--out``): for each successful /update_weights_from_distributed, ``s<session>-u<update>.safetensors``
holding every (name, tensor) the model's ``load_weights`` was given, under the names received; at each successful
/end_weight_update, ``s<session>-model.safetensors`` holding the SGLang model's parameters (its own names: fused
``qkv_proj`` / ``gate_up_proj``). GET /receiver_state reports mismatches, files, sessions, pause state and the
weight version. Prints ``sglang-receiver ready`` once it serves.

``python tests/sglang_receiver.py check < exchanges.json`` checks recorded exchanges against SGLang's own types
instead (no model, no server): a JSON list of ``{"kind": "request" | "response", "method", "path", "body",
"status"?, "text"?, "vocab_size"?}``; it prints a JSON list with the problems found for each (see
:func:`check_request` and :func:`check_response`).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import socket
import sys
import types
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


class _NotInstalled:
    def __init__(self, what: str) -> None:
        self.what = what

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.what} is a placeholder in the test receiver (vllm is not installed)")


def _install_vllm_placeholder() -> None:
    """``vllm._custom_ops.rotary_embedding``: imported (never called) by SGLang's RotaryEmbedding on a platform
    that is neither CUDA nor SGLang's CPU engine."""
    if "vllm" in sys.modules:
        return
    vllm, ops = types.ModuleType("vllm"), types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _NotInstalled("vllm._custom_ops.rotary_embedding")
    vllm._custom_ops = ops
    sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BodyMismatch(ValueError):
    """A request body that SGLang's type does not take as it is (unknown, missing or mistyped field)."""


def decode(body_bytes: bytes, req_type):
    """``body_bytes`` (JSON) -> an instance of SGLang's ``req_type``, as SGLang's HTTP layer decodes it, after the
    stricter checks described in the module docstring. Raises BodyMismatch naming the field."""
    import msgspec
    import pydantic

    try:
        body = json.loads(body_bytes or b"{}")
    except ValueError as error:
        raise BodyMismatch(f"body is not JSON: {error}") from error
    if not isinstance(body, dict):
        raise BodyMismatch(f"body is a JSON {type(body).__name__}, not an object")
    fields = msgspec.structs.fields(req_type)
    known = {f.name for f in fields}
    unknown = sorted(set(body) - known)
    if unknown:
        raise BodyMismatch(f"unknown field(s) {unknown} for SGLang's {req_type.__name__} (fields: {sorted(known)})")
    missing = [f.name for f in fields if f.required and f.name not in body]
    if missing:
        raise BodyMismatch(f"missing required field(s) {missing} of SGLang's {req_type.__name__}")
    try:
        obj = pydantic.TypeAdapter(req_type).validate_python(body)
    except pydantic.ValidationError as error:
        raise BodyMismatch(f"SGLang's {req_type.__name__} refuses the body: {error}") from error
    config = req_type.__struct_config__
    values = [body[f.name] if f.name in body else
              (f.default if f.default is not msgspec.NODEFAULT else f.default_factory()) for f in fields]
    if config.array_like:
        value = ([config.tag] if config.tag is not None else []) + values
    else:
        value = {**({config.tag_field: config.tag} if config.tag is not None else {}),
                 **{f.name: v for f, v in zip(fields, values)}}
    try:
        msgspec.convert(value, req_type, strict=True)
    except msgspec.ValidationError as error:
        raise BodyMismatch(f"SGLang's {req_type.__name__} (strict): {error}") from error
    return obj


class Receiver:
    """SGLang's weight-sync objects around SGLang's model; every method runs in the one scheduler thread."""

    def __init__(self, model_dir: Path, out: Path, dtype: str = "auto") -> None:
        import torch
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import parallel_state
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.model_loader.loader import _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.weight_checker import WeightChecker

        self.out = out
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        self.server_args = ServerArgs(model_path=str(model_dir), device="cpu", dtype=dtype, tp_size=1, pp_size=1,
                                      ep_size=1)
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        parallel_state.initialize_model_parallel(backend="gloo")

        self.model_config = ModelConfig.from_server_args(self.server_args)
        with set_default_torch_dtype(self.model_config.dtype), torch.device("cpu"):
            self.model = _initialize_model(self.model_config, LoadConfig(load_format="dummy"))
        with torch.no_grad():
            for param in self.model.parameters():
                param.fill_(float("nan"))
        self.received: list[tuple[str, torch.Tensor]] = []
        load_weights = self.model.load_weights

        def recording_load_weights(weights):
            weights = list(weights)
            self.received.extend((name, tensor.detach().clone()) for name, tensor in weights)
            return load_weights(weights)

        self.model.load_weights = recording_load_weights

        self.weight_updater = WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=self.model_config, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=lambda **_: None, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: self.runner)
        checker = WeightChecker(get_model=lambda: self.model)
        self.runner = types.SimpleNamespace(weight_updater=self.weight_updater, model=self.model,
                                            check_weights=checker.handle)
        updater = self.weight_updater

        class TpWorker:  # managers/tp_worker.py's methods the manager calls, for one target runner
            model_runner = self.runner

            @staticmethod
            def weight_update_runners():
                return [("target", self.runner)]

            @staticmethod
            def init_weights_update_group(recv_req):
                return updater.init_weights_update_group(recv_req.master_address, recv_req.master_port,
                                                         recv_req.rank_offset, recv_req.world_size,
                                                         recv_req.group_name, recv_req.backend)

        self.weight_version = "default"
        self.versions: list[str] = []

        def record_weight_version_change(new_version):
            if new_version is not None and new_version != self.weight_version:
                self.weight_version = new_version
                self.versions.append(new_version)

        self.manager = SchedulerWeightUpdaterManager(
            tp_worker=TpWorker, draft_worker=None, memory_saver_adapter=None,
            flush_cache=lambda empty_cache=False: True, is_fully_idle=lambda **_: True,
            scheduler=types.SimpleNamespace(record_weight_version_change=record_weight_version_change))
        self.sessions = 0
        self.updates_in_session = 0
        self.files: list[str] = []

    def _save(self, name: str, tensors: dict) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(self.out / name))
        self.files.append(name)

    def begin(self, req):
        out = self.manager.begin_weight_update(req)
        if out.success:
            self.sessions += 1
            self.updates_in_session = 0
        return out

    def update(self, req):
        self.received = []
        out = self.manager.update_weights_from_distributed(req)
        if out.success:
            self.updates_in_session += 1
            self._save(f"s{self.sessions}-u{self.updates_in_session}.safetensors",
                       {name: tensor.contiguous() for name, tensor in self.received})
        return out

    def end(self, req):
        out = self.manager.end_weight_update(req)
        if out.success:
            self._save(f"s{self.sessions}-model.safetensors",
                       {name: p.detach().clone().contiguous() for name, p in self.model.named_parameters()})
        return out


async def serve(receiver: Receiver, port: int) -> None:
    import hashlib

    import msgspec
    from aiohttp import web
    from sglang.srt.managers import io_struct as io
    from sglang.srt.utils.common import build_server_info

    scheduler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")
    state = {"mismatches": [], "paused": False, "pause_modes": [], "requests": []}

    async def in_scheduler(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(scheduler, fn, *args)

    async def decoded(request: web.Request, req_type):
        raw = await request.read()
        state["requests"].append({"path": request.path, "body": json.loads(raw or b"{}")})
        try:
            return decode(raw, req_type), None
        except BodyMismatch as error:
            state["mismatches"].append({"path": request.path, "message": str(error)})
            return None, web.json_response({"success": False, "message": str(error)}, status=400)

    def answer(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    async def health(_request):
        return web.Response(status=200)

    def relay(req_type, method):
        """A handler decoding the body as ``req_type``, running ``method(req)`` in the scheduler and answering with
        its success and message."""
        async def handler(request):
            req, refused = await decoded(request, req_type)
            if refused:
                return refused
            out = await in_scheduler(method, req)
            return answer(out.success, out.message)
        return handler

    async def update(request):
        req, refused = await decoded(request, io.UpdateWeightsFromDistributedReqInput)
        if refused:
            return refused
        out = await in_scheduler(receiver.update, req)
        message = out.message
        if out.success and req.weight_version is not None:  # tokenizer_control_mixin.update_weights_from_distributed
            message += f" Weight version updated to {req.weight_version}."
        return answer(out.success, message)

    async def weights_checker(request):
        if request.method == "POST" and (await request.read()).strip():
            req, refused = await decoded(request, io.CheckWeightsReqInput)
            if refused:
                return refused
        else:
            req = io.CheckWeightsReqInput()
        out = await in_scheduler(receiver.manager.check_weights, req)
        body = {"success": out.success, "message": out.message}
        if out.payload is not None:
            h = hashlib.sha256()
            for info in out.payload:
                h.update(info.per_gpu_checksum.encode())
            body["ranks"] = [msgspec.to_builtins(info) for info in out.payload]
            body["per_engine_checksum"] = h.hexdigest()
        return web.json_response(body, status=200 if out.success else 400)

    async def pause(request):
        req, refused = await decoded(request, io.PauseGenerationReqInput)
        if refused:
            return refused
        state["paused"] = True
        state["pause_modes"].append(req.mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(request):
        _req, refused = await decoded(request, io.ContinueGenerationReqInput)
        if refused:
            return refused
        state["paused"] = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(_request):
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details. (When there are "
                                 "running or waiting requests, the operation will not be performed.)\n")

    async def server_info(_request):
        info = build_server_info(receiver.server_args, {})
        info.update(internal_states=[{"paused": state["paused"]}], weight_version=receiver.weight_version,
                    version="0.5.23", frontend="python")
        return web.Response(text=json.dumps(msgspec.to_builtins(info), default=str), content_type="application/json")

    async def receiver_state(_request):
        return web.json_response({
            "mismatches": state["mismatches"], "paused": state["paused"], "pause_modes": state["pause_modes"],
            "weight_version": receiver.weight_version, "versions": receiver.versions, "sessions": receiver.sessions,
            "session_open": receiver.manager._session is not None, "files": receiver.files,
            "requests": state["requests"]})

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_post("/init_weights_update_group",
                        relay(io.InitWeightsUpdateGroupReqInput, receiver.manager.init_weights_update_group))
    app.router.add_post("/begin_weight_update", relay(io.BeginWeightUpdateReqInput, receiver.begin))
    app.router.add_post("/update_weights_from_distributed", update)
    app.router.add_post("/end_weight_update", relay(io.EndWeightUpdateReqInput, receiver.end))
    app.router.add_route("*", "/weights_checker", weights_checker)
    app.router.add_post("/pause_generation", pause)
    app.router.add_post("/continue_generation", resume)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/receiver_state", receiver_state)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("sglang-receiver ready", flush=True)
    await asyncio.Event().wait()


# ------------------------------------------------------------------------------------------------ checks

ROUTE_TYPES = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/weights_checker": "CheckWeightsReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
}
"""Route -> the io_struct type its body is decoded into (entrypoints/http_server.py, sglang 0.5.23)."""

ROUTE_METHODS = {
    "/generate": {"POST", "PUT"}, "/health": {"GET"}, "/get_server_info": {"GET"}, "/get_model_info": {"GET"},
    "/flush_cache": {"GET", "POST"}, "/weights_checker": {"GET", "POST"},
    **{path: {"POST"} for path in ROUTE_TYPES if path != "/weights_checker"},
}
"""The HTTP methods http_server.py registers for each route."""

GENERATE_META_KEYS = frozenset({
    "id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
    "completion_tokens", "cached_tokens", "e2e_latency", "input_token_logprobs", "output_token_logprobs",
    "output_token_logprobs_length"})
"""meta_info keys SGLang's TokenizerManager always writes for a finished, non-streaming /generate with
return_logprob (managers/tokenizer_manager.py: the meta_info dict of _handle_batch_output, its
reasoning/completion/cached tokens update, e2e_latency when finished, convert_logprob_style's
input/output_token_logprobs and output_token_logprobs_length)."""

MODEL_INFO_KEYS = frozenset({
    "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
    "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
    "has_image_understanding", "has_audio_understanding", "model_type", "architectures"})
"""Keys of http_server.py's /model_info (= /get_model_info) result."""

SERVER_INFO_KEYS = frozenset({
    "model_path", "served_model_name", "tokenizer_path", "host", "port", "incremental_streaming_output",
    "disaggregation_mode", "max_total_num_tokens", "version", "internal_states", "dtype", "device"})
"""Keys of /get_server_info that the api contract's GetServerInfoResponse declares and the Python server builds
(utils/common.build_server_info: ServerArgs.resolved_dict() + the scheduler's handshake info with
max_total_num_tokens; http_server.server_info adds internal_states and version; the contract's deployment_info
is built by the Rust server only and max_context_length by neither), plus the ServerArgs fields learner.train.publisher
reads (dtype, device: its served dtype and hasher)."""

FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
              "requests, the operation will not be performed.)\n")


def check_generate_request(body: dict, vocab_size: int) -> list[str]:
    """A /generate body as SGLang takes it: the HTTP contract gate (entrypoints/api_contract.py), the
    GenerateReqInput dataclass (FastAPI/pydantic decoding, no unknown key, normalize_batch_and_arguments), its
    sampling_params as TokenizerManager builds SamplingParams (``SamplingParams(**sampling_params)``, normalize,
    verify) and each image_data entry through utils.common.load_image."""
    import dataclasses

    import msgspec
    import pydantic
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.utils.common import load_image

    problems = []
    error = generate_contract_error(body)
    if error is not None:
        problems.append(f"api contract (entrypoints/api_contract.py): {error}")
    known = {f.name for f in dataclasses.fields(GenerateReqInput)}
    if unknown := sorted(set(body) - known):
        problems.append(f"unknown field(s) {unknown} for GenerateReqInput")
    try:
        obj = pydantic.TypeAdapter(GenerateReqInput).validate_python(body)
        obj.normalize_batch_and_arguments()
    except (pydantic.ValidationError, ValueError, TypeError) as error:
        problems.append(f"GenerateReqInput: {type(error).__name__}: {error}")
    params = body.get("sampling_params") or {}
    api_fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    if unknown := sorted(set(params) - api_fields):
        problems.append(f"unknown sampling_params key(s) {unknown} for SamplingParams")
    try:
        sampling = SamplingParams(**params)
        sampling.normalize(None)
        sampling.verify(vocab_size)
    except (TypeError, ValueError) as error:
        problems.append(f"SamplingParams: {type(error).__name__}: {error}")
    for k, image in enumerate(body.get("image_data") or []):
        try:
            loaded, _size = load_image(image, gpu_image_decode=False)
            loaded.size  # noqa: B018 - a PIL image
        except Exception as error:  # noqa: BLE001 - reported
            problems.append(f"image_data[{k}] does not load with SGLang's load_image: {error}")
    return problems


def check_request(method: str, path: str, body, vocab_size: int = 1 << 20) -> list[str]:
    """Problems of one request our code sends, as SGLang 0.5.23 would take it."""
    from sglang.srt.managers import io_struct

    problems = []
    if method not in ROUTE_METHODS.get(path, set()):
        problems.append(f"SGLang has no {method} {path} (its methods: {sorted(ROUTE_METHODS.get(path, []))})")
    if path == "/generate":
        return problems + check_generate_request(dict(body or {}), vocab_size)
    if path in ROUTE_TYPES and body is not None:
        try:
            decode(json.dumps(body).encode(), getattr(io_struct, ROUTE_TYPES[path]))
        except BodyMismatch as error:
            problems.append(str(error))
    return problems


def check_response(path: str, status: int, body, text: str) -> list[str]:
    """Problems of one response (arpo-serve's) against what SGLang's http_server.py and TokenizerManager build."""
    import hashlib

    import msgspec
    from sglang.api.v1 import api_types
    from sglang.srt.managers.io_struct import ChecksumInfo
    from sglang.srt.utils.weight_checker import overall_checksum

    problems = []

    def need(keys, have, what):
        if missing := sorted(set(keys) - set(have)):
            problems.append(f"{what} lacks {missing}")

    def contract(decoder, value):
        try:
            decoder.from_json_value(value)
        except api_types.JsonContractError as error:
            problems.append(f"{decoder.__name__} (api contract): {error}")

    if path == "/health":
        if status != 200 or text:
            problems.append(f"/health answered {status} {text[:100]!r}; SGLang answers 200 with an empty body")
    elif path == "/flush_cache":
        if (status, text) != (200, FLUSH_TEXT):
            problems.append(f"/flush_cache answered {status} {text[:100]!r}; SGLang: 200 {FLUSH_TEXT!r}")
    elif path == "/generate":
        contract(api_types.GenerateResponse, body)
        need({"text", "output_ids", "meta_info"}, body, "/generate response")
        need(GENERATE_META_KEYS, body.get("meta_info") or {}, "/generate meta_info")
    elif path in ("/pause_generation", "/continue_generation"):
        verb = "paused" if path == "/pause_generation" else "continued"
        expected = {"message": f"Generation {verb} successfully.", "status": "ok"}
        if (status, body) != (200, expected):
            problems.append(f"{path} answered {status} {body}; SGLang: 200 {expected}")
    elif path == "/weights_checker":
        if set(body) - {"success", "message", "ranks", "per_engine_checksum"}:
            problems.append(f"/weights_checker has keys SGLang does not send: {sorted(body)}")
        need({"success", "message"}, body, "/weights_checker")
        if body.get("success"):
            need({"ranks", "per_engine_checksum"}, body, "/weights_checker")
            infos = []
            for rank in body.get("ranks") or []:
                try:
                    infos.append(msgspec.convert(rank, ChecksumInfo, strict=True))
                except msgspec.ValidationError as error:
                    problems.append(f"a rank is not SGLang's ChecksumInfo: {error}")
                    continue
                if set(rank) != {f.name for f in msgspec.structs.fields(ChecksumInfo)}:
                    problems.append(f"a rank's keys {sorted(rank)} are not ChecksumInfo's")
                if infos[-1].per_gpu_checksum != overall_checksum(infos[-1].checksums):
                    problems.append("per_gpu_checksum is not utils/weight_checker.overall_checksum(checksums)")
            h = hashlib.sha256()
            for info in infos:
                h.update(info.per_gpu_checksum.encode())
            if infos and body.get("per_engine_checksum") != h.hexdigest():
                problems.append("per_engine_checksum is not tokenizer_control_mixin.check_weights' sha256")
        if status != (200 if body.get("success") else 400):
            problems.append(f"HTTP {status} with success={body.get('success')}")
    elif path in ROUTE_TYPES:  # the weight routes: {"success", "message"} (+ num_paused_requests), 200 or 400
        keys = {"success", "message"} | ({"num_paused_requests"} if path == "/update_weights_from_disk" else set())
        if set(body) != keys or not isinstance(body.get("success"), bool) \
                or not isinstance(body.get("message"), str):
            problems.append(f"{path} answered {body}; SGLang answers exactly the keys {sorted(keys)} (success: "
                            "bool, message: str)")
        if status != (200 if body.get("success") else 400):
            problems.append(f"{path}: HTTP {status} with success={body.get('success')}; SGLang: 200 or 400")
    elif path == "/get_server_info":
        contract(api_types.GetServerInfoResponse, body)
        need(SERVER_INFO_KEYS, body, "/get_server_info")
    elif path == "/get_model_info":
        contract(api_types.GetModelInfoResponse, body)
        need(MODEL_INFO_KEYS, body, "/get_model_info")
    else:
        problems.append(f"no check for {path}")
    return problems


def check(exchanges: list[dict]) -> list[dict]:
    out = []
    for ex in exchanges:
        if ex["kind"] == "request":
            problems = check_request(ex["method"], ex["path"], ex.get("body"), ex.get("vocab_size", 1 << 20))
        else:
            problems = check_response(ex["path"], ex["status"], ex.get("body"), ex.get("text", ""))
        out.append({**{k: ex[k] for k in ("kind", "method", "path")}, "problems": problems})
    return out


def main() -> None:
    if sys.argv[1:2] == ["check"]:
        _install_vllm_placeholder()
        print(json.dumps(check(json.load(sys.stdin))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face folder of a Qwen2.5-VL model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the received tensors")
    parser.add_argument("--dtype", default="auto", help="SGLang's --dtype (auto: float16 for a float32 checkpoint)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    _install_vllm_placeholder()
    receiver = Receiver(args.model, args.out, args.dtype)
    asyncio.run(serve(receiver, args.port))


if __name__ == "__main__":
    main()
