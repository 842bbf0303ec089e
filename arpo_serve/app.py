"""HTTP routes of `arpo-serve`: the part of SGLang's native API that arpo uses, same paths and shapes.

Role: parse and validate requests, hand generation to the `Scheduler` and control calls (weights, pause, abort)
to it or to the `Engine`. Bad requests get HTTP 400 with SGLang's error body ``{"error": {"message": ...}}``;
an engine failure gets 500 with the same shape; no traceback ever reaches a client.

Routes (sglang python/sglang/srt/entrypoints/http_server.py): POST|PUT /generate, POST /update_weights_from_disk,
POST /init_weights_update_group, POST /begin_weight_update, POST /update_weights_from_distributed,
POST /end_weight_update, POST /destroy_weights_update_group (arpo_serve.weight_routes), GET|POST /weights_checker,
POST /update_weight_version, GET /get_model_info, GET /get_weight_version, GET /get_server_info, GET /health,
GET /health_generate, POST /pause_generation, POST /continue_generation, GET|POST /flush_cache,
POST /abort_request; and OpenAI's POST /v1/chat/completions and GET /v1/models (arpo_serve.openai_api).

Keys (SGLang's --api-key and --admin-api-key, python/sglang/srt/utils/auth.py): the weight and control routes
(marked with :func:`~arpo_serve.route_helpers.admin_only`, SGLang's ``AuthLevel.ADMIN_OPTIONAL``) take only the
admin key when one is set; every other route but GET /health takes only the API key when one is set.

Arrows run one way: this module registers the route modules (arpo_serve.openai_api, arpo_serve.weight_routes),
and all of them take the app's keys from arpo_serve.app_keys and the shared request helpers from
arpo_serve.route_helpers; neither of those imports a route module.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from pathlib import Path

from aiohttp import web

import arpo_async
from arpo_async.model.inputs import ModelInputError
from arpo_serve.engine import Engine, PreparedRequest, RequestError, SamplingParams
from arpo_async.grammar import GrammarBusy, GrammarError
from arpo_serve.protocol import (
    GenerateInput,
    decode_image_data,
    error_body,
    generate_response,
    parse_generate,
)
from arpo_serve.scheduler import EngineFailure, Scheduler
from arpo_async.weight_sync import overall_checksum
from arpo_serve.app_keys import (ENGINE_KEY, GROUP_OWNERS_KEY, GROUPS_KEY, IMAGE_ROOT_KEY, JOINS_KEY,
                                 SCHEDULER_KEY, SESSION_KEY, WEIGHTS_ROOT_KEY)
from arpo_serve.openai_api import add_openai_routes
from arpo_serve.route_helpers import (ClientGone, admin_only, answer, compiled_grammars, json_body, request_rid,
                                      run_while_connected)
from arpo_serve.weight_routes import FLUSH_REFUSED, add_weight_routes, weight_selector

log = logging.getLogger(__name__)

def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response(error_body(message), status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except GrammarBusy as e:  # no room to compile now (issue 48 item 3): 503, which clients retry
        return web.json_response(error_body(str(e)), status=503,
                                 headers={"Retry-After": str(max(1, round(e.retry_after_s)))})
    except (RequestError, GrammarError, ModelInputError) as e:
        return _error(str(e), 400)
    except EngineFailure as e:
        return _error(f"engine failure: {e}", 500)
    except Exception as e:  # last resort: a JSON error, never a traceback (logged here)
        log.exception("unhandled error on %s", request.path)
        return _error(f"internal error: {type(e).__name__}: {e}", 500)


def _prepare(engine: Engine, inp: GenerateInput, image_root: Path | None, compiled=None) -> PreparedRequest:
    """Blocking: tokenize text, decode images, compute pixels, make the grammar's matcher (``compiled``: from
    `compiled_grammars`)."""
    images = [decode_image_data(item, image_root) for item in inp.image_data]
    ids = inp.input_ids if inp.input_ids is not None else engine.encoder.tokenize(inp.text or "")
    return engine.prepare(inp.rid, ids, images, inp.sampling_params, return_logprob=inp.return_logprob,
                          logprob_start_len=inp.logprob_start_len,
                          return_text_in_logprobs=inp.return_text_in_logprobs, compiled=compiled)


async def generate(request: web.Request) -> web.Response:
    """POST /generate: SGLang's GenerateReqInput -> response map (or a list for a batch body). A client that
    disconnects aborts its requests (their batch goes on without them)."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    inputs, is_batch = parse_generate(await json_body(request))
    started = time.monotonic()
    image_root = request.app[IMAGE_ROOT_KEY]
    compiled = await compiled_grammars(request, [inp.sampling_params for inp in inputs])
    prepared = await asyncio.to_thread(lambda: [_prepare(engine, inp, image_root, c)
                                                for inp, c in zip(inputs, compiled)])
    try:
        results = await run_while_connected(request, scheduler, prepared)
    except ClientGone as e:
        log.info("%s", e)
        return web.Response(status=499)  # nobody reads it
    latency = time.monotonic() - started
    decode_token = lambda t: engine.encoder.decode([t], skip_special_tokens=False)  # noqa: E731
    out = [generate_response(inp, result, p.input_ids, latency, decode_token)
           for inp, p, result in zip(inputs, prepared, results)]
    return web.json_response(out if is_batch else out[0])


