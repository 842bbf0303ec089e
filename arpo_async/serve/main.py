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

from aiohttp import web

from arpo_async.serve.app import build_app
from arpo_async.serve.engine import LOGPROB_MODES, Engine
from arpo_async.serve.scheduler import Scheduler

log = logging.getLogger("arpo_async.serve")


@dataclass(frozen=True)
class ServeConfig:
    """Command-line settings of arpo-serve."""

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


def parse_args(argv: list[str] | None) -> ServeConfig:
    p = argparse.ArgumentParser(prog="arpo-serve", description="CPU inference server with SGLang's HTTP API")
    p.add_argument("--model", "--model-path", dest="model", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprob-mode", choices=LOGPROB_MODES, default="model")
    p.add_argument("--jump-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="emit text the grammar forces as its canonical tokens instead of sampling it (default on)")
    p.add_argument("--api-key", default=os.environ.get("ARPO_API_KEY", ""),
                   help="require 'Authorization: Bearer KEY' on every route but GET /health, as SGLang's --api-key "
                        "(default: $ARPO_API_KEY)")
    p.add_argument("--weights-root", type=Path,
                   help="load weights (/update_weights_from_disk) only from folders under this one")
    a = p.parse_args(argv)
    if a.max_batch < 1:
        p.error("--max-batch must be >= 1")
    return ServeConfig(a.model, a.host, a.port, a.max_batch, a.weight_version, a.seed, a.logprob_mode,
                       a.jump_forward, a.api_key, a.weights_root.resolve() if a.weights_root else None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `arpo-serve`."""
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = Engine(config.model, seed=config.seed, weight_version=config.weight_version,
                    logprob_mode=config.logprob_mode, jump_forward=config.jump_forward)
    asyncio.run(serve(config, engine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
