"""Real-size learner figures on one GPU: a bf16 training step and weight publications of a Qwen2.5-VL model at the
3B configuration, randomly initialised from its config (nothing is downloaded).

- model: the shapes of Qwen2.5-VL-3B-Instruct's config.json (huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct: text 36
  layers of width 2048, MLP 11008, 16 query and 2 key/value heads, vocabulary 151,936, tied embeddings; vision 32
  blocks of width 1280, MLP 3420, output 2048, windowed attention with full attention in blocks 7, 15, 23 and 31),
  the tiny model's tokenizer, the image processor at Qwen2.5-VL's own pixel bounds, random bf16 weights (3.75 B
  parameters); written once under ``--work`` and reused;
- sample: UI-TARS length: an instruction, ``--turns`` earlier replies (thought + action each) and ``--images``
  1280x720 screenshots, the last of them the current one (UI-TARS keeps the last 5), then a one-line thought and
  action (7,208 + 64 tokens by default); fewer screenshots when the GPU's memory runs out (`step_figures`);
- ``step_tok_s``: prompt + reply tokens / the median seconds of ``Trainer.train_step`` (forward, backward, AdamW)
  in bf16 (FSDP2 on one rank with ``--fsdp``; gradient checkpointing on); ``peak_gb``: peak GPU memory of the
  step (``torch.cuda.max_memory_allocated``; the process's peak resident memory on the CPU);
- ``dist_s``/``disk_s``: one weight publication to a real arpo-serve holding the same model in bf16 on the same
  device, in the served dtype: distributed (gather, broadcast over a weight group: nccl, or gloo where NCCL
  cannot put two ranks on one GPU: arpo_async.weight_sync.weight_group_plan) and disk (save the folder,
  ``/update_weights_from_disk``); ``dist_gb_s``/``disk_gb_s``: bytes sent or written / seconds; ``ratio`` =
  disk_s / dist_s. The baseline in the same run is the disk publication.

Medians over ``--repeats`` after one untimed warm-up of each. ``--quick`` is the smoke mode (CI, and the CPU dry
run of scripts/gpu_check.sh): the tiny model on the CPU, 2 repeats, 3 turns and 1 image.

Usage:
  python -m bench.bench_real_size --device cuda --fsdp     # on one GPU (scripts/gpu_check.sh runs this)
  python -m bench.bench_real_size --quick                  # smoke mode (about a minute on the CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench._arpo_run import ROOT, ensure_model
from bench._common import desktop_png, median, result_line
from bench.bench_learner import peak_memory_mb

QWEN25_VL_3B_TEXT = {
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
    "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 128000, "initializer_range": 0.02,
    "rope_parameters": {"mrope_section": [16, 24, 24], "rope_theta": 1000000.0, "rope_type": "default"},
    "layer_types": ["full_attention"] * 36, "tie_word_embeddings": True,
}
"""The text model of Qwen2.5-VL-3B-Instruct's config.json (the tokenizer's special-token ids stay the tiny
model's, whose ids all lie below this vocabulary size)."""
QWEN25_VL_3B_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
    "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
}
"""The vision tower of Qwen2.5-VL-3B-Instruct's config.json."""
QWEN25_VL_PIXELS = {"min_pixels": 3136, "max_pixels": 12845056}
"""Qwen2.5-VL's image processor bounds (its preprocessor_config.json): a 1280x720 screenshot is 1,196 tokens."""


