"""`arpo export RUN_DIR --out DIR` with real checkpoints of the real Trainer, then the folder in real consumers.

- Sharded: torchrun with 2 ranks (gloo, FSDP2, tests/rank_driver.py) trains 2 steps and writes ``trainer.dcp``
  (one shard file per rank); the export is compared with the full weights the same run gathered and wrote with
  save_weights, loaded with the lines docs/guides/runs.md shows (transformers: model, tokenizer, image
  processor, and AutoProcessor where torchvision is installed), and served by the real arpo-serve, whose
  /generate log-probs must be the exported model's, not the base model's.
- One rank: the real Checkpointer writes ``step-N`` (trainer.pt, learner.pt, meta.json) after a real train step;
  the export equals the trainer's weights; and the refusals: a non-empty --out, an unknown --step, a torn
  checkpoint, a run without checkpoints, a run folder without config.toml.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from arpo_async.config import LearnerConfig, dump_toml, load_config
from arpo_async.model.checkpoint_names import to_checkpoint_names
from arpo_async.model.inputs import PromptEncoder, load_policy
from arpo_async.tasks import Task
from arpo_async.transport import Outbox
from arpo_cli.cli import main as arpo
from learner.algo.replay import make_replay
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train.checkpoint import Checkpointer, capture
from learner.train.trainer import Trainer
from tests.rank_driver import batch, screenshot
from tests.reference_logprobs import token_logprobs
from tests.support import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "rank_driver.py"
TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "red"}}}})
EMBED = "model.language_model.embed_tokens.weight"  # transformers' name; "model.embed_tokens.weight" on disk


def run_folder(root: Path, model: Path, step: int, trainer_part: Path | None = None) -> Path:
    """A run folder as `arpo run` leaves it: config.toml naming the base model, checkpoints/step-N. With
    ``trainer_part`` (a trainer.pt or trainer.dcp) the step folder is made of it and a meta.json."""
    run = root / f"run-{uuid.uuid4().hex[:6]}"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(dump_toml(load_config(None, [f"run_dir={run}", f"model={model}"])))
    if trainer_part is not None:
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        copy = shutil.copytree if trainer_part.is_dir() else shutil.copy2
        copy(trainer_part, folder / trainer_part.name)
        (folder / "meta.json").write_text(json.dumps({"step": step, "policy_version": step, "trainer_steps": step}))
    return run


def loading_blocks() -> list[str]:
    """The Python code blocks of the "Loading an export" section of docs/guides/runs.md, in order."""
    text = (ROOT / "docs" / "guides" / "runs.md").read_text(encoding="utf-8")
    section = text.split("\n## Loading an export\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_loading_docs(out: Path, tmp_path: Path) -> dict:
    """Run the code blocks of docs/guides/runs.md's "Loading an export" as written, on the export ``out`` and a
    real screenshot (their "exports/demo" and "screenshot.png" replaced): the loading lines; the block without
    torchvision, which must answer; and the AutoProcessor block, which must give the same prompt ids and the same
    greedy reply where torchvision is installed, and fail naming torchvision where it is not (as the page says).
    Returns the names the loading lines define."""
    blocks = loading_blocks()
    assert len(blocks) == 3, blocks
    (tmp_path / "screenshot.png").write_bytes(screenshot("red"))

    def run(block: str, names: dict) -> dict:
        code = block.replace('"exports/demo"', repr(str(out))).replace('"screenshot.png"',
                                                                       repr(str(tmp_path / "screenshot.png")))
        exec(compile(code, "docs/guides/runs.md", "exec"), names)  # noqa: S102 - the page's own lines
        return names

    loaded = run(blocks[0], {})
    plain = run(blocks[2], dict(loaded))
    assert plain["reply"].shape[1] > plain["input_ids"].shape[1]  # it answered
    try:
        import torchvision  # noqa: F401 - only whether it is there
    except ImportError:
        with pytest.raises(ImportError, match="Torchvision"):
            run(blocks[1], dict(loaded))
    else:
        bundled = run(blocks[1], dict(loaded))
        assert torch.equal(bundled["inputs"]["input_ids"], plain["input_ids"])
        assert torch.equal(bundled["reply"], plain["reply"])
    return loaded


async def generate(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/get_model_info") as resp:
            info = await resp.json()
        async with session.post(f"{url}/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return {"info": info, **await resp.json()}


def test_a_sharded_checkpoint_exports_to_a_folder_transformers_loads_and_arpo_serve_serves(tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(DRIVER), str(tiny_model), str(tmp_path / "two"), "--steps", "2", "--save-at", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dcp = tmp_path / "two" / "ckpt" / "trainer.dcp"
    assert len(list(dcp.glob("*.distcp"))) == 2  # one shard file per rank
    run = run_folder(tmp_path, tiny_model, 2, dcp)
    out = tmp_path / "exported"

    done = subprocess.run([sys.executable, "-m", "arpo_cli.cli", "export", str(run), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith(f"exported {run / 'checkpoints' / 'step-000002'} (step 2, policy version 2) to "
                                  f"{out} (float32; base model {tiny_model})\n")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".exported")]  # no temporary folder left

    # the same weights the 2 ranks gathered after the same 2 steps (FSDP2 full_state_dict, save_weights)
    exported, gathered = load_file(out / "model.safetensors"), load_file(tmp_path / "two" / "weights" /
                                                                         "model.safetensors")
    initial = load_file(tiny_model / "model.safetensors")
    assert exported.keys() == gathered.keys() == initial.keys()
    assert all(torch.equal(exported[k], gathered[k]) for k in exported)
    assert max((exported[k] - initial[k]).abs().max().item() for k in exported) > 1e-4  # trained, not the base

    # the lines docs/guides/runs.md shows for loading an export, run as written there
    loaded = run_loading_docs(out, tmp_path)
    model, tokenizer, image_processor = loaded["model"], loaded["tokenizer"], loaded["image_processor"]
    from transformers import AutoImageProcessor
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert torch.equal(model.state_dict()[EMBED], gathered["model.embed_tokens.weight"])
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()  # tied
    assert tokenizer("Action: click").input_ids == PromptEncoder(tiny_model).tokenize("Action: click")
    assert image_processor.to_dict() == AutoImageProcessor.from_pretrained(str(tiny_model)).to_dict()

    encoder = PromptEncoder(out)  # the exported tokenizer, chat template and image processor
    image = screenshot("red")
    ids = encoder.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click red."}]}],
                         [(320, 180)])
    body = {"input_ids": ids, "image_data": [base64.b64encode(image).decode()], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    serve = ServeProcess(out, free_port(), tmp_path)
    serve.start()
    try:
        answer = asyncio.run(generate(serve.url, body))
    finally:
        serve.stop()
    assert answer["info"]["model_path"] == str(out) and answer["info"]["model_type"] == "qwen2_5_vl"
    assert len(answer["output_ids"]) == 8
    served = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
    with torch.no_grad():
        policy, policy_processor = load_policy(out)
        mine = token_logprobs(policy, policy_processor, ids, [image], answer["output_ids"])
        base, base_processor = load_policy(tiny_model)
        theirs = token_logprobs(base, base_processor, ids, [image], answer["output_ids"])
    assert torch.max(torch.abs(served - mine)) < 1e-4  # arpo-serve serves the exported weights...
    assert torch.max(torch.abs(served - theirs)) > 1e-3  # ...not the base model's


def test_a_one_rank_checkpoint_exports_and_bad_requests_are_refused(tiny_model, tmp_path, capsys):
    replay = make_replay("arpo", capacity_per_task=4, seed=1)
    trainer = Trainer(tiny_model, LearnerConfig(lr=1e-3, correction="decoupled", torch_threads=1))
    trainer.train_step(batch(tiny_model, 0))
    service = LearnerService(Outbox(routed=True), GroupScheduler([TASK], group_size=2, seed=5),
                             StalenessManager(2, 1))
    run = run_folder(tmp_path, tiny_model, 1)
    checkpointer = Checkpointer(run / "checkpoints", keep=2)
    checkpointer.save(1, trainer, capture(service, replay), {"policy_version": 1})
    trainer.train_step(batch(tiny_model, 1))
    checkpointer.save(2, trainer, capture(service, replay), {"policy_version": 2})
    assert (run / "checkpoints" / "step-000002" / "trainer.pt").is_file()
    out = tmp_path / "hf"
    out.mkdir()  # an empty folder is fine

    assert arpo(["export", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"exported {run / 'checkpoints' / 'step-000002'} (step 2, policy version 2) to {out} ")
    assert "model.safetensors" in printed.splitlines()[1]
    exported = load_file(out / "model.safetensors")
    want = to_checkpoint_names(trainer.model, {k: v for k, v in trainer.model.state_dict().items()
                                               if k not in trainer.tied})
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)

    # --out holds the export now: refused without --overwrite, replaced with it (here by the older checkpoint)
    assert arpo(["export", str(run), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"arpo export: --out {out} exists and is not empty; pass --overwrite to "
                                       "replace it, or choose another folder\n")
    assert arpo(["export", str(run), "--out", str(out), "--overwrite", "--step", "1", "--dtype", "bfloat16"]) == 0
    assert "(step 1, policy version 1)" in capsys.readouterr().out
    older = load_file(out / "model.safetensors")
    assert older[want_key := "model.embed_tokens.weight"].dtype == torch.bfloat16
    assert not torch.equal(older[want_key].float(), want[want_key].to(torch.bfloat16).float())  # step 1, not 2
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    assert arpo(["export", str(run), "--out", str(tmp_path / "x"), "--step", "7"]) == 2
    assert capsys.readouterr().err == f"arpo export: {run} has no checkpoint of step 7 (it has steps 1, 2)\n"

    (run / "checkpoints" / "step-000002" / "trainer.pt").write_bytes(b"torn")
    assert arpo(["export", str(run), "--out", str(tmp_path / "y")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"arpo export: cannot read checkpoint {run / 'checkpoints' / 'step-000002'}: cannot read ")
    assert err.endswith("; --step 1 exports the one before it\n") and not (tmp_path / "y").exists()

    empty = run_folder(tmp_path, tiny_model, 0)
    assert arpo(["export", str(empty), "--out", str(tmp_path / "z")]) == 2
    assert capsys.readouterr().err.startswith(f"arpo export: {empty} has no checkpoint ")

    (run / "config.toml").unlink()
    assert arpo(["export", str(run), "--out", str(tmp_path / "w"), "--step", "1"]) == 2
    assert "has no config.toml to find the base model in; pass --model DIR" in capsys.readouterr().err
    assert arpo(["export", str(run), "--out", str(tmp_path / "w"), "--step", "1", "--model", str(tiny_model)]) == 0
    assert arpo(["export", str(run), "--out", str(run), "--step", "1", "--model", str(tiny_model)]) == 2
    assert "would replace the run folder" in capsys.readouterr().err
