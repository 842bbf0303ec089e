"""`arpo-serve`: the embedded CPU inference server speaking SGLang's HTTP API.

Wires the engine (model on the CPU), the batching scheduler and the aiohttp routes in one function (`serve`),
runs until SIGINT/SIGTERM. Prints one line ``arpo-serve ready on http://HOST:PORT`` once it accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from arpo_async.config import ConfigError, load_config
from arpo_async.config_doc import add_config_arguments
from arpo_serve.app import build_app
from arpo_serve.engine import LOGPROB_MODES, Engine
from arpo_serve.scheduler import Scheduler

log = logging.getLogger("arpo_serve")


@dataclass(frozen=True)
class ServeConfig:
    """The settings of one arpo-serve, resolved from its flags and the run file (`parse_args`)."""

    model: Path
    """Hugging Face checkpoint folder (e.g. from `arpo init-model`)."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 30000
    """TCP port (SGLang's default 30000)."""
    max_batch: int = 16
    """Most requests run together; more raises throughput and per-request latency."""
    weight_version: str = "0"
    """Initial weight version reported in meta_info.weight_version."""
    seed: int = 0
    """Seed of the server-level sampler."""
    logprob_mode: str = "model"
    """'model': unmasked temperature-1 log-probs (the trainer's); 'sglang': masked, tempered (SGLang's)."""
    jump_forward: bool = True
    """Emit grammar-forced text as its canonical tokens instead of sampling it (see serve.engine)."""
    api_key: str = ""
    """When set, every route but GET /health needs ``Authorization: Bearer <api_key>`` (SGLang's --api-key)."""
    weights_root: Path | None = None
    """When set, /update_weights_from_disk loads only folders under it (the learner's <run>/weights)."""


def exposure_warning(host: str, api_key: str) -> str | None:
    """The warning to print when ``host`` listens beyond this machine and no API key guards the server."""
    if host in ("127.0.0.1", "localhost", "::1") or api_key:
        return None
    return (f"arpo-serve listens on {host} without an API key: anyone who can reach this port can generate and "
            "replace the weights; pass --api-key (or serve.api_key in the run file)")


async def serve(config: ServeConfig, engine: Engine) -> None:
    """Run the HTTP server and the scheduler until SIGINT/SIGTERM."""
    scheduler = Scheduler(engine, config.max_batch)
    runner = web.AppRunner(build_app(engine, scheduler, api_key=config.api_key, weights_root=config.weights_root),
                           access_log=None)
    warning = exposure_warning(config.host, config.api_key)
    if warning:
        log.warning("%s", warning)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        async with asyncio.TaskGroup() as tg:
            scheduler_task = tg.create_task(scheduler.run(), name="scheduler")
            print(f"arpo-serve ready on http://{config.host}:{config.port}", flush=True)
            await stop.wait()
            scheduler_task.cancel()
    finally:
        await runner.cleanup()
    log.info("stopped by signal; cleaned up")


def parse_args(argv: list[str] | None) -> ServeConfig:
    """The settings of one arpo-serve from its command line and the run file.

    Precedence, highest first: a flag given on the command line (``--model --host --port --max-batch
    --jump-forward --api-key``); then $ARPO_API_KEY for the API key; then the run file (``--config`` with
    ``--set`` overrides: the ``serve`` section and the top-level ``model``, whose empty default means
    ``<run_dir>/../tiny-model`` as for the learner); then the config defaults (arpo_async.config.ServeConfig).
    ``--model`` is needed only when neither --config nor --set is given. Exits with status 2 (argparse's
    usage error) for a bad run file, a missing model or ``--max-batch`` < 1.
    """
    p = argparse.ArgumentParser(
        prog="arpo-serve", description="CPU inference server speaking SGLang's HTTP API (/generate, "
        "/update_weights_from_disk, ...): the embedded policy server `arpo run` starts. Flags win over the run file.")
    add_config_arguments(p, ("", "serve"))
    p.add_argument("--model", "--model-path", dest="model", type=Path,
                   help="Hugging Face checkpoint folder (default: the run file's model)")
    p.add_argument("--host", help="address to bind (default: serve.host)")
    p.add_argument("--port", type=int, help="TCP port (default: serve.port)")
    p.add_argument("--max-batch", type=int, help="most requests decoded together (default: serve.max_batch)")
    p.add_argument("--weight-version", default="0", help="initial weight version (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the server-level sampler (default 0)")
    p.add_argument("--logprob-mode", choices=LOGPROB_MODES, default="model",
                   help="model: the trainer's unmasked temperature-1 log-probs; sglang: SGLang's (default model)")
    p.add_argument("--jump-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="emit text the grammar forces as its canonical tokens instead of sampling it "
                        "(default: serve.jump_forward, on)")
    p.add_argument("--api-key", default=os.environ.get("ARPO_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but GET /health, as SGLang's --api-key "
                        "(default: $ARPO_API_KEY, else serve.api_key)")
    p.add_argument("--weights-root", type=Path,
                   help="load weights (/update_weights_from_disk) only from folders under this one")
    a = p.parse_args(argv)
    if a.model is None and a.config is None and not a.overrides:
        p.error("--model or --config is required")
    try:
        run = load_config(a.config, a.overrides)
    except ConfigError as e:
        p.error(str(e))
    model = a.model or run.model_path
    if not (model / "config.json").is_file():
        p.error(f"no model at {model} (a Hugging Face folder with config.json; --model or the run file's model)")
    s = run.serve
    config = ServeConfig(model, _given(a.host, s.host), _given(a.port, s.port), _given(a.max_batch, s.max_batch),
                         a.weight_version, a.seed, a.logprob_mode, _given(a.jump_forward, s.jump_forward),
                         _given(a.api_key, s.api_key), a.weights_root.resolve() if a.weights_root else None)
    if config.max_batch < 1:
        p.error("--max-batch must be >= 1")
    return config


def _given(flag: Any, from_config: Any) -> Any:
    """A flag's value when it was given (not None), else the run file's."""
    return from_config if flag is None else flag


def main(argv: list[str] | None = None) -> int:
    """Entry point of `arpo-serve`."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = Engine(config.model, seed=config.seed, weight_version=config.weight_version,
                        logprob_mode=config.logprob_mode, jump_forward=config.jump_forward)
        asyncio.run(serve(config, engine))
    except Exception as exc:  # noqa: BLE001 - the process boundary: traceback at ERROR, exit 1 (as run_until_signal)
        logging.getLogger("arpo-serve").exception("arpo-serve failed: %s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