def write_3b_model(out: Path, tiny: Path, device: torch.device) -> Path:
    """A Qwen2.5-VL folder at the 3B configuration at ``out`` (reused when complete): random bf16 weights made on
    ``device`` (seconds on a GPU), the tiny model's tokenizer, Qwen2.5-VL's pixel bounds."""
    if (out / "config.json").is_file():
        return out
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from learner.train.weights_export import write_folder

    raw = json.loads((tiny / "config.json").read_text())
    raw["text_config"].update(QWEN25_VL_3B_TEXT)
    raw["vision_config"].update(QWEN25_VL_3B_VISION)
    raw.update(initializer_range=0.02, dtype="bfloat16")
    config = Qwen2_5_VLConfig.from_dict(raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    partial = out.with_name(out.name + ".partial")
    write_folder(model, partial, tiny)
    del model
    processor = json.loads((partial / "preprocessor_config.json").read_text())
    processor.update(QWEN25_VL_PIXELS, size={"shortest_edge": QWEN25_VL_PIXELS["min_pixels"],
                                             "longest_edge": QWEN25_VL_PIXELS["max_pixels"]})
    (partial / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    partial.rename(out)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def ui_tars_sample(model: Path, turns: int, images: int, seed: int = 0):
    """One TrainSample of UI-TARS length: instruction, ``turns`` earlier replies, ``images`` 1280x720 screenshots
    (the last ``images - 1`` turns' and the current one), a ~40-token reply."""
    from arpo_async.model.inputs import PromptEncoder
    from learner.train.trainer import TrainSample

    encoder = PromptEncoder(model)
    rng = random.Random(seed)

    def reply(t: int) -> str:
        x, y = rng.randrange(1280), rng.randrange(720)
        return (f"Thought: step {t}: the dialog is open, so I click the Save button at the bottom right of the "
                f"window to keep the changes.\nAction: click(start_box='({x},{y})')")

    messages: list[dict] = [
        {"role": "system", "content": "You are a GUI agent. You are given a task and your action history, with "
                                      "screenshots. You need to perform the next action to complete the task."},
        {"role": "user", "content": [{"type": "text", "text": "Save the document as report.odt in Documents."}]}]
    for t in range(turns):
        if t >= turns - (images - 1):
            messages.append({"role": "user", "content": [{"type": "image"}]})
        messages.append({"role": "assistant", "content": reply(t)})
    messages.append({"role": "user", "content": [{"type": "image"}]})
    prompt = encoder.encode(messages, [(1280, 720)] * images)
    output = encoder.tokenize(reply(turns) + "<|im_end|>")
    shots = [desktop_png(i) for i in range(images)]
    return TrainSample(prompt, shots, output, [-2.0] * len(output), 1.0)


def time_steps(trainer, sample, repeats: int) -> list[float]:
    trainer.train_step([sample])  # warm-up: kernels, the pixel cache, AdamW's state
    times = []
    for _ in range(repeats):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        trainer.train_step([sample])
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


def step_figures(trainer, model: Path, turns: int, images: int, repeats: int) -> tuple[Any, list[float]]:
    """The sample and its step seconds (`time_steps`) with as many of ``images`` screenshots as the device's memory
    allows: on running out of GPU memory the screenshots are halved and the step tried again (said on stdout)."""
    while True:
        sample = ui_tars_sample(model, turns, images)
        try:
            return sample, time_steps(trainer, sample, repeats)
        except torch.cuda.OutOfMemoryError:
            if images <= 1:
                raise
            trainer.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print(f"out of GPU memory with {images} screenshots; trying {images // 2}", flush=True)
            images //= 2


async def time_publications(trainer, model: Path, work: Path, *, device: str, backend: str, server_gpu: int,
                            repeats: int) -> dict[str, list[float]]:
    """Seconds and bytes of distributed and disk publications to a real arpo-serve holding ``model`` in bf16."""
    from arpo_async.inference_client import PolicyClient, RetryPolicy
    from arpo_async.sglang_engine import sglang_engines
    from arpo_cli.cluster_process import free_port
    from arpo_cli.launcher import spawn, stop, wait_healthy
    from learner.train.publisher import DistributedPublisher, WeightPublisher

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"CUDA_VISIBLE_DEVICES": str(server_gpu)} if device == "cuda" else None
    serve = await spawn([sys.executable, "-m", "arpo_serve.main", "--model", str(model), "--port", str(port),
                         "--dtype", "bfloat16", "--device", device], work / "serve.log", env=env)
    out: dict[str, list[float]] = {}
    try:
        await wait_healthy(url, serve, work / "serve.log", timeout_s=600)
        retry = RetryPolicy(attempts=3, request_timeout_s=600.0, admin_timeout_s=900.0)
        async with PolicyClient([url], retry=retry) as client:
            net = DistributedPublisher(sglang_engines(client), backend=backend, timeout_s=600.0, bucket_mb=512)
            disk = WeightPublisher(sglang_engines(client), work / "weights", keep=1)
            version = 0
            for name, publisher in (("dist", net), ("disk", disk)):
                for i in range(repeats + 1):  # the first makes the weight group / warms the page cache: untimed
                    version += 1
                    started = time.perf_counter()
                    await publisher.publish_from(trainer, version)
                    if i:
                        out.setdefault(f"{name}_s", []).append(time.perf_counter() - started)
                out[f"{name}_bytes"] = [publisher.bytes_published]
                if publisher.failures:
                    raise RuntimeError(f"{publisher.failures} {name} publications failed; see {work / 'serve.log'}")
        return out
    finally:
        await stop(serve, grace_s=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke mode: the tiny model on the CPU, 2 repeats")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--fsdp", action="store_true", help="shard the trainer with FSDP2 on one rank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=15, help="earlier replies in the prompt")
    p.add_argument("--images", type=int, default=5, help="1280x720 screenshots in the prompt")
    p.add_argument("--work", type=Path, default=None, help="where the 3B folder and the published weights go "
                                                            "(default: a temporary folder)")
    p.add_argument("--backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="the weight group's backend (auto: arpo_async.weight_sync.weight_group_plan)")
    args = p.parse_args(argv)
    from arpo_async.config import LearnerConfig
    from learner.train.distributed import init_one_rank_fsdp
    from learner.train.trainer import Trainer, resolve_device
    from arpo_async.weight_sync import weight_group_plan

    if args.quick:
        args.device, args.repeats, args.turns, args.images = "cpu", 2, 3, 1
    device = resolve_device(args.device)
    backend, server_gpu = weight_group_plan() if args.device == "cuda" else ("gloo", 0)
    backend = backend if args.backend == "auto" else args.backend
    if backend == "nccl" and server_gpu == 0:
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # two ranks on one GPU (NCCL >= 2.30); the server inherits it
    with tempfile.TemporaryDirectory(prefix="bench-real-size-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tiny = ensure_model(ROOT / "runs" / "tiny-model")
        model = tiny if args.quick else write_3b_model(work / "qwen2.5-vl-3b-random", tiny, device)
        print(f"model {model.name}; weight group over {backend}", flush=True)
        group = init_one_rank_fsdp(device) if args.fsdp else None
        config = LearnerConfig(lr=1e-6, device=args.device, dtype="bfloat16" if device.type == "cuda" else "float32",
                               gradient_checkpointing=True, max_tokens_per_microbatch=65536)
        trainer = Trainer(model, config, group)
        params = sum(p.numel() for p in trainer.model.parameters())
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sample, steps = step_figures(trainer, model, args.turns, args.images, args.repeats)
        n_tokens = len(sample.prompt_ids) + len(sample.output_ids)
        peak_gb = peak_memory_mb(device) / 1024
        print(f"train step on {len(sample.prompt_ids)} prompt + {len(sample.output_ids)} reply tokens "
              f"({len(sample.images)} screenshots): {median(steps):.2f} s, {n_tokens / median(steps):.0f} tokens/s, "
              f"peak {peak_gb:.1f} GB ({params / 1e9:.2f} B parameters)", flush=True)
        pub = asyncio.run(time_publications(trainer, model, work, device=args.device, backend=backend,
                                            server_gpu=server_gpu, repeats=args.repeats))
    dist_s, disk_s = median(pub["dist_s"]), median(pub["disk_s"])
    figures = {
        "params_b": params / 1e9, "tokens": n_tokens, "images": len(sample.images), "step_s": median(steps),
        "step_tok_s": n_tokens / median(steps),
        "peak_gb": peak_gb, "dist_s": dist_s, "dist_gb": pub["dist_bytes"][0] / 1e9,
        "dist_gb_s": pub["dist_bytes"][0] / 1e9 / dist_s, "disk_s": disk_s, "disk_gb": pub["disk_bytes"][0] / 1e9,
        "disk_gb_s": pub["disk_bytes"][0] / 1e9 / disk_s, "ratio": disk_s / dist_s,
    }
    print(f"publish over {backend}: {dist_s:.2f} s ({figures['dist_gb_s']:.2f} GB/s of {figures['dist_gb']:.2f} GB); "
          f"by disk: {disk_s:.2f} s ({figures['disk_gb_s']:.2f} GB/s); disk / distributed {figures['ratio']:.1f}x",
          flush=True)
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
