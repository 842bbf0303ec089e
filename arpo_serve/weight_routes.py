"""arpo-serve's weight-update routes: the weight group, the weight-update session and the distributed update, with
SGLang 0.5.23's paths and shapes (python/sglang/srt/entrypoints/http_server.py).

Routes: POST /init_weights_update_group, POST /begin_weight_update, POST /update_weights_from_distributed,
POST /end_weight_update, POST /destroy_weights_update_group (arpo_async.weight_sync builds the group as SGLang does).
Bad requests get HTTP 400; SGLang's answers {success, message} are 400 when success is false.

Who may do what: every route here is :func:`~arpo_serve.route_helpers.admin_only` (with ``--admin-api-key`` set, the
only key that opens them). Within that, a body's ``rid`` (SGLang's request-id field) names its client: a session
opened with a rid is used and ended only with that rid, a group joined with a rid is used and destroyed only with
it, and no refusal names another client's rid or group. Joins are bounded per client (:data:`JOINS_PER_CLIENT`) and
in all (:data:`JOINS_AT_ONCE`, beyond which only the client that last opened a session may still join), so another
client's joins never hold up the learner's. A session left idle for :data:`SESSION_IDLE_S` is closed by the next
begin, so a client that went away does not block updates for good.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

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
from arpo_serve.app_keys import ENGINE_KEY, GROUP_OWNERS_KEY, GROUPS_KEY, JOINS_KEY, SCHEDULER_KEY, SESSION_KEY
from arpo_serve.engine import RequestError
from arpo_serve.route_helpers import admin_only, json_body, request_rid, answer

log = logging.getLogger("arpo_serve.app")


WEIGHT_GROUP_TIMEOUT_S = 120.0
"""Seconds a weight-group rendezvous or broadcast may wait for the learner before it fails."""

JOINS_AT_ONCE = 8
"""Weight-group joins in progress at once, all clients together; beyond it a join is answered 503 at once, unless
it comes from the client (rid) that last opened a weight-update session (the learner). Each waits in a daemon
thread of its own (never the executor that prepares /generate requests) for at most WEIGHT_GROUP_TIMEOUT_S, so
joins to an address that takes the connection and never answers neither starve generation nor hold up the
process's exit."""

JOINS_PER_CLIENT = 2
"""Weight-group joins in progress at once from one client (one ``rid``; bodies without one count as one client);
another is answered 503 at once. 503 (busy), not SGLang's 400: the learner takes a 400 to a join as a
configuration error and stops, a 503 only skips that server for one publication."""

SESSION_IDLE_S = 2 * WEIGHT_GROUP_TIMEOUT_S + 60
"""Seconds a weight-update session may stay open with nothing received in it; after that the next
begin_weight_update closes it and opens its own (longer than any one bucket's broadcast may take)."""

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")
"""SGLang 0.5.23's answer when an update's flush_cache meets running or queued requests (generation not paused)."""

SELECTORS = ("target", "draft", "all")
"""The weight selectors SGLang 0.5.23 accepts (its speculative decoding's target and draft models, or both)."""


def weight_selector(body: dict) -> str:
    """The body's ``selector`` (default "all"); RequestError (400) when it is not one of :data:`SELECTORS`."""
    selector = body.get("selector", "all")
    if selector not in SELECTORS:
        raise RequestError(f"selector must be one of {SELECTORS}, got {selector!r}")
    return selector


NO_GROUP = "Failed to receive weights: no weight group of that name for this client. Please call " \
           "`init_weights_update_group` first."
"""The refusal of an update naming a group this client did not join (it lists no group names)."""

NOT_OWNER = "the open weight-update session was opened by another client (another rid); only it may use or end it"
"""The refusal of a session call by a client that does not own the session (it names no session id)."""


def _groups(request: web.Request) -> dict[str, WeightGroup]:
    return request.app[GROUPS_KEY]


def _owned_group(request: web.Request, name: str, rid: str | None) -> WeightGroup | None:
    """The group ``name`` when it exists and ``rid`` may use it (it joined it, or it was joined without a rid)."""
    group = _groups(request).get(name)
    owner = request.app[GROUP_OWNERS_KEY].get(name)
    return group if group is not None and (owner is None or owner == rid) else None


