"""arpo-serve's weight-update routes: the weight group, the weight-update session and the distributed update, with
SGLang 0.5.23's paths and shapes (python/sglang/srt/entrypoints/http_server.py).

Routes: POST /init_weights_update_group, POST /begin_weight_update, POST /update_weights_from_distributed,
POST /end_weight_update, POST /destroy_weights_update_group (arpo_async.weight_sync builds the group as SGLang does).
Bad requests get HTTP 400; SGLang's answers {success, message} are 400 when success is false. A session opened
with a ``rid`` ends only with that rid, so one client cannot end another's session.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from aiohttp import web

from arpo_async.weight_sync import (
    FLATTENED_BUCKET,
    WeightGroup,
    WeightGroupError,
    bucket_layout,
    dtype_from_name,
    in_daemon_thread,
    unflatten_bucket,
)
from arpo_serve.app import (ENGINE_KEY, FLUSH_REFUSED, GROUPS_KEY, JOINS_KEY, SCHEDULER_KEY, SESSION_KEY, _answer,
                            _json_body, _selector)
from arpo_serve.engine import RequestError

log = logging.getLogger("arpo_serve.app")


WEIGHT_GROUP_TIMEOUT_S = 120.0
"""Seconds a weight-group rendezvous or broadcast may wait for the learner before it fails."""

JOINS_AT_ONCE = 2
"""Weight-group joins in progress at once; another is answered success=false at once. Each waits in a daemon thread
of its own (never the executor that prepares /generate requests) for at most WEIGHT_GROUP_TIMEOUT_S, so joins to
an address that takes the connection and never answers neither starve generation nor hold up the process's exit."""


def _groups(request: web.Request) -> dict[str, WeightGroup]:
    return request.app[GROUPS_KEY]


MAX_WORLD_SIZE = 4096
"""The largest weight group accepted (the learner plus a server's ranks)."""


def _bounded_int(value: object, field: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high]; RequestError (400) for anything else: a bool, a fraction, a string,
    ``Infinity`` or an integer of 10^30."""
    if type(value) is not int or not low <= value <= high:
        raise RequestError(f"{field} must be an integer in [{low}, {high}], got {str(value)[:40]}")
    return value


async def init_weights_update_group(request: web.Request) -> web.Response:
    """POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
    backend} -> {success, message}; joins the learner's weight group as rank ``rank_offset``, built as SGLang
    builds it (arpo_async.weight_sync.init_custom_process_group; gloo, or nccl when this server runs on CUDA
    (``serve.device``); nccl on a CPU server is refused with a message). A name already in use here is refused, as
    torch refuses it in SGLang: the learner destroys the old group or picks a new name. 400 when the rendezvous
    fails."""
    body = await _json_body(request)
    try:
        address, name = str(body["master_address"]), str(body.get("group_name", "weight_update_group"))
        port = _bounded_int(body["master_port"], "master_port", 1, 65535)
        world = _bounded_int(body["world_size"], "world_size", 2, MAX_WORLD_SIZE)
        rank = _bounded_int(body["rank_offset"], "rank_offset", 0, MAX_WORLD_SIZE)
    except KeyError as e:
        raise RequestError(f"init_weights_update_group needs master_address, master_port, rank_offset, "
                           f"world_size, group_name: missing {e}") from e
    backend = body.get("backend", "nccl")
    engine = request.app[ENGINE_KEY]
    usable = ("gloo", "nccl") if engine.device.type == "cuda" else ("gloo",)
    if backend not in usable:
        return _answer(False, f"arpo-serve runs on {engine.device.type} and joins weight groups with "
                       f"{' or '.join(usable)}; backend {backend!r} is not available here")
    if not 0 < rank < world:
        raise RequestError(f"rank_offset {rank} must be in [1, world_size={world})")
    if name in _groups(request):
        return _answer(False, f"Failed to initialize custom process group: the group name {name!r} has already "
                       "been created, please use a different group name.")
    joins = request.app[JOINS_KEY]
    if len(joins) >= JOINS_AT_ONCE:
        return _answer(False, f"Failed to initialize custom process group: {len(joins)} joins are in progress "
                       f"(at most {JOINS_AT_ONCE} at once); try again when they end")
    joins.append(name)  # a list, not a set: two joins under one name are two joins
    try:
        async with asyncio.timeout(WEIGHT_GROUP_TIMEOUT_S + 5):
            group = await in_daemon_thread(WeightGroup.join, address, port, rank, world, name,
                                           WEIGHT_GROUP_TIMEOUT_S, backend)
    except TimeoutError:
        return _answer(False, f"Failed to initialize custom process group: the rendezvous at {address}:{port} did "
                       f"not complete within {WEIGHT_GROUP_TIMEOUT_S:g} s.")
    except (WeightGroupError, ValueError, OverflowError, RuntimeError) as e:
        return _answer(False, f"Failed to initialize custom process group: {e}.")
    finally:
        joins.remove(name)
    _groups(request)[name] = group
    return _answer(True, "Succeeded to initialize custom process group.")


async def begin_weight_update(request: web.Request) -> web.Response:
    """POST /begin_weight_update {selector, rid?} -> {success, message}: open a weight-update session (SGLang
    0.5.23: distributed and tensor updates load only inside one; a second begin answers success=false, 400). A
    ``rid`` (SGLang's request-id field, which every one of its request bodies has) makes its sender the session's
    owner: only a body with the same rid may end it."""
    body = await _json_body(request, required=False)
    selector = _selector(body)
    session = request.app[SESSION_KEY]
    if session.get("open"):
        return _answer(False, "a weight-update session is already open; call end_weight_update() first")
    session.update(open=True, selector=selector, loaded=False, owner=_rid(body))
    return _answer(True, "Success")


def _rid(body: dict) -> str | None:
    """The body's ``rid`` (a string of at most 256 characters, or None); RequestError (400) otherwise."""
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or len(rid) > 256):
        raise RequestError("rid must be a string of at most 256 characters")
    return rid


