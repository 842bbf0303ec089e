"""A test-only Python environment holding SGLang 0.5.23's own code, for tests that run SGLang's code against ours.

SGLang serves only on CUDA GPUs and its full install is about 11 GB, but the parts our tests need (the request
types in ``managers/io_struct.py``, ``utils/common.init_custom_process_group``, ``weight_sync/tensor_bucket.py``,
``models/qwen2_5_vl.py`` and ``multimodal/processors/qwen_vl.py``) are Python that imports on a CPU machine.
:func:`ensure_sglang_env` creates a virtualenv with ``--system-site-packages`` (so it shares this environment's
CPU torch and transformers) under a cache folder (default ``~/.cache/arpo/sglang-env``, or ``$ARPO_SGLANG_ENV``),
installs ``sglang==0.5.23`` there with ``--no-deps`` plus only the pinned packages in :data:`REQUIREMENTS`
(found by trial: install, import :data:`CHECK_MODULES`, repeat), then imports :data:`CHECK_MODULES` with the new
interpreter and fails with the import error and the missing package's name if one does not import (the cache,
lock and marker mechanics are :mod:`arpo_async.pinned_venv`'s).

torchvision: SGLang imports it at module level (``multimodal/internvl_utils.py`` via ``configs/__init__.py``, so
even ``io_struct`` needs it; ``processors/qwen_vl.py`` directly). PyPI has only CUDA builds of it, whose C++
extension cannot load next to a CPU torch; torchvision then handles the missing extension itself except for two
``torch.library.register_fake("torchvision::nms"/"qnms")`` calls, which need the operators' schemas to exist.
:data:`TORCHVISION_HOOK` (installed as a ``.pth`` file) defines those two schemas, with no kernel, just before
torchvision is first imported; its Python transforms (resize and the rest, plain torch) work, and calling one of
its compiled ops (nms, roi_align, image decoding) raises torch's "no kernel" / torchvision's "Couldn't load custom
C++ ops" error. Transformers then sees torchvision too, so its fast (torchvision) image processors are used in
this environment, as on a real SGLang host.

Build it ahead of time with ``python -m tests.sglang_env`` (about 25 s, ~320 MB); otherwise the first test
that needs it builds it. A marker file records what was installed (and the shared torch and transformers
versions); a change rebuilds. Concurrent builders are serialised by a lock file.
"""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from arpo_async import pinned_venv

SGLANG_PACKAGE = "sglang==0.5.23"
"""The SGLang release whose HTTP API and weight-update code the GPU paths were checked against (pyproject's ``gpu``
extra pins the same)."""

REQUIREMENTS: tuple[str, ...] = (
    # sglang/__init__ -> srt/utils/common.py:86 imports psutil (process helpers; a small C extension, wheels).
    "psutil==7.2.2",
    # srt/platforms/interface.py imports msgspec; io_struct's request types are msgspec structs (BaseReq).
    "msgspec==0.22.0",
    # srt/utils/common.py:87 imports pybase64.
    "pybase64==1.5.1",
    # srt/utils/common.py:94 imports starlette.
    "starlette==1.10.0",
    # io_struct -> configs/__init__ -> nano_nemotron_vl -> multimodal/internvl_utils.py, and
    # multimodal/processors/qwen_vl.py, import torchvision: 0.28 is the release built against torch 2.13 (PyPI has
    # only CUDA builds; their extension does not load here, see TORCHVISION_HOOK).
    "torchvision==0.28.0",
    # configs/deepseek_ocr -> sampling/custom_logit_processor.py imports dill.
    "dill==0.4.1",
    # configs/internvl.py (via utils/hf_transformers/common.py) imports sentencepiece (a C extension, wheels).
    "sentencepiece==0.2.3",
    # configs/model_config -> layers/quantization/compressed_tensors imports compressed_tensors ...
    "compressed-tensors==0.20.0",
    # ... whose logger imports loguru.
    "loguru==0.7.3",
    # configs/model_config -> layers/quantization/gguf.py imports gguf.
    "gguf==0.19.0",
    # constrained/base_grammar_backend -> parser/reasoning_parser -> entrypoints/openai/protocol.py imports openai
    # (its own imports besides those come from the shared environment: pydantic, httpx, ...).
    "openai==3.57.0",
    # parser/reasoning_parser -> function_call/base_format_detector.py imports partial_json_parser.
    "partial-json-parser==0.2.1.1.post7",
    # models/qwen2_5_vl.py:35 imports einops.
    "einops==0.8.2",
)
"""Pinned packages, installed ``--no-deps`` (their own dependencies come from the shared environment): exactly
what :data:`CHECK_MODULES` need besides that environment, each with the reason it is needed."""

CHECK_MODULES: tuple[str, ...] = (
    "sglang.srt.managers.io_struct",
    "sglang.srt.utils.common",
    "sglang.srt.weight_sync.tensor_bucket",
    "sglang.srt.models.qwen2_5_vl",
    "sglang.srt.multimodal.processors.qwen_vl",
)
"""The modules the tests use; a build is ready only once each of them imports with the environment's python."""