def _join_refusal(request: web.Request, rid: str | None) -> str | None:
    """Why a join by ``rid`` must wait (None: it may start): JOINS_PER_CLIENT of its own in progress, or
    JOINS_AT_ONCE in all and ``rid`` is not the client that last opened a session."""
    joins = collections.Counter(request.app[JOINS_KEY])
    if joins[rid] >= JOINS_PER_CLIENT:
        return f"{joins[rid]} joins of this client are in progress (at most {JOINS_PER_CLIENT} per client)"
    learner = request.app[SESSION_KEY].get("last_owner")
    if sum(joins.values()) >= JOINS_AT_ONCE and (rid is None or rid != learner):
        return f"{sum(joins.values())} joins are in progress (at most {JOINS_AT_ONCE} at once)"
    return None


MAX_WORLD_SIZE = 4096
"""The largest weight group accepted (the learner plus a server's ranks)."""


def _bounded_int(value: object, field: str, low: int, high: int) -> int:
    """``value`` as an int in [low, high]; RequestError (400) for anything else: a bool, a fraction, a string,
    ``Infinity`` or an integer of 10^30."""
    if type(value) is not int or not low <= value <= high:
        raise RequestError(f"{field} must be an integer in [{low}, {high}], got {str(value)[:40]}")
    return value


@admin_only
async def init_weights_update_group(request: web.Request) -> web.Response:
    """POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
    backend, rid?} -> {success, message}; joins the learner's weight group as rank ``rank_offset``, built as SGLang
    builds it (arpo_async.weight_sync.init_custom_process_group; gloo, or nccl when this server runs on CUDA
    (``serve.device``); nccl on a CPU server is refused with a message). A name already in use here is refused, as
    torch refuses it in SGLang: the learner destroys the old group or picks a new name. 400 when the rendezvous
    fails; 503 when joins are already in progress (:func:`_join_refusal`). The group belongs to ``rid``."""
    body = await json_body(request)
    rid = request_rid(body)
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
        return answer(False, f"arpo-serve runs on {engine.device.type} and joins weight groups with "
                      f"{' or '.join(usable)}; backend {backend!r} is not available here")
    if not 0 < rank < world:
        raise RequestError(f"rank_offset {rank} must be in [1, world_size={world})")
    if name in _groups(request):
        return answer(False, f"Failed to initialize custom process group: the group name {name!r} has already "
                      "been created, please use a different group name.")
    busy = _join_refusal(request, rid)
    if busy is not None:
        return web.json_response({"success": False, "message": f"Failed to initialize custom process group: {busy}; "
                                  "try again when they end"}, status=503)
    joins = request.app[JOINS_KEY]
    joins.append(rid)  # one entry per join in progress, by client
    try:
        async with asyncio.timeout(WEIGHT_GROUP_TIMEOUT_S + 5):
            group = await in_daemon_thread(WeightGroup.join, address, port, rank, world, name,
                                           WEIGHT_GROUP_TIMEOUT_S, backend)
    except TimeoutError:
        return answer(False, f"Failed to initialize custom process group: the rendezvous at {address}:{port} did "
                      f"not complete within {WEIGHT_GROUP_TIMEOUT_S:g} s.")
    except (WeightGroupError, ValueError, OverflowError, RuntimeError) as e:
        return answer(False, f"Failed to initialize custom process group: {e}.")
    finally:
        joins.remove(rid)
    if name in _groups(request):  # another join of this name finished first
        group.destroy()
        return answer(False, f"Failed to initialize custom process group: the group name {name!r} has already "
                      "been created, please use a different group name.")
    _groups(request)[name] = group
    request.app[GROUP_OWNERS_KEY][name] = rid
    return answer(True, "Succeeded to initialize custom process group.")


@admin_only
async def begin_weight_update(request: web.Request) -> web.Response:
    """POST /begin_weight_update {selector, rid?} -> {success, message}: open a weight-update session (SGLang
    0.5.23: distributed and tensor updates load only inside one; a second begin answers success=false, 400). A
    ``rid`` (SGLang's request-id field, which every one of its request bodies has) makes its sender the session's
    owner: only a body with the same rid may use or end it. A session idle for SESSION_IDLE_S is closed by the next
    begin (its owner went away)."""
    body = await json_body(request, required=False)
    selector = weight_selector(body)
    rid = request_rid(body)
    session = request.app[SESSION_KEY]
    if session.get("open"):
        idle = time.monotonic() - session["active"]
        if session["receiving"] or idle < SESSION_IDLE_S:
            return answer(False, "a weight-update session is already open; call end_weight_update() first")
        log.warning("closing a weight-update session idle for %.0f s (more than %.0f s)", idle, SESSION_IDLE_S)
    session.update(open=True, selector=selector, loaded=False, owner=rid, active=time.monotonic(), receiving=0)
    if rid is not None:
        session["last_owner"] = rid
    return answer(True, "Success")


