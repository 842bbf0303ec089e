"""Run SGLang 0.5.23's own request preprocessing on /generate bodies and report the prompt ids it would run.

Used by tests/integration/test_sglang_prompt_ids.py with the python of the SGLang test environment
(tests/sglang_env.py); not imported by the project.

    python tests/sglang_prompt_driver.py CASES.json OUT.json

CASES.json: ``{"cases": [{"name", "model_dir", "body", "server_args"?, "env"?}]}``: ``body`` is the JSON a client
POSTs to ``/generate`` (``input_ids``, ``image_data``, ``sampling_params``, ...), ``server_args`` extra
``ServerArgs`` fields (e.g. ``{"mm_preprocess_cache_size_mb": 64}``), ``env`` environment variables set while the
case runs (e.g. ``{"SGLANG_MM_AVOID_RETOKENIZE": "0"}``). OUT.json: ``{"results": [...]}``, one per case, in order:
``{"name", "input_ids": [...] | null, "image_grid_thw": [[t, h, w], ...], "error": str | null, "log": [str]}``
(``log``: what SGLang logged at WARNING or above while it processed the request, e.g. its "falling back to
decode+retokenize").

What runs is SGLang's code; what stands in for the server process is only this:

- per (model folder, server_args): ``ServerArgs(model_path=..., device="cpu", **server_args)`` is published as the
  process's runtime context (``runtime_context.publish(..., role="tokenizer")``, as the tokenizer process does;
  re-published before each case, last publish wins);
- the HF processor comes from SGLang's ``get_processor`` with the arguments of
  ``tokenizer_manager.get_processor_wrapper`` (copied: importing tokenizer_manager needs uvloop, zmq, uvicorn);
- the multimodal processor is ``get_mm_processor(...)`` (``QwenVLImageProcessor`` for Qwen2.5-VL), as
  ``TokenizerManager.init_tokenizer_and_processor`` builds it;
- each body becomes ``GenerateReqInput(**body)`` + ``normalize_batch_and_arguments()``, then the lines of
  ``TokenizerManager._tokenize_one_request`` that run for ``input_ids`` + ``image_data`` are followed:
  ``mm_processor_input = input_ids``, ``await mm_processor.process_mm_data_async(...)`` in an event loop, and the
  prompt SGLang runs is ``mm_inputs.input_ids``. A case that does not finish in ``CASE_TIMEOUT_S`` reports
  ``TimeoutError`` (with transformers 5.19 an over-expanded prompt makes the processor raise StopIteration in a
  worker thread, which asyncio cannot put into a future: the request never completes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path

CASE_TIMEOUT_S = 30.0


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def _mm_processor(model_dir: str, extra_args: dict):
    """SGLang's multimodal processor for ``model_dir``, built as the tokenizer process builds it."""
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.multimodal.transport import determine_tensor_transport_mode
    from sglang.srt.runtime_context import get_mm, get_model, get_serving
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers.processor import get_processor, resolve_image_processor_backend

    server_args = ServerArgs(model_path=model_dir, device="cpu", **extra_args)
    runtime_context.publish(server_args, role="tokenizer")
    model_config = ModelConfig.from_server_args(server_args)
    import_processors("sglang.srt.multimodal.processors")
    processor = get_processor(  # tokenizer_manager.get_processor_wrapper's arguments
        get_serving().tokenizer_path,
        tokenizer_mode=get_serving().tokenizer_mode,
        trust_remote_code=get_model().trust_remote_code,
        revision=get_model().revision,
        image_processor_backend=resolve_image_processor_backend(get_mm()),
        tokenizer_backend=get_serving().tokenizer_backend,
        model_name=get_model().model_path,
    )
    return get_mm_processor(model_config.hf_config, server_args, processor, determine_tensor_transport_mode(),
                            model_config=model_config)


async def _prompt_ids(mm_processor, body: dict) -> tuple[list[int], list[list[int]]]:
    """The prompt ids SGLang runs for ``body`` (TokenizerManager._tokenize_one_request, input_ids branch), and
    the image grids its processor computed."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    input_ids = obj.input_ids
    if obj.image_data is not None and not isinstance(obj.image_data, list):
        obj.image_data = [obj.image_data]
    mm_processor_input = (input_ids if mm_processor.prefer_tokenized_input and input_ids is not None
                          else (obj.text or input_ids))
    mm_inputs = await mm_processor.process_mm_data_async(
        image_data=obj.image_data, audio_data=obj.audio_data, input_text=mm_processor_input, request_obj=obj,
        max_req_input_len=None)
    if mm_inputs and mm_inputs.input_ids is not None:
        input_ids = mm_inputs.input_ids
    grids: list[list[int]] = []
    for item in (mm_inputs.mm_items if mm_inputs else []):
        grid = (item.model_specific_data or {}).get("image_grid_thw")
        if grid is not None:
            grids.extend([int(v) for v in row] for row in grid.reshape(-1, 3).tolist())
    return [int(t) for t in input_ids], grids


def main() -> int:
    cases_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    from sglang.srt import runtime_context

    collect = _Collect()
    logging.getLogger().addHandler(collect)
    processors: dict[str, object] = {}
    results = []
    for case in json.loads(cases_path.read_text())["cases"]:
        out = {"name": case["name"], "input_ids": None, "image_grid_thw": [], "error": None, "log": []}
        saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
        try:
            extra = case.get("server_args", {})
            key = json.dumps([case["model_dir"], extra], sort_keys=True)
            if key not in processors:
                processors[key] = _mm_processor(case["model_dir"], extra)
            proc = processors[key]
            runtime_context.publish(proc.server_args, role="tokenizer")
            os.environ.update(case.get("env", {}))
            collect.records.clear()
            out["input_ids"], out["image_grid_thw"] = asyncio.run(
                asyncio.wait_for(_prompt_ids(proc, case["body"]), CASE_TIMEOUT_S))
        except BaseException as e:  # noqa: BLE001 - each case reports its own failure
            out["error"] = f"{type(e).__name__}: {e}"
        finally:
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        out["log"] = list(collect.records)
        results.append(out)
    out_path.write_text(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
