"""The GPU smoke test's driver (scripts/gpu_smoke.sh; a test driver, so it lives in tests/): our learner against a
running SGLang server, 3 steps.

Each step samples a group of replies to one fixed screenshot prompt from the server (``/generate`` with
``input_ids`` holding one image pad per image, ``image_data`` and ``return_logprob``, as the actors send it; the
trainer gets the expanded ids), computes the trainer's own
log-probs of the same tokens, trains one optimizer step on the group, publishes the new weights with
``learner.weight_sync = "distributed"`` (SGLang's group, session and checkpoint names) and
``learner.verify_weights_every = 1`` (the server's /weights_checker checksums against the learner's), and checks
that the server reports the new weight version. It prints one line per step and a last line ``PASS`` or
``FAIL: <why>``, with the sampler/trainer log-prob agreement (mean and max absolute difference per token, nats).

    python -m tests.gpu_smoke --url http://127.0.0.1:30000 --model MODEL_DIR [--device cuda] [--steps 3] [--fsdp]
    python -m tests.gpu_smoke --plan     # prints "BACKEND SERVER_GPU": how the weight group can run here

``--fsdp`` shards the trainer with FSDP2 on one rank (learner.train.distributed.init_one_rank_fsdp). ``--plan``
prints arpo_async.weight_sync.weight_group_plan: nccl with the server on a second GPU when there is one; nccl on
the same GPU when NCCL is 2.30 or newer (with NCCL_MULTI_RANK_GPU_ENABLE=1: older NCCL refuses two ranks on one
GPU, "Duplicate GPU detected"); else gloo, which moves the same bytes through host memory.

Exit status: 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from arpo_async.config import LearnerConfig
from arpo_async.inference_client import PolicyClient, PolicyRequestError, PolicyUnavailable, RetryPolicy
from arpo_async.model.inputs import PromptEncoder
from arpo_async.sglang_engine import SGLangEngine
from arpo_async.weight_sync import weight_group_plan
from learner.train.distributed import RankGroupError, init_one_rank_fsdp
from learner.train.publisher import DistributedPublisher, PublishError
from learner.train.trainer import Trainer, TrainSample, resolve_device

LOGPROB_TOLERANCE = 0.5
"""Most mean absolute difference (nats per token) between the sampler's and the trainer's log-probs that passes;
bf16 kernels on two engines differ by far less, a wrong weight or a wrong prompt by far more."""


def screenshot() -> bytes:
    image = Image.new("RGB", (1280, 720), "white")
    ImageDraw.Draw(image).rectangle([100, 100, 400, 300], fill="green")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


async def smoke(url: str, model: Path, *, device: str, backend: str, steps: int, group: int,
                fsdp: bool = False) -> str | None:
    """Run the smoke test; returns None on success, else why it failed. ``fsdp``: shard the trainer with FSDP2
    on one rank."""
    encoder = PromptEncoder(model)
    image = screenshot()
    content = [{"type": "image"}, {"type": "text", "text": "Click the green button."}]
    prompt = encoder.encode([{"role": "user", "content": content}], [(1280, 720)])
    config = LearnerConfig(lr=1e-3, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    ranks = init_one_rank_fsdp(resolve_device(device)) if fsdp else None
    trainer = Trainer(model, config, ranks)
    retry = RetryPolicy(attempts=3, request_timeout_s=120.0, admin_timeout_s=300.0)
    async with PolicyClient([url], retry=retry) as client:
        engine = SGLangEngine(client, url)
        publisher = DistributedPublisher([engine], bucket_mb=64, backend=backend, timeout_s=300.0, verify_every=1)
        worst = 0.0
        for step in range(1, steps + 1):
            replies = [await client.generate(input_ids=encoder.collapse_image_pads(prompt), images=[image],
                                             rid=f"smoke-{step}-{i}",
                                             episode_id="smoke", sampling_params={"max_new_tokens": 16,
                                                                                  "temperature": 1.0})
                       for i in range(group)]
            samples = [TrainSample(prompt, [image], r.output_ids, r.logprobs, advantage=1.0 if i % 2 else -1.0)
                       for i, r in enumerate(replies) if r.output_ids]
            if not samples:
                return f"step {step}: the server returned no tokens"
            mine = await asyncio.to_thread(trainer.compute_logprobs, samples)
            diffs = [abs(a - b) for s, m in zip(samples, mine) for a, b in zip(s.behaviour_logprobs, m)]
            mean, peak = sum(diffs) / len(diffs), max(diffs)
            worst = max(worst, mean)
            await asyncio.to_thread(trainer.train_step, samples)
            seconds = await publisher.publish_from(trainer, step)
            served = (await engine.server_info()).get("weight_version")
            print(f"step {step}: {len(diffs)} tokens, sampler/trainer |dlogp| mean {mean:.4f} max {peak:.4f} nats; "
                  f"published v{step} in {seconds:.2f} s, checksums agree on {publisher.verified} syncs; "
                  f"server weight_version {served}", flush=True)
            if publisher.failures:
                return f"step {step}: the weight sync failed (see the log line above)"
            if str(served) != str(step):
                return f"step {step}: the server reports weight_version {served!r}, not {step}"
        if worst > LOGPROB_TOLERANCE:
            return f"sampler/trainer log-probs differ by {worst:.3f} nats per token on average (> {LOGPROB_TOLERANCE})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the inference server (SGLang, or arpo-serve)")
    parser.add_argument("--model", type=Path, help="the checkpoint the server serves")
    parser.add_argument("--device", default="cuda", help="the learner's device (cuda, or cpu for a dry run)")
    parser.add_argument("--backend", default=None, help="weight group backend (default: nccl on cuda, else gloo)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group", type=int, default=4, help="replies sampled per step")
    parser.add_argument("--fsdp", action="store_true", help="shard the trainer with FSDP2 on one rank")
    parser.add_argument("--plan", action="store_true", help="print the weight group's backend and the server's GPU")
    args = parser.parse_args(argv)
    if args.plan:
        print(*weight_group_plan())
        return 0
    if args.url is None or args.model is None:
        parser.error("--url and --model are required")
    backend = args.backend or ("nccl" if args.device.startswith("cuda") else "gloo")
    print(f"trainer on {args.device}{' (FSDP2, one rank)' if args.fsdp else ''}; weight group over {backend}",
          flush=True)
    try:
        why = asyncio.run(smoke(args.url, args.model, device=args.device, backend=backend, steps=args.steps,
                                group=args.group, fsdp=args.fsdp))
    except (PublishError, PolicyUnavailable, PolicyRequestError, RankGroupError) as error:
        why = f"{type(error).__name__}: {error}"
    print("PASS" if why is None else f"FAIL: {why}", flush=True)
    return 0 if why is None else 1


if __name__ == "__main__":
    sys.exit(main())
