"""``arpo export RUN_DIR --out DIR``: a run's newest learner checkpoint as a Hugging Face folder.

The folder holds ``model.safetensors`` (the trained policy), ``config.json``, ``generation_config.json`` and the
tokenizer, chat-template and processor files, so ``transformers`` (``AutoModelForImageTextToText``,
``AutoProcessor``), arpo-serve and SGLang load it. It is made from the checkpoint alone
(``RUN_DIR/checkpoints/step-N/trainer.pt``, or ``trainer.dcp`` when the learner ran on several ranks: every rank's
shards are joined in this one process, learner.train.train_state.read_model_weights), so it works for a run with
``learner.weight_sync = "distributed"``, which writes no ``weights/vN`` folders. The model's config and processor
files come from the model the run started from: the ``model`` of ``RUN_DIR/config.toml``, or ``--model DIR``.

The folder also holds ``arpo-export.json`` (arpo_cli.export_folder.MANIFEST: the run, checkpoint, step, policy
version, base model, dtype and the files written). ``--overwrite`` replaces only such an earlier export, and only
when it holds nothing but the files its manifest lists; never a run folder or anything inside one, never a folder
reached through a symlink (arpo_cli.export_folder.check_out). The replacement is atomic, so a failed export leaves
the earlier one as it was. Every file read must be a regular file (a FIFO or a device is refused, never opened);
weights that are NaN or infinite, in the checkpoint or after the cast to ``--dtype``, are refused with the tensor's
name. Every file written gets the same mode (``0666`` less the umask).

Exit status: 0 written; 1 the checkpoint or the base model could not be read (or is not a regular file, or holds
NaN or infinite weights), or the folder not written; 2 a bad argument (no run folder, no checkpoint, an unknown
``--step``, an ``--out`` that may not be written or replaced: see above).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_cli.export_folder import ExportError, check_inputs, check_out, write_manifest

__all__ = ["DTYPES", "ExportError", "Exported", "add_export_parser", "export_checkpoint", "export_main"]

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Exported:
    """What :func:`export_checkpoint` wrote: the folder, the checkpoint it came from, its optimizer step and
    policy version (None when the checkpoint's meta.json lacks it), the base model folder and the dtype."""

    out: Path
    checkpoint: Path
    step: int
    policy_version: int | None
    model: Path
    dtype: str


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``arpo export`` to the CLI's subcommands."""
    p = sub.add_parser(
        "export", help="write a run's newest checkpoint as a Hugging Face folder (safetensors, config, processor)",
        description="Write the policy of RUN_DIR's newest learner checkpoint (RUN_DIR/checkpoints/step-N, one rank "
                    "or sharded over several) as a Hugging Face folder: model.safetensors, config.json, "
                    "generation_config.json and the tokenizer/processor files of the run's base model. "
                    "transformers, arpo-serve and SGLang load it. Works for every run, also one with "
                    "learner.weight_sync=\"distributed\" (which writes no weights/vN folders).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run folder, e.g. runs/demo")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="the folder to write (must not exist or be empty, unless --overwrite); never a run folder "
                        "or inside one, never a symlink")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out when it is an earlier export (it holds arpo-export.json and only the files "
                        "that lists); any other non-empty folder is refused")
    p.add_argument("--step", type=int, metavar="N",
                   help="export checkpoint step-N instead of the newest (see RUN_DIR/checkpoints)")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="the base model folder for config.json and the processor files (default: the model of "
                        "RUN_DIR/config.toml)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="dtype of the written weights (default auto: the base model's config dtype, e.g. "
                        "bfloat16 for UI-TARS-1.5-7B; the checkpoint holds float32)")


def export_main(args: argparse.Namespace) -> int:
    """Run ``arpo export`` from parsed arguments; prints what was written. Returns the exit status."""
    try:
        done = export_checkpoint(args.run_dir, args.out, overwrite=args.overwrite, step=args.step,
                                 model=args.model, dtype=args.dtype)
    except ExportError as error:
        print(f"arpo export: {error}", file=sys.stderr)
        return error.code
    version = "unknown" if done.policy_version is None else done.policy_version
    files = ", ".join(sorted(p.name for p in done.out.iterdir()))
    print(f"exported {done.checkpoint} (step {done.step}, policy version {version}) to {done.out} "
          f"({done.dtype}; base model {done.model})\n{files}")
    return 0