TORCHVISION_HOOK = '''\
"""arpo: define torchvision's nms/qnms operator schemas (no kernel) before torchvision is first imported, so the
CUDA-built torchvision wheel imports next to a CPU torch (see tests/sglang_env.py in arpo-async)."""
import sys


class _DefineTorchvisionSchemas:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            sys.modules[__name__].library = lib  # kept alive: dropping it would undefine the schemas
        return None


sys.meta_path.insert(0, _DefineTorchvisionSchemas())
'''
"""Source of ``arpo_torchvision_cpu.py``, imported at interpreter start by ``arpo_torchvision_cpu.pth``."""

_CHECK_SCRIPT = r'''
import importlib, json, sys, traceback
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except BaseException as exc:
        print(json.dumps({"module": module, "error": f"{type(exc).__name__}: {exc}",
                          "missing": getattr(exc, "name", None), "trace": traceback.format_exc()[-3000:]}))
        sys.exit(3)
print(json.dumps({"ok": True}))
'''

DEFAULT_ENV_DIR = Path(os.environ.get("ARPO_SGLANG_ENV") or Path.home() / ".cache" / "arpo" / "sglang-env")
MARKER = "arpo-sglang-env.txt"
BUILD_TIMEOUT_S = 900.0


class SGLangEnvError(RuntimeError):
    """The SGLang test environment could not be built or one of :data:`CHECK_MODULES` does not import there."""


def _shared_versions() -> str:
    versions = []
    for dist in ("torch", "transformers"):
        try:
            versions.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    return ",".join(versions)


def _fingerprint() -> str:
    # sys.prefix: the environment shares the creating interpreter's packages (pinned_venv's .pth file), so one
    # made from another environment is not reused.
    return pinned_venv.fingerprint(SGLANG_PACKAGE, *REQUIREMENTS, *CHECK_MODULES, TORCHVISION_HOOK, _shared_versions(),
                                   sys.prefix)


def env_python(env_dir: Path | None = None) -> Path:
    """The interpreter of the environment at ``env_dir`` (default :data:`DEFAULT_ENV_DIR`); it may not exist."""
    return pinned_venv.env_python(Path(env_dir or DEFAULT_ENV_DIR))


def is_ready(env_dir: Path | None = None) -> bool:
    """True when the environment exists and was built (and checked) from the current requirements."""
    return pinned_venv.is_ready(Path(env_dir or DEFAULT_ENV_DIR), MARKER, _fingerprint())


def check_imports(python: Path) -> None:
    """Import each of :data:`CHECK_MODULES` with ``python``.

    Raises:
        SGLangEnvError: naming the module that failed, the import error and, for a missing module, the package
            to add to :data:`REQUIREMENTS`.
    """
    import json

    proc = subprocess.run([str(python), "-c", _CHECK_SCRIPT, *CHECK_MODULES], capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    if proc.returncode == 0 and result.get("ok"):
        return
    if not result:
        raise SGLangEnvError(f"{python} could not run the import check ({proc.returncode}): {proc.stderr[-2000:]}")
    missing = result.get("missing")
    hint = (f"; the package providing {missing.split('.')[0]!r} is missing: add it (pinned, with a comment) to "
            f"REQUIREMENTS in tests/sglang_env.py") if missing else ""
    raise SGLangEnvError(f"{result['module']} does not import in {python}: {result['error']}{hint}\n"
                         f"{result['trace']}")


def ensure_sglang_env(env_dir: Path | None = None, *, base_python: str = sys.executable,
                      log=lambda _msg: None) -> Path:
    """Create (once) the SGLang test virtualenv and return its interpreter's path.

    Args:
        env_dir: where the environment lives (default :data:`DEFAULT_ENV_DIR`).
        base_python: the interpreter that creates the venv and whose site-packages it shares (torch, transformers).
        log: called with each command run (e.g. ``print``).
    Raises:
        SGLangEnvError: the venv or a pip install failed (with pip's error), or a module of :data:`CHECK_MODULES`
            does not import (with the import error and the missing package's name).
    """
    return pinned_venv.build(Path(env_dir or DEFAULT_ENV_DIR), marker=MARKER, expected=_fingerprint(),
                             installs=(REQUIREMENTS, (SGLANG_PACKAGE,)), base_python=base_python,
                             error=SGLangEnvError, timeout_s=BUILD_TIMEOUT_S, log=log, system_site_packages=True,
                             finish=lambda python: _finish(python, log))


def _finish(python: Path, log) -> None:
    """Install :data:`TORCHVISION_HOOK` in the new environment's site-packages, then :func:`check_imports`."""
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "arpo_torchvision_cpu.py").write_text(TORCHVISION_HOOK)
    (Path(site) / "arpo_torchvision_cpu.pth").write_text("import arpo_torchvision_cpu\n")
    log(f"checking that {', '.join(CHECK_MODULES)} import")
    check_imports(python)


if __name__ == "__main__":
    print(ensure_sglang_env(log=print))