@admin_only
async def end_weight_update(request: web.Request) -> web.Response:
    """POST /end_weight_update {rid?} -> {success, message}: close the session (success=false, 400, when none is
    open, or when it was opened with a ``rid`` and this body names another: one client cannot end another's
    session, nor learn its rid from the refusal)."""
    body = await json_body(request, required=False)
    session = request.app[SESSION_KEY]
    if not session.get("open"):
        return answer(False, "no weight-update session is open; call begin_weight_update() first")
    owner = session.get("owner")
    if owner is not None and request_rid(body) != owner:
        return answer(False, NOT_OWNER)
    for key in ("open", "selector", "loaded", "owner", "active", "receiving"):
        session.pop(key, None)
    return answer(True, "Success")


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


@admin_only
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """POST /update_weights_from_distributed {names, dtypes, shapes, group_name, load_format?, flush_cache?,
    abort_all_requests?, weight_version?, selector?, rid?} -> {success, message}, as SGLang 0.5.23 answers it:

    - success=false unless a session is open (/begin_weight_update) and this body's ``rid`` owns it (when it was
      opened with one), and unless ``group_name`` is a group this rid joined (the refusal lists no group names);
    - receive each tensor broadcast from rank 0 of the group in ``names`` order, or one flat bucket
      (``load_format = "flattened_bucket"``), then load them while no batch runs, all or nothing, by checkpoint
      name (a name the checkpoint lacks fails the call; the model is unchanged);
    - ``flush_cache`` (default true) fails the call after the load when requests are queued and generation is
      not paused, as SGLang's cache flush does;
    - a broadcast that fails drops the group (the learner re-creates it). 400 whenever success is false."""
    engine, scheduler = request.app[ENGINE_KEY], request.app[SCHEDULER_KEY]
    body = await json_body(request)
    names, buffers, flat = _receive_buffers(body)
    weight_selector(body)
    session, rid = request.app[SESSION_KEY], request_rid(body)
    if not session.get("open"):
        return answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                      "end_weight_update()")
    if session.get("owner") is not None and rid != session["owner"]:
        return answer(False, NOT_OWNER)
    name = str(body.get("group_name", "weight_update_group"))
    group = _owned_group(request, name, rid)
    if group is None:
        return answer(False, NO_GROUP)
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

    session["receiving"] += 1  # a session receiving a bucket is never idle
    try:
        ok, message = await scheduler.exclusive(receive_and_load,
                                                abort_all=bool(body.get("abort_all_requests", False)))
    except WeightGroupError as e:
        request.app[GROUP_OWNERS_KEY].pop(name, None)
        _groups(request).pop(name).destroy()
        return answer(False, f"Failed to receive weights: {e}")
    finally:
        session["receiving"] = session.get("receiving", 1) - 1
        session["active"] = time.monotonic()
    if ok or message == FLUSH_REFUSED:
        request.app[SESSION_KEY]["loaded"] = True
        if version is not None:
            scheduler.stats.weight_updates += 1
    log.info("weight bucket of %d tensors from group %s: %s", len(names), name, message)
    return answer(ok, message)


@admin_only
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    """POST /destroy_weights_update_group {group_name, rid?} -> {success, message}; a group joined with a rid is
    destroyed only with that rid (another client is answered as if it did not exist)."""
    body = await json_body(request, required=False)
    name = str(body.get("group_name", "weight_update_group"))
    if _owned_group(request, name, request_rid(body)) is None:
        return answer(False, "The group to be destroyed does not exist.")
    request.app[GROUP_OWNERS_KEY].pop(name, None)
    group = _groups(request).pop(name)
    group.destroy()
    return answer(True, "Succeeded to destroy custom process group.")


def add_weight_routes(router: web.UrlDispatcher) -> None:
    """Register the weight-update routes on ``router``."""
    router.add_post("/init_weights_update_group", init_weights_update_group)
    router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    router.add_post("/begin_weight_update", begin_weight_update)
    router.add_post("/end_weight_update", end_weight_update)