def export_checkpoint(run_dir: Path, out: Path, *, overwrite: bool = False, step: int | None = None,
                      model: Path | None = None, dtype: str = "auto") -> Exported:
    """Write the policy of a run's newest checkpoint (or checkpoint ``step``) as a Hugging Face folder ``out``.

    The weights are read with learner.train.train_state.read_model_weights (``trainer.pt``, or a sharded
    ``trainer.dcp`` joined in this process), put into the base model's architecture (built from its
    ``config.json`` without loading its weights; every weight must fit, none may be missing) and written by
    learner.train.weights_export.write_folder (atomically: a temporary sibling renamed into place) with the
    manifest ``arpo-export.json`` (arpo_cli.export_folder). Nothing is written before every check has passed.

    Args:
        run_dir: the run folder (``checkpoints/``, ``config.toml``).
        out: the folder to write; it must not exist or be empty unless ``overwrite`` (arpo_cli.export_folder.check_out).
        overwrite: replace ``out`` when it is an earlier export.
        step: the checkpoint ``step-<step>`` to export; None = the newest.
        model: the base model folder (config and processor files); None = ``model`` of ``run_dir/config.toml``.
        dtype: one of :data:`DTYPES`; "auto" = the base model config's dtype (float32 when it names none).

    Returns:
        An :class:`Exported`.

    Raises:
        ExportError: no run folder or checkpoint, an unknown ``step``, an ``out`` that may not be written or
            replaced (code 2); an unreadable checkpoint or base model, an input that is not a regular file, weights
            that do not fit the model or are NaN or infinite, or a write failure (code 1).
    """
    from learner.train.checkpoint import checkpoint_folders
    from learner.train.train_state import read_model_weights
    from learner.train.trainer_errors import TrainerError

    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise ExportError(f"no run folder {run_dir}", 2)
    folders = checkpoint_folders(run_dir / "checkpoints")
    if not folders:
        raise ExportError(f"{run_dir} has no checkpoint ({run_dir / 'checkpoints'} holds no step-N folder; the "
                          "learner writes one every learner.checkpoint_every optimizer steps, if not 0)", 2)
    steps = [int(f.name.split("-", 1)[1]) for f in folders]
    if step is None:
        folder = folders[-1]
    elif step in steps:
        folder = folders[steps.index(step)]
    else:
        raise ExportError(f"{run_dir} has no checkpoint of step {step} (it has steps "
                          f"{', '.join(map(str, steps))})", 2)
    base = Path(model) if model is not None else _base_model(run_dir)
    check_out(out, overwrite, run_dir, base)

    trainer_part = next((folder / name for name in ("trainer.pt", "trainer.dcp") if (folder / name).exists()), None)
    older = f"; --step {steps[-2]} exports the one before it" if folder == folders[-1] and len(steps) > 1 else ""
    if trainer_part is None:
        raise ExportError(f"checkpoint {folder} holds no trainer.pt or trainer.dcp (not a learner checkpoint?)"
                          + older)
    from learner.train.weights_export import PROCESSOR_FILES, write_folder
    check_inputs(trainer_part, folder / "meta.json", base, PROCESSOR_FILES)
    meta = _meta(folder)
    try:
        weights = read_model_weights(trainer_part)
    except (TrainerError, OSError) as error:
        raise ExportError(f"cannot read checkpoint {folder}: {error}{older}") from error

    policy, name = _policy(base, weights, dtype, folder)
    version = meta.get("policy_version")
    done = Exported(out=out, checkpoint=folder, step=int(meta.get("step", steps[folders.index(folder)])),
                    policy_version=int(version) if isinstance(version, int) else None, model=base, dtype=name)
    record = {"run": str(run_dir.resolve()), "checkpoint": str(folder.resolve()), "step": done.step,
              "policy_version": done.policy_version, "model": str(base.resolve()), "dtype": name}
    try:
        write_folder(policy, out, base, finish=lambda tmp: write_manifest(tmp, record))
    except OSError as error:
        raise ExportError(f"cannot write {out}: {error}") from error
    return done


def _base_model(run_dir: Path) -> Path:
    """The ``model`` folder of ``run_dir/config.toml`` (``arpo run`` records it resolved)."""
    from arpo_async.config import ConfigError, load_config

    config_file = run_dir / "config.toml"
    if not config_file.is_file():
        raise ExportError(f"{run_dir} has no config.toml to find the base model in; pass --model DIR (the "
                          "Hugging Face folder the run started from)", 2)
    try:
        config = load_config(config_file)
    except ConfigError as error:
        raise ExportError(f"cannot read {config_file}: {error}; pass --model DIR", 2) from error
    base = config.model_path
    if not (base / "config.json").is_file():
        raise ExportError(f"the run's base model {base} (model in {config_file}) has no config.json; pass --model "
                          "DIR (the Hugging Face folder the run started from)", 2)
    return base


def _meta(folder: Path) -> dict[str, Any]:
    """The checkpoint's meta.json (step, policy_version), or {} when it is unreadable (the weights still are)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _policy(base: Path, weights: dict[str, Any], dtype: str, folder: Path):
    """The base model's architecture holding ``weights`` (cast to ``dtype``), and the dtype's name.

    Built on the meta device from ``base/config.json`` (no base weights are read), then given the checkpoint's
    tensors (``load_state_dict(assign=True)``, strict: a missing or unexpected weight is an error) and re-tied.
    A tensor with a NaN or infinite value, in checkpoint ``folder`` or after the cast, is refused (ExportError)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(base))
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read the base model's config in {base}: {error}") from error
    name = dtype
    if dtype == "auto":
        found = getattr(config, "dtype", None)
        name = str(found).removeprefix("torch.") if found is not None else "float32"
        if name not in DTYPES:
            name = "float32"
    target = getattr(torch, name)
    with torch.device("meta"):
        policy = AutoModelForImageTextToText.from_config(config, dtype=target)
    cast = {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}
    _check_finite(weights, cast, name, folder)
    try:
        policy.load_state_dict(cast, strict=True, assign=True)
    except RuntimeError as error:
        raise ExportError(f"the checkpoint's weights do not fit the base model {base}: {error}") from error
    policy.tie_weights()
    policy.eval()
    if (base / "generation_config.json").is_file():
        policy.generation_config = GenerationConfig.from_pretrained(str(base))
    return policy, name


def _check_finite(weights: dict[str, Any], cast: dict[str, Any], name: str, folder: Path) -> None:
    """Refuse the first floating-point tensor with a NaN or infinite value, in the checkpoint's ``weights`` or in
    their ``cast`` to dtype ``name`` (float16 overflows to inf beyond 65504), naming the tensor and the counts."""
    import torch

    for key, value in weights.items():
        if not value.is_floating_point():
            continue
        checks = [(value, f"in checkpoint {folder}")]
        if cast[key] is not value:
            checks.append((cast[key], f"once cast to {name} (--dtype)"))
        for tensor, where in checks:
            if not bool(torch.isfinite(tensor).all()):
                nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
                raise ExportError(f"tensor {key} holds {nan} NaN and {inf} infinite values of {tensor.numel()} "
                                  f"{where}; not exported")
