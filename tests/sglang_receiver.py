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
- Requests: each body is decoded as SGLang's HTTP layer decodes it, with the stricter checks of
  tests/sglang_contract.py's ``decode`` (an unknown key, a missing required field or a value of the wrong type is
  refused: HTTP 400, success false, the field named, recorded in /receiver_state). Answers (status and JSON) are
  those of entrypoints/http_server.py.

Output (``--out``): for each successful /update_weights_from_distributed, ``s<session>-u<update>.safetensors``
holding every (name, tensor) the model's ``load_weights`` was given, under the names received; at each successful
/end_weight_update, ``s<session>-model.safetensors`` holding the SGLang model's parameters (its own names: fused
``qkv_proj`` / ``gate_up_proj``). GET /receiver_state reports mismatches, files, sessions, pause state and the
weight version. Prints ``sglang-receiver ready`` once it serves.

Recorded exchanges are checked against SGLang's own types, without a model or a server, by
tests/sglang_contract.py.
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

# run as a script (``python tests/sglang_receiver.py``), so its folder, tests/, is on sys.path
from sglang_contract import BodyMismatch, decode, install_vllm_placeholder

warnings.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face folder of a Qwen2.5-VL model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="folder for the received tensors")
    parser.add_argument("--dtype", default="auto", help="SGLang's --dtype (auto: float16 for a float32 checkpoint)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    install_vllm_placeholder()
    receiver = Receiver(args.model, args.out, args.dtype)
    asyncio.run(serve(receiver, args.port))


if __name__ == "__main__":
    main()