async def end_weight_update(request: web.Request) -> web.Response:
    """POST /end_weight_update {rid?} -> {success, message}: close the session (success=false, 400, when none is
    open, or when it was opened with a ``rid`` and this body names another: one client cannot end another's
    session)."""
    body = await _json_body(request, required=False)
    session = request.app[SESSION_KEY]
    if not session.get("open"):
        return _answer(False, "no weight-update session is open; call begin_weight_update() first")
    owner = session.get("owner")
    if owner is not None and _rid(body) != owner:
        return _answer(False, f"the open weight-update session belongs to rid {owner[:80]!r}; only it may end it")
    session.clear()
    return _answer(True, "Success")


def _receive_buffers(body: dict) -> tuple[list[str], list[torch.Tensor], torch.Tensor | None]:
    """Names, the tensors to receive into, and (``load_format = "flattened_bucket"``) the one flat uint8 tensor
    the broadcast fills, whose views the tensors are. Raises RequestError for a malformed body."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes) and names):
        raise RequestError("names, dtypes and shapes must be non-empty lists of equal length")
    load_format = body.get("load_format")
    try:
        torch_dtypes = [dtype_from_name(str(d)) for d in dtypes]
        dims = [[_bounded_int(d, "shapes", 0, 2**31 - 1) for d in shape] for shape in shapes]
        if load_format == FLATTENED_BUCKET:
            flat = torch.empty(bucket_layout(torch_dtypes, dims)[-1][1], dtype=torch.uint8)
            return [str(n) for n in names], unflatten_bucket(flat, torch_dtypes, dims), flat
        if load_format is not None:
            raise RequestError(f"unsupported load_format {load_format!r} (None or {FLATTENED_BUCKET!r})")
        return [str(n) for n in names], [torch.empty(d, dtype=t) for t, d in zip(torch_dtypes, dims)], None
    except RequestError:
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:  # unknown dtype, bad size, allocation refused
        raise RequestError(f"bad dtypes or shapes: {e}") from e


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """POST /update_weights_from_distributed {names, dtypes, shapes, group_name, load_format?, flush_cache?,
    abort_all_requests?, weight_version?, selector?} -> {success, message}, as SGLang 0.5.23 answers it:

    - success=false unless a session is open (/begin_weight_update);
    - receive each tensor broadcast from rank 0 of the group in ``names`` order, or one flat bucket
      (``load_format = "flattened_bucket"``), then load them while no batch runs, all or nothing, by checkpoint
      name (a name the checkpoint lacks fails the call; the model is unchanged);
    - ``flush_cache`` (default true) fails the call after the load when requests are queued and generation is
      not paused, as SGLang's cache flush does;
    - a broadcast that fails drops the group (the learner re-creates it). 400 whenever success is false."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    body = await _json_body(request)
    names, buffers, flat = _receive_buffers(body)
    _selector(body)
    if not request.app[SESSION_KEY].get("open"):
        return _answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                       "end_weight_update()")
    name = str(body.get("group_name", "weight_update_group"))
    group = _groups(request).get(name)
    if group is None:
        return _answer(False, f"Failed to receive weights: group {name!r} not in {sorted(_groups(request))}. "
                       "Please call `init_weights_update_group` first.")
    version = body.get("weight_version")

    def receive_and_load() -> tuple[bool, str]:  # while no batch runs: weights and version change together
        group.broadcast([flat] if flat is not None else buffers)
        ok, message = engine.load_tensors(dict(zip(names, buffers)))
        if not ok:
            return False, (f"Failed to update parameter online: {message}. The weights served are unchanged "
                           "(arpo-serve loads all or nothing).")
        if version is not None:
            engine.weight_version = str(version)
        if body.get("flush_cache", True) and not scheduler.flushable:
            return False, FLUSH_REFUSED
        return True, "Succeeded to update parameter online."

    try:
        ok, message = await scheduler.exclusive(receive_and_load,
                                                abort_all=bool(body.get("abort_all_requests", False)))
    except WeightGroupError as e:
        _groups(request).pop(name).destroy()
        return _answer(False, f"Failed to receive weights: {e}")
    if ok or message == FLUSH_REFUSED:
        request.app[SESSION_KEY]["loaded"] = True
        if version is not None:
            scheduler.stats.weight_updates += 1
    log.info("weight bucket of %d tensors from group %s: %s", len(names), name, message)
    return _answer(ok, message)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    """POST /destroy_weights_update_group {group_name} -> {success, message}."""
    body = await _json_body(request, required=False)
    name = str(body.get("group_name", "weight_update_group"))
    group = _groups(request).pop(name, None)
    if group is None:
        return _answer(False, "The group to be destroyed does not exist.")
    group.destroy()
    return _answer(True, "Succeeded to destroy custom process group.")


def add_weight_routes(router: web.UrlDispatcher) -> None:
    """Register the weight-update routes on ``router``."""
    router.add_post("/init_weights_update_group", init_weights_update_group)
    router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    router.add_post("/begin_weight_update", begin_weight_update)
    router.add_post("/end_weight_update", end_weight_update)
