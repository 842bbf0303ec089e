"""`arpo export` against hostile folders and checkpoints: real run folders, real checkpoints of the real Trainer, the
real `arpo export` (its main function; in a subprocess with a deadline where a hang matters).

- ``--overwrite`` replaces only an earlier export holding nothing but what it wrote: a folder of photos and source
  code, the run's checkpoints, another run's checkpoints with a forged marker, an export with a file added, and
  symlinks to them are refused with one line, and every byte of them stays;
- a checkpoint with a NaN or infinite tensor (or one that overflows in float16) is refused naming the tensor, and
  an earlier export in ``--out`` stays as it was;
- a FIFO or a device given as a checkpoint file or a base model file is refused at once, never opened;
- every exported file has the same mode, 0666 less the umask.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arpo_async.config import LearnerConfig, dump_toml, load_config
from arpo_cli.cli import main as arpo
from learner.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 240  # a refusal takes seconds (importing torch); a hang on a FIFO would take forever
NO_MARKER = ("is not empty and is not an earlier arpo export (no arpo-export.json); choose another folder, "
             "or an empty one")


@pytest.fixture(scope="module")
def trainer_state(tiny_model):
    """What the real Trainer writes as ``trainer.pt`` (one rank) for the tiny model."""
    return Trainer(tiny_model, LearnerConfig(lr=1e-3, correction="decoupled", torch_threads=1)).state_dict()


def make_run(root: Path, name: str, model: Path, state: dict) -> Path:
    """A run folder as `arpo run` leaves it: config.toml naming the base model, logs/, metrics.jsonl and
    checkpoints/step-000001 (trainer.pt of ``state``, meta.json)."""
    run = root / name
    step = run / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "config.toml").write_text(dump_toml(load_config(None, [f"run_dir={run}", f"model={model}"])))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    torch.save(state, step / "trainer.pt")
    (step / "meta.json").write_text(json.dumps({"step": 1, "policy_version": 1}))
    return run


def tree(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder`` (not following symlinks): file bytes, ``link -> target`` or ``dir``."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = (f"link -> {os.readlink(path)}" if path.is_symlink() else "dir" if path.is_dir()
                      else path.read_bytes())
    return found


def with_tensor(state: dict, key: str, *values: float) -> dict:
    """A copy of ``state`` whose model tensor ``key`` starts with ``values``."""
    tensor = state["model"][key].clone()
    tensor.view(-1)[:len(values)] = torch.tensor(values)
    return {**state, "model": {**state["model"], key: tensor}}


def test_overwrite_replaces_only_an_earlier_export_never_photos_runs_or_symlinks(tiny_model, trainer_state, tmp_path,
                                                                                 capsys):
    run = make_run(tmp_path, "run", tiny_model, trainer_state)
    other = make_run(tmp_path, "other-run", tiny_model, trainer_state)
    photos = tmp_path / "photos"
    (photos / "2024" / "01").mkdir(parents=True)
    (photos / "2024" / "01" / "holiday.jpg").write_bytes(b"\xff\xd8\xff\xe0 a holiday")
    (photos / "src" / "proj" / "2").mkdir(parents=True)
    (photos / "src" / "proj" / "2" / "main.c").write_text("int main(void) { return 0; }\n")
    # a forged marker in another run's checkpoints, listing what is there
    (other / "checkpoints" / "arpo-export.json").write_text(json.dumps({"format": "arpo-export",
                                                                        "files": ["step-000001"]}))
    (tmp_path / "link-to-checkpoints").symlink_to(other / "checkpoints")
    (tmp_path / "link-to-run").symlink_to(other)
    before = tree(tmp_path)

    refused = {
        photos: f"--out {photos} {NO_MARKER}",
        photos / "2024": f"--out {photos / '2024'} {NO_MARKER}",
        run: f"--out {run} would replace the run folder {run}; choose another folder",
        run / "checkpoints": f"--out {run / 'checkpoints'} is inside the run folder {run}; choose a folder outside it",
        run / "checkpoints" / "step-000001": f"--out {run / 'checkpoints' / 'step-000001'} is inside the run folder "
                                             f"{run}; choose a folder outside it",
        other / "checkpoints": f"--out {other / 'checkpoints'} is inside the run folder {other} (it holds config.toml "
                               "and what arpo run writes); choose a folder outside any run folder",
        other / "new": f"--out {other / 'new'} is inside the run folder {other} (it holds config.toml and what arpo "
                       "run writes); choose a folder outside any run folder",
        tmp_path / "link-to-checkpoints": f"--out {tmp_path / 'link-to-checkpoints'} is a symbolic link (to "
                                          f"{other / 'checkpoints'}); export writes only into a real folder: pass "
                                          "the folder itself",
        tmp_path / "link-to-run" / "checkpoints": f"--out {tmp_path / 'link-to-run' / 'checkpoints'} is inside the "
                                                  f"run folder {tmp_path / 'link-to-run'} (it holds config.toml and "
                                                  "what arpo run writes); choose a folder outside any run folder",
    }
    for out, message in refused.items():
        for extra in (["--overwrite"], []):
            assert arpo(["export", str(run), "--out", str(out), *extra]) == 2, out
            assert capsys.readouterr().err == f"arpo export: {message}\n"
    assert tree(tmp_path) == before  # every photo, source file, checkpoint and link as it was

    # an earlier export is replaced, atomically, and its manifest says what it holds
    export = tmp_path / "export"
    assert arpo(["export", str(run), "--out", str(export)]) == 0
    manifest = json.loads((export / "arpo-export.json").read_text())
    assert manifest["files"] == sorted(p.name for p in export.iterdir() if p.name != "arpo-export.json")
    assert "model.safetensors" in manifest["files"] and manifest["format"] == "arpo-export"
    assert (manifest["run"], manifest["step"], manifest["policy_version"]) == (str(run), 1, 1)
    assert arpo(["export", str(other), "--out", str(export), "--overwrite"]) == 0
    assert json.loads((export / "arpo-export.json").read_text())["run"] == str(other)
    capsys.readouterr()

    # ... but not through a symlink, nor when it holds anything the export did not write
    (tmp_path / "link-to-export").symlink_to(export)
    (export / "notes.txt").write_text("mine")
    (export / "sub").mkdir()
    kept = tree(export)
    assert arpo(["export", str(run), "--out", str(tmp_path / "link-to-export"), "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith(f"arpo export: --out {tmp_path / 'link-to-export'} is a symbolic link")
    assert arpo(["export", str(run), "--out", str(export), "--overwrite"]) == 2
    name = capsys.readouterr().err.removeprefix(f"arpo export: --out {export} holds ").split(",")[0]
    assert name in ("notes.txt", "sub")
    assert arpo(["export", str(run), "--out", str(export)]) == 2  # and never without --overwrite
    assert capsys.readouterr().err == (f"arpo export: --out {export} exists and is not empty; pass --overwrite to "
                                       "replace it, or choose another folder\n")
    assert tree(export) == kept
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export")]  # no temporary folder left


def test_nan_or_infinite_weights_are_refused_naming_the_tensor(tiny_model, trainer_state, tmp_path, capsys):
    key = next(k for k, v in trainer_state["model"].items() if "layers.0." in k and v.dim() == 2)
    size = trainer_state["model"][key].numel()
    good = make_run(tmp_path, "good", tiny_model, trainer_state)
    export = tmp_path / "export"
    assert arpo(["export", str(good), "--out", str(export), "--dtype", "float32"]) == 0
    capsys.readouterr()
    kept = tree(export)

    cases = {
        "nan": ((float("nan"), float("nan")), [], "2 NaN and 0 infinite values", "in checkpoint {folder}"),
        "inf": ((float("inf"), float("-inf"), 1.0), [], "0 NaN and 2 infinite values", "in checkpoint {folder}"),
        "overflow": ((1e6,), ["--dtype", "float16"], "0 NaN and 1 infinite values", "once cast to float16 (--dtype)"),
    }
    for name, (values, extra, counts, where) in cases.items():
        run = make_run(tmp_path, name, tiny_model, with_tensor(trainer_state, key, *values))
        folder = run / "checkpoints" / "step-000001"
        for out in (export, tmp_path / f"new-{name}"):  # over an earlier export, and into a new folder
            assert arpo(["export", str(run), "--out", str(out), "--overwrite", *extra]) == 1, name
            assert capsys.readouterr().err == (f"arpo export: tensor {key} holds {counts} of {size} "
                                               f"{where.format(folder=folder)}; not exported\n")
        assert tree(export) == kept and not (tmp_path / f"new-{name}").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".export", ".new-"))]
    # 1e6 is a finite float32: exported as such
    assert arpo(["export", str(tmp_path / "overflow"), "--out", str(export), "--overwrite", "--dtype", "float32"]) == 0


EXPORTS = """import contextlib, io, json, sys
from arpo_cli.cli import main
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["export", *args])
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""
"""Runs `arpo export`'s main function once per argument list of argv[1] (JSON) in one process, so several
refusals pay one import of torch; prints [exit code, stderr] per list as JSON."""


