"""`arpo-serve`: the embedded inference server speaking SGLang's HTTP API (on the CPU, or on one CUDA device).

Wires the engine (the model on ``serve.device``), the batching scheduler and the aiohttp routes in one function
(`serve`), runs until SIGINT/SIGTERM. Prints one line ``arpo-serve ready on http://HOST:PORT`` once it accepts
requests (PORT the bound one: the kernel's pick when serve.port is 0; `arpo run` waits for this line). On a signal
it aborts every queued and running request (their clients get finish_reason abort), waits at most `STOP_GRACE_S`
for the running batch to stop at its next decode step, closes the server and logs ``stopped by signal; cleaned
up``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from aiohttp import web

from arpo_async.config import ConfigError, RunConfig, ServeConfig, load_config, toml_value
from arpo_async.config_doc import add_config_arguments
from arpo_async.inference_client import ADMIN_API_KEY_ENV
from arpo_serve.app import build_app
from arpo_serve.engine import LOGPROB_MODES, Engine
from arpo_serve.scheduler import Scheduler

log = logging.getLogger("arpo_serve")

STOP_GRACE_S = 5.0
"""Seconds a signal waits for the running batch (aborted at once) to end, and then for handlers to answer."""


def exposure_warning(host: str, api_key: str, admin_api_key: str = "") -> str | None:
    """The warning to print when ``host`` listens beyond this machine and no key guards the weight routes (the
    admin key, else the API key, guards them)."""
    if host in ("127.0.0.1", "localhost", "::1") or api_key or admin_api_key:
        return None
    return (f"arpo-serve listens on {host} without an API key: anyone who can reach this port can generate and "
            "replace the weights; pass --admin-api-key and --api-key (or serve.admin_api_key and serve.api_key in "
            "the run file)")


async def serve(config: ServeConfig, engine: Engine) -> None:
    """Run the HTTP server and the scheduler until SIGINT/SIGTERM."""
    scheduler = Scheduler(engine, config.max_batch)
    weights_root = Path(config.weights_root).resolve() if config.weights_root else None
    image_root = Path(config.image_root).resolve() if config.image_root else None
    app = build_app(engine, scheduler, api_key=config.api_key, admin_api_key=config.admin_api_key,
                    weights_root=weights_root, image_root=image_root)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=STOP_GRACE_S)
    warning = exposure_warning(config.host, config.api_key, config.admin_api_key)
    if warning:
        log.warning("%s", warning)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        port = runner.addresses[0][1]  # the kernel's pick when serve.port is 0
        async with asyncio.TaskGroup() as tg:
            scheduler_task = tg.create_task(scheduler.run(), name="scheduler")
            print(f"arpo-serve ready on http://{config.host}:{port}", flush=True)
            await stop.wait()
            await _drain(scheduler)
            scheduler_task.cancel()
    finally:
        await runner.cleanup()
    log.info("stopped by signal; cleaned up")


async def _drain(scheduler: Scheduler) -> None:
    """Abort every request and wait (at most STOP_GRACE_S) until no batch runs, so no worker thread outlives the
    loop: asyncio.run joins its worker threads, and a batch left running would keep the process alive."""
    try:
        async with asyncio.timeout(STOP_GRACE_S):
            await scheduler.pause("abort")
    except TimeoutError:
        log.warning("the running batch did not stop within %.0f s of the signal", STOP_GRACE_S)


FLAG_KEYS = {"model": "model", "host": "serve.host", "port": "serve.port", "max_batch": "serve.max_batch",
             "weight_version": "serve.weight_version", "seed": "serve.seed", "logprob_mode": "serve.logprob_mode",
             "jump_forward": "serve.jump_forward", "api_key": "serve.api_key",
             "admin_api_key": "serve.admin_api_key", "weights_root": "serve.weights_root",
             "image_root": "serve.image_root", "dtype": "serve.dtype",
             "device": "serve.device"}
"""arpo-serve's flags and the run-file key each one sets."""