FOREIGN_SESSION = "a weight-update session of another client is open; only its owner may change the weights now"
"""The refusal of a weight change by a client that does not own the open session (it names no session id)."""


def foreign_session(request: web.Request, body: dict) -> bool:
    """True when a weight-update session opened with a ``rid`` is open and ``body`` carries another rid (or none):
    that client may not change the weights or their version now."""
    session = request.app[SESSION_KEY]
    owner = session.get("owner") if session.get("open") else None
    return owner is not None and request_rid(body) != owner


@admin_only
async def update_weights_from_disk(request: web.Request) -> web.Response:
    """POST /update_weights_from_disk {model_path, load_format?, abort_all_requests?, weight_version?,
    flush_cache?} -> {success, message, num_paused_requests}; 400 when the load fails, or when ``flush_cache``
    (default true) meets queued requests while generation is not paused (the weights are loaded then, as in
    SGLang 0.5.23)."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    body = await json_body(request)
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise RequestError("model_path (string) is required")
    root = request.app[WEIGHTS_ROOT_KEY]
    if root is not None and not Path(model_path).resolve().is_relative_to(root):
        return web.json_response({"success": False, "num_paused_requests": 0,
                                  "message": f"{model_path} is not under the weights root {root} (--weights-root)"},
                                 status=400)
    if foreign_session(request, body):
        return web.json_response({"success": False, "message": FOREIGN_SESSION, "num_paused_requests": 0}, status=400)
    version = body.get("weight_version")

    def load() -> tuple[bool, str]:  # runs while no batch runs: weights and version change together
        ok, message = engine.load_weights(model_path, body.get("load_format"))
        if ok and version is not None:
            engine.weight_version = str(version)
            message += f" Weight version updated to {version}."
        if ok and body.get("flush_cache", True) and not scheduler.flushable:
            return False, FLUSH_REFUSED
        return ok, message

    ok, message = await scheduler.exclusive(load, abort_all=bool(body.get("abort_all_requests", False)))
    if ok:
        scheduler.stats.weight_updates += 1
    content = {"success": ok, "message": message, "num_paused_requests": 0}
    return web.json_response(content, status=200 if ok else 400)


@admin_only
async def weights_checker(request: web.Request) -> web.Response:
    """GET|POST /weights_checker {action: "checksum", skip_tensor_list?, selector?} -> {success, message, ranks:
    [{checksums: {name: 16 hex digits}, per_gpu_checksum, parallelism_info: [...]}], per_engine_checksum}, the
    shape SGLang 0.5.23 answers (entrypoints/http_server.py ``check_weights``; hashes as its CPU path,
    arpo_async.weight_sync.tensor_checksum). Names are checkpoint names (SGLang keys its own parameter names,
    with q/k/v and gate/up fused). Only the "checksum" action exists here; others answer success=false."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    body = await json_body(request, required=False)
    action = body.get("action", "checksum")
    skip = body.get("skip_tensor_list") or []
    weight_selector(body)
    if not isinstance(skip, list) or not all(isinstance(x, str) for x in skip):
        raise RequestError("skip_tensor_list must be a list of strings")
    if action != "checksum":
        return answer(False, f"Unsupported action={action!r}: arpo-serve answers 'checksum' only")
    checksums = await scheduler.exclusive(engine.checksums)
    checksums = {k: v for k, v in checksums.items() if not any(pattern in k for pattern in skip)}
    per_gpu = overall_checksum(checksums)
    place = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
             "rank": 0, "size": 1}
    ranks = [{"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [place]}]
    return answer(True, "Success.", ranks=ranks,
                  per_engine_checksum=hashlib.sha256(per_gpu.encode()).hexdigest())


@admin_only
async def update_weight_version(request: web.Request) -> web.Response:
    """POST /update_weight_version {new_version, abort_all_requests?, rid?}; refused (400) while another client's
    weight-update session is open."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    body = await json_body(request)
    if body.get("new_version") is None:
        raise RequestError("new_version is required")
    if foreign_session(request, body):
        return answer(False, FOREIGN_SESSION)
    version = str(body["new_version"])

    def set_version() -> None:
        engine.weight_version = version

    await scheduler.exclusive(set_version, abort_all=bool(body.get("abort_all_requests", False)))
    return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                              "new_version": version})


async def get_model_info(request: web.Request) -> web.Response:
    """GET /get_model_info: the keys SGLang 0.5.23's http_server.py answers with."""
    engine = request.app[ENGINE_KEY]
    config = engine.model.config
    return web.json_response({
        "model_path": str(engine.model_dir), "served_model_name": str(engine.model_dir),
        "tokenizer_path": str(engine.model_dir), "is_generation": True, "preferred_sampling_params": None,
        "weight_version": engine.weight_version, "load_format": "auto", "reasoning_parser": None,
        "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": True,
        "has_audio_understanding": False, "model_type": config.model_type,
        "architectures": list(getattr(config, "architectures", None) or [type(engine.model).__name__]),
    })


async def get_weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    """Server arguments plus ``internal_states`` (one entry: the scheduler's counters), with the keys SGLang 0.5.23's
    build_server_info gives; ``dtype``, ``device`` and ``tp_size`` as SGLang's server arguments name them (the
    learner's weight sync and check read them). There is no KV cache: ``max_total_num_tokens`` is the most tokens a
    full batch can hold (max_batch x the model's context length)."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    host, port = (request.transport.get_extra_info("sockname") or ("", 0))[:2] if request.transport else ("", 0)
    return web.json_response({
        "model_path": str(engine.model_dir), "served_model_name": str(engine.model_dir),
        "tokenizer_path": str(engine.model_dir), "host": host, "port": port, "incremental_streaming_output": False,
        "disaggregation_mode": "null", "max_total_num_tokens": scheduler.max_batch * engine.max_context_tokens,
        "max_running_requests": scheduler.max_batch,
        "logprob_mode": engine.logprob_mode, "weight_version": engine.weight_version,
        "dtype": str(next(engine.model.parameters()).dtype).split(".")[-1], "device": engine.device.type, "tp_size": 1,
        "internal_states": [scheduler.internal_state()], "version": f"arpo-serve {arpo_async.__version__}",
    })


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """GET /health_generate: runs a one-token generation (skipped while paused)."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    if scheduler.paused:
        return web.Response(status=200)
    probe = engine.prepare(f"health-{time.monotonic_ns()}", [engine.end_token_ids[0]], [],
                           SamplingParams(max_new_tokens=1, temperature=0.0))
    await scheduler.submit(probe)
    return web.Response(status=200)


@admin_only
async def pause_generation(request: web.Request) -> web.Response:
    """POST /pause_generation {mode: abort|retract|in_place} (SGLang's default: abort)."""
    body = await json_body(request, required=False)
    mode = body.get("mode", "abort")
    try:
        await request.app[SCHEDULER_KEY].pause(mode)
    except ValueError as e:
        raise RequestError(str(e)) from e
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


@admin_only
async def continue_generation(request: web.Request) -> web.Response:
    request.app[SCHEDULER_KEY].resume()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


@admin_only
async def flush_cache(request: web.Request) -> web.Response:
    """GET|POST /flush_cache: there is no prefix cache; succeeds only when SGLang's would (no running batch, and
    nothing queued unless generation is paused), else 400."""
    idle = request.app[SCHEDULER_KEY].flushable
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
             "requests, the operation will not be performed.)\n",
        status=200 if idle else 400,
    )


@admin_only
async def abort_request(request: web.Request) -> web.Response:
    """POST /abort_request {rid?, abort_all?}."""
    body = await json_body(request)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid must be a string")
    request.app[SCHEDULER_KEY].abort(rid, abort_all=bool(body.get("abort_all", False)))
    return web.Response(status=200)


def _keys(api_key: str, admin_api_key: str):
    """Middleware deciding as SGLang's ``decide_request_auth`` (srt/utils/auth.py) for its ADMIN_OPTIONAL and
    normal routes: GET /health is open; a route marked :func:`admin_only` needs ``Authorization: Bearer
    <admin_api_key>`` when an admin key is set (the API key is not accepted there), else the API key when one is
    set; any other route needs the API key when one is set (the admin key is not accepted there). A missing or
    wrong key gets 401 with SGLang's error body, naming which key the route takes and never what was sent."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            admin = getattr(request.match_info.handler, "admin_only", False)
            key = (admin_api_key or api_key) if admin else api_key
            given = request.headers.get("Authorization", "").encode()
            if key and not hmac.compare_digest(given, f"Bearer {key}".encode()):
                which = "the admin API key (--admin-api-key)" if admin and admin_api_key else "the API key"
                return _error(f"missing or wrong API key: this route takes {which} as 'Authorization: Bearer "
                              "...'", 401)
        return await handler(request)

    return check


def build_app(engine: Engine, scheduler: Scheduler, *, api_key: str = "", admin_api_key: str = "",
              weights_root: Path | None = None, image_root: Path | None = None) -> web.Application:
    """The aiohttp application with every route; the caller runs ``scheduler.run()`` beside it.

    ``api_key``: require it as a bearer token on every route but GET /health and the weight and control routes
    (those too when no ``admin_api_key`` is set). ``admin_api_key``: require it, and only it, on the weight and
    control routes (:func:`admin_only`; SGLang's --admin-api-key). ``weights_root``: load weights from
    disk only from folders under it (None: any folder this process can read). ``image_root``: read local image
    files named in ``image_data`` only under it (None: none at all)."""
    middlewares = [_keys(api_key, admin_api_key), _errors] if api_key or admin_api_key else [_errors]
    app = web.Application(middlewares=middlewares, client_max_size=256 * 1024 * 1024)
    app[WEIGHTS_ROOT_KEY] = weights_root
    app[IMAGE_ROOT_KEY] = image_root
    app[ENGINE_KEY] = engine
    app[SCHEDULER_KEY] = scheduler
    app[GROUPS_KEY] = {}
    app[JOINS_KEY] = []
    app[GROUP_OWNERS_KEY] = {}
    app[SESSION_KEY] = {}
    r = app.router
    r.add_post("/generate", generate)
    r.add_put("/generate", generate)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_get("/weights_checker", weights_checker)
    r.add_post("/weights_checker", weights_checker)
    r.add_get("/get_model_info", get_model_info)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_get("/get_server_info", get_server_info)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    add_weight_routes(r)
    add_openai_routes(r)
    return app