def test_a_fifo_or_device_as_an_input_file_is_refused_at_once(tiny_model, trainer_state, tmp_path):
    """Every case in one process (one torch import) within DEADLINE_S: a FIFO opened for reading would block it
    for good, and /dev/zero would be read without end, so a regression still fails at the deadline."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model, base)
    os.unlink(base / "config.json")
    os.mkfifo(base / "config.json")
    cases = []
    for name, target in (("fifo", None), ("zero", "/dev/zero")):
        run = make_run(tmp_path, name, tiny_model, trainer_state)
        trainer_pt = run / "checkpoints" / "step-000001" / "trainer.pt"
        trainer_pt.unlink()
        os.mkfifo(trainer_pt) if target is None else trainer_pt.symlink_to(target)
        kind = "a FIFO" if target is None else "a character device"
        cases.append(([str(run)], f"checkpoint file {trainer_pt} is {kind}"))
    meta_run = make_run(tmp_path, "meta", tiny_model, trainer_state)
    meta = meta_run / "checkpoints" / "step-000001" / "meta.json"
    meta.unlink()
    os.mkfifo(meta)
    cases.append(([str(meta_run)], f"checkpoint file {meta} is a FIFO"))
    no_meta = make_run(tmp_path, "no-meta", tiny_model, trainer_state)  # its checkpoint readable: on to the base
    (no_meta / "checkpoints" / "step-000001" / "meta.json").unlink()
    cases.append(([str(no_meta), "--model", str(base)], f"base model file {base / 'config.json'} is a FIFO"))
    out = str(tmp_path / "out")
    done = subprocess.run([sys.executable, "-c", EXPORTS, json.dumps([[*args, "--out", out] for args, _ in cases])],
                          cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE_S)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr[-4000:]  # nothing but the refusals (below)
    assert json.loads(done.stdout.splitlines()[-1]) == [
        [1, f"arpo export: {what}, not a regular file; export reads regular files only\n"] for _, what in cases]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_every_exported_file_has_the_same_mode(tiny_model, trainer_state, tmp_path, umask):
    """The export's main function under ``umask`` (set in this process for the call, restored after)."""
    run = make_run(tmp_path, "run", tiny_model, trainer_state)
    previous = os.umask(umask)
    try:
        assert arpo(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "out").iterdir()}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))  # safetensors alone wrote 0600 before
    assert {"model.safetensors", "config.json", "tokenizer.json", "arpo-export.json"} <= modes.keys()
