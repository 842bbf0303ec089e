"""Learner benchmark: training-step throughput at 1 and 2 ranks, peak memory per rank, weight publication time.

What it measures, all in one run on the same batch (32 samples shaped like an arpo trajectory step: a 1280x720
desktop screenshot, the compact prompt, a 12-20 token reply; 8 distinct screenshots, as a group's rollouts
start from the same desktop):

- ``ours_tok_s``: tokens (prompt + completion) per second of ``Trainer.train_step`` on one rank: forward,
  backward, AdamW step (token-budget micro-batches, completion-only chunked fp32 log-probs);
- ``plain_tok_s``: the same tokens through a plain transformers loop: one padded batch through the policy's own
  ``forward`` (logits for every position; the model computes its rotary positions), fp32 log-softmax, a
  policy-gradient loss, backward, AdamW step; pixels computed once beforehand (as a data loader would), so only
  the model work is timed; ``ratio`` = ours / plain (target >= 0.9);
- ``ranks2_tok_s``: ``train_step`` under torchrun with 2 ranks (gloo, FSDP2; on CPU the ranks share the cores);
- ``rss_mb_1``/``rss_mb_2``: peak resident memory per rank on CPU (``torch.cuda.max_memory_allocated`` on CUDA);
- ``publish_disk_s``/``publish_dist_s``: one weight publication to a real arpo-serve holding bf16 weights, disk
  (save the folder, ``/update_weights_from_disk``) vs distributed (gather, broadcast over a gloo weight group), in
  the served dtype (``learner.publish_dtype = "served"``); target <= 0.5 s. ``publish_disk_f32_s`` /
  ``publish_dist_f32_s``: the same with the float32 master weights (the baseline); ``publish_mb`` /
  ``publish_f32_mb`` (distributed) and ``publish_disk_mb`` / ``publish_disk_f32_mb``: what each sends or writes;
  ``publish_bytes_ratio`` = served / float32 (0.5 for bf16).

Medians over ``--repeats`` steps after one warm-up step. ``--quick`` is the smoke mode CI runs (2 repeats).

Usage:
  python -m bench.bench_learner              # 10 repeats
  python -m bench.bench_learner --quick      # smoke mode (about a minute)
  python -m bench.bench_learner --model runs/tiny-model --device cuda   # on a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._arpo_run import ROOT, ensure_model
from bench._common import desktop_png, median, result_line

COLOURS = ("Red", "Blue", "Green", "Yellow", "Purple", "Orange", "Black", "White")


def make_batch(model: Path, n: int = 32, seed: int = 0) -> list:
    """``n`` TrainSamples: 8 distinct desktop screenshots, the compact prompt, 12-20 reply tokens each."""
    from arpo_async.model.inputs import PromptEncoder
    from learner.train.trainer import TrainSample

    encoder = PromptEncoder(model)
    rng = random.Random(seed)
    shots = [desktop_png(i) for i in range(8)]
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "GUI agent."},
                    {"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": f"Click the {COLOURS[i % 8]} button."}]}]
        prompt = encoder.encode(messages, [(1280, 720)])
        reply = encoder.tokenize(f"T\nAction: click(start_box='({rng.randrange(1000):03d},{rng.randrange(1000):03d})')"
                                 + "<|im_end|>")[: rng.randint(12, 20)]
        out.append(TrainSample(prompt, [shots[i % 8]], reply, [-2.0] * len(reply), rng.choice((-1.0, 1.0))))
    return out


def tokens(samples: list) -> int:
    return sum(len(s.prompt_ids) + len(s.output_ids) for s in samples)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def time_ours(model: Path, samples: list, repeats: int, device: str, threads: int) -> tuple[list[float], float]:
    from arpo_async.config import LearnerConfig
    from learner.train.trainer import Trainer

    trainer = Trainer(model, LearnerConfig(lr=1e-5, device=device, torch_threads=threads))
    trainer.train_step(samples)  # warm-up (fills the pixel cache, as the learner's steady state does)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - started)
    return times, peak_memory_mb(trainer.device)


def time_plain(model: Path, samples: list, repeats: int, device: str, threads: int) -> list[float]:
    """A plain transformers step on the same tokens: full-logit forward, fp32 log-softmax, backward, AdamW."""
    from arpo_async.model.inputs import load_policy, pixel_inputs
    from learner.train.trainer import resolve_device

    torch.set_num_threads(threads)
    dev = resolve_device(device)
    policy, processor = load_policy(model)
    policy.to(dev)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5, weight_decay=0.01)
    seqs = [s.prompt_ids.tolist() + s.output_ids.tolist() for s in samples]  # the plain way: Python lists
    width = max(map(len, seqs))
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    pixels = pixel_inputs(processor, [im for s in samples for im in s.images])
    # as a plain loop calls it: the model works out its multimodal rotary positions itself, every forward
    kw = {k: v.to(dev) for k, v in {"input_ids": ids, "attention_mask": mask, **pixels}.items()}
    rows = torch.tensor([b for b, s in enumerate(samples) for _ in s.output_ids], device=dev)
    cols = torch.tensor([len(s.prompt_ids) - 1 + t for s in samples for t in range(len(s.output_ids))], device=dev)
    targets = torch.tensor([t for s in samples for t in s.output_ids.tolist()], device=dev)
    advantages = torch.tensor([s.advantage for s in samples for _ in s.output_ids], device=dev)

    def step() -> None:
        logp = torch.log_softmax(policy(**kw, use_cache=False).logits.float(), dim=-1)
        chosen = logp[rows, cols].gather(-1, targets[:, None]).squeeze(-1)
        loss = -(advantages * torch.exp(chosen - chosen.detach())).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()

    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def rank_worker(model: Path, repeats: int, device: str, threads: int) -> int:
    """Under torchrun: every rank trains; rank 0 prints ``RANKS {json}`` (step times, peak memory per rank)."""
    import torch.distributed as dist

    from arpo_async.config import LearnerConfig
    from learner.train.distributed import init_ranks, leave
    from learner.train.lead_trainer import LeadTrainer, follow
    from learner.train.trainer import Trainer, resolve_device

    group = init_ranks(resolve_device(device), timeout_s=300)
    trainer = Trainer(model, LearnerConfig(lr=1e-5, device=device, torch_threads=threads), group)
    if not group.lead:
        code = follow(trainer, group)
    else:
        lead = LeadTrainer(trainer, group, timeout_s=300)
        samples = make_batch(model)
        lead.train_step(samples)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            lead.train_step(samples)
            times.append(time.perf_counter() - started)
        lead.stop()
        code = 0
    memory: list[float | None] = [None] * group.world
    dist.all_gather_object(memory, peak_memory_mb(trainer.device))
    if group.lead:
        print("RANKS " + json.dumps({"times": times, "memory_mb": memory}), flush=True)
    dist.destroy_process_group()
    leave(code)


def time_ranks(model: Path, ranks: int, repeats: int, device: str, threads: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "bench.bench_learner", "--worker", "--model", str(model), "--repeats", str(repeats),
           "--device", device, "--threads", str(threads)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RANKS ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{ranks}-rank run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[-1][len("RANKS "):])


async def time_publish(model: Path, repeats: int, work: Path) -> dict[str, list[float]]:
    """Seconds and bytes of one publication to a real arpo-serve holding bf16 weights (``--dtype bfloat16``, as
    SGLang serves a model): disk (save + load) and distributed (gather + broadcast), each with
    ``learner.publish_dtype = "served"`` (bf16 goes out) and "float32" (the master weights: the baseline)."""
    from arpo_async.config import LearnerConfig
    from arpo_async.inference_client import PolicyClient
    from arpo_async.sglang_engine import sglang_engines
    from arpo_cli.launcher import spawn, stop, wait_healthy
    from learner.train.publish_dtype import PublishDtypes
    from learner.train.publisher import DistributedPublisher, WeightPublisher
    from learner.train.trainer import Trainer

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    serve = await spawn([sys.executable, "-m", "arpo_serve.main", "--model", str(model), "--port", str(port),
                         "--dtype", "bfloat16"], work / "serve.log")
    try:
        await wait_healthy(url, serve, work / "serve.log")
        trainer = Trainer(model, LearnerConfig(lr=1e-5))
        out: dict[str, list[float]] = {}
        version = 0
        async with PolicyClient([url]) as client:
            for mode in ("float32", "served"):
                dtypes = PublishDtypes(served=mode == "served")
                disk = WeightPublisher(sglang_engines(client), work / f"weights-{mode}", dtypes=dtypes)
                net = DistributedPublisher(sglang_engines(client), dtypes=dtypes)
                version += 1
                await net.publish_from(trainer, version)  # makes the group (once per publisher), not timed
                for _ in range(repeats):
                    version += 1
                    started = time.perf_counter()
                    await disk.publish_from(trainer, version)
                    out.setdefault(f"disk_{mode}_s", []).append(time.perf_counter() - started)
                    started = time.perf_counter()
                    await net.publish_from(trainer, version)
                    out.setdefault(f"dist_{mode}_s", []).append(time.perf_counter() - started)
                out[f"disk_{mode}_bytes"], out[f"dist_{mode}_bytes"] = [disk.bytes_published], [net.bytes_published]
                if net.failures:
                    raise RuntimeError(f"{net.failures} distributed syncs failed; see {work / 'serve.log'}")
        return out
    finally:
        await stop(serve, grace_s=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke mode: 2 repeats")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "tiny-model", help="created when missing")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return rank_worker(args.model, args.repeats, args.device, args.threads)
    repeats = 2 if args.quick else args.repeats
    model = ensure_model(args.model)
    samples = make_batch(model)
    n_tokens = tokens(samples)
    print(f"batch: {len(samples)} samples, {n_tokens} tokens; {repeats} timed steps each", flush=True)

    ours, rss_1 = time_ours(model, samples, repeats, args.device, args.threads)
    plain = time_plain(model, samples, repeats, args.device, args.threads)
    ranks = time_ranks(model, 2, repeats, args.device, args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as work:
        pub = asyncio.run(time_publish(model, repeats, Path(work)))

    figures = {
        "ours_tok_s": n_tokens / median(ours), "plain_tok_s": n_tokens / median(plain),
        "ratio": median(plain) / median(ours), "ranks2_tok_s": n_tokens / median(ranks["times"]),
        "rss_mb_1": rss_1, "rss_mb_2": max(ranks["memory_mb"]),
        "publish_disk_s": median(pub["disk_served_s"]), "publish_dist_s": median(pub["dist_served_s"]),
        "publish_disk_f32_s": median(pub["disk_float32_s"]), "publish_dist_f32_s": median(pub["dist_float32_s"]),
        "publish_mb": pub["dist_served_bytes"][0] / 2**20, "publish_f32_mb": pub["dist_float32_bytes"][0] / 2**20,
        "publish_disk_mb": pub["disk_served_bytes"][0] / 2**20,
        "publish_disk_f32_mb": pub["disk_float32_bytes"][0] / 2**20,
        "publish_bytes_ratio": pub["dist_served_bytes"][0] / pub["dist_float32_bytes"][0],
    }
    print(f"one rank: {median(ours) * 1e3:.0f} ms/step; plain transformers: {median(plain) * 1e3:.0f} ms/step; "
          f"2 ranks: {median(ranks['times']) * 1e3:.0f} ms/step; publish to a bf16 server: disk "
          f"{figures['publish_disk_s'] * 1e3:.0f} ms (float32: {figures['publish_disk_f32_s'] * 1e3:.0f} ms), "
          f"distributed {figures['publish_dist_s'] * 1e3:.0f} ms (float32: {figures['publish_dist_f32_s'] * 1e3:.0f} "
          f"ms), {figures['publish_mb']:.1f} MB (float32: {figures['publish_f32_mb']:.1f} MB)", flush=True)
    print(result_line(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