def build_parser() -> argparse.ArgumentParser:
    """arpo-serve's command line: ``--config``/``--set`` over the ``serve`` section, and one flag per key of
    :data:`FLAG_KEYS` (``--api-key`` defaults to $ARPO_API_KEY, ``--admin-api-key`` to $ARPO_ADMIN_API_KEY)."""
    p = argparse.ArgumentParser(
        prog="arpo-serve", description="Inference server (CPU, or one CUDA device) speaking SGLang's HTTP API "
        "(/generate, /update_weights_from_disk, ...): the embedded policy server `arpo run` starts. Flags win over "
        "the run file.")
    add_config_arguments(p, ("", "serve"))
    p.add_argument("--model", "--model-path", dest="model", type=Path,
                   help="Hugging Face checkpoint folder (default: the run file's model)")
    p.add_argument("--host", help="address to bind (default: serve.host)")
    p.add_argument("--port", type=int, help="TCP port; 0 = a free one, printed in the ready line (default: serve.port)")
    p.add_argument("--max-batch", type=int, help="most requests decoded together (default: serve.max_batch)")
    p.add_argument("--weight-version", help="initial weight version (default: serve.weight_version, 0)")
    p.add_argument("--seed", type=int, help="seed of the server-level sampler (default: serve.seed, 0)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="the dtype the weights are held in, as SGLang's --dtype (default: serve.dtype, float32)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where the policy runs (default: serve.device, cpu); cuda also takes nccl weight groups")
    p.add_argument("--logprob-mode", choices=LOGPROB_MODES,
                   help="model: the trainer's unmasked temperature-1 log-probs; sglang: SGLang's "
                        "(default: serve.logprob_mode, model)")
    p.add_argument("--jump-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="emit text the grammar forces as its canonical tokens instead of sampling it "
                        "(default: serve.jump_forward, on)")
    p.add_argument("--api-key", default=os.environ.get("ARPO_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but GET /health, as SGLang's --api-key "
                        "(default: $ARPO_API_KEY, else serve.api_key); with --admin-api-key set, the weight and "
                        "control routes take only that key")
    p.add_argument("--admin-api-key", default=os.environ.get(ADMIN_API_KEY_ENV) or None,
                   help="require 'Authorization: Bearer KEY', and no other key, on the weight and control routes "
                        "(weight updates and groups, weight version, pause/continue, flush_cache, abort_request, "
                        "weights_checker), as SGLang's --admin-api-key (default: $ARPO_ADMIN_API_KEY, else "
                        "serve.admin_api_key)")
    p.add_argument("--weights-root", type=Path,
                   help="load weights (/update_weights_from_disk) only from folders under this one "
                        "(default: serve.weights_root)")
    p.add_argument("--image-root", type=Path,
                   help="read image_data naming a local file only under this folder (default: serve.image_root; "
                        "unset: no local files)")
    return p


def parse_args(argv: list[str] | None) -> RunConfig:
    """The run configuration of one arpo-serve: the run file with the command line applied (``model`` and the
    ``serve`` section are what it uses; arpo_async.config.ServeConfig documents each key).

    Precedence, highest first: a flag given on the command line (each sets its key of :data:`FLAG_KEYS`, after
    any ``--set``); then $ARPO_API_KEY for the API key and $ARPO_ADMIN_API_KEY for the admin key; then the run file (``--config`` with ``--set``
    overrides); then the config defaults. An empty ``model`` means ``<run_dir>/../tiny-model``, as for the
    learner. ``--model`` is needed only when neither --config nor --set is given. Exits with status 2
    (argparse's usage error) for a bad run file or value (naming the key) or a missing model.
    """
    p = build_parser()
    a = p.parse_args(argv)
    if a.model is None and a.config is None and not a.overrides:
        p.error("--model or --config is required")
    flags = [f"{key}={toml_value(str(value.resolve()) if isinstance(value, Path) else value)}"
             for name, key in FLAG_KEYS.items() if (value := getattr(a, name)) is not None]
    try:
        run = load_config(a.config, [*a.overrides, *flags])
    except ConfigError as e:
        p.error(str(e))
    if not (run.model_path / "config.json").is_file():
        p.error(f"no model at {run.model_path} (a Hugging Face folder with config.json; --model or the run file's "
                "model)")
    return run


def main(argv: list[str] | None = None) -> int:
    """Entry point of `arpo-serve`."""
    run = parse_args(argv)
    config = run.serve
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(run.model_path, seed=config.seed, weight_version=config.weight_version,
                        logprob_mode=config.logprob_mode, jump_forward=config.jump_forward, dtype=config.dtype,
                        device=config.device)
        asyncio.run(serve(config, engine))
    except Exception as exc:  # noqa: BLE001 - the process boundary: traceback at ERROR, exit 1 (as run_until_signal)
        logging.getLogger("arpo-serve").exception("arpo-serve failed: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
