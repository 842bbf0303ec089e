"""What `arpo-serve`'s route modules share: reading a JSON body, waiting for grammars, running requests while
their client stays connected, the admin-route mark and SGLang's ``{success, message}`` answer.

Role: the layer under the routes. arpo_serve.app, arpo_serve.openai_api and arpo_serve.weight_routes import it;
it imports no route module, so the arrows run one way: app -> route modules -> this module and
arpo_serve.app_keys. Bad input raises ``RequestError``, which app.py's middleware answers with 400 and SGLang's
error body.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from arpo_serve.app_keys import ENGINE_KEY
from arpo_serve.engine import GenerationResult, PreparedRequest, RequestError, SamplingParams
from arpo_serve.scheduler import EngineFailure, Scheduler

DISCONNECT_POLL_S = 0.5
"""How often /generate checks whether its client is still connected (SGLang checks ``is_disconnected`` every 4 s
while a request runs)."""


class ClientGone(Exception):
    """The client of a /generate request disconnected before its answer; its requests were aborted."""


def _no_constant(name: str) -> float:
    """json.loads' hook for ``Infinity``, ``-Infinity`` and ``NaN``, which are not JSON: a 400, as for other
    malformed JSON."""
    raise RequestError(f"malformed JSON: {name} is not a JSON number")


async def json_body(request: web.Request, *, required: bool = True) -> dict:
    """The request's body as a JSON object (``{}`` for an empty body when not ``required``). Raises RequestError
    (400) for an empty required body, malformed or too deeply nested JSON, ``NaN``/``Infinity``, or a body that is
    not an object."""
    raw = await request.read()
    if not raw.strip():
        if required:
            raise RequestError("the request body is empty; a JSON object is required")
        return {}
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(f"malformed JSON: {e}") from e
    except RecursionError:
        raise RequestError("malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def compiled_grammars(request: web.Request, params: list[SamplingParams]) -> list:
    """The compiled grammar (or None) of each request's sampling params, waited for on the event loop, so that
    requests waiting for compiles hold none of the worker threads that prepare and decode the others. The client,
    for the grammar backend's per-client compile bound, is the peer's IP address (``request.remote``): every
    process behind one address counts as one client, whatever key it sends. Raises GrammarBusy or GrammarError."""
    grammars, client = request.app[ENGINE_KEY].grammars, request.remote or ""
    return list(await asyncio.gather(*(grammars.compile_async(p.grammar, client) if p.grammar is not None
                                       else asyncio.sleep(0) for p in params)))


def _connected(request: web.Request) -> bool:
    transport = request.transport  # aiohttp sets it to None when the connection is lost
    return transport is not None and not transport.is_closing()


async def run_while_connected(request: web.Request, scheduler: Scheduler,
                              prepared: list[PreparedRequest]) -> list[GenerationResult]:
    """Submit ``prepared`` and wait for the results; when the client disconnects first, abort them (cancelling
    ``Scheduler.submit`` aborts its request, queued or running) and raise ClientGone, as SGLang aborts the request
    of a client that left. Raises EngineFailure when the engine failed on a batch."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(scheduler.submit(p)) for p in prepared]
            while not all(task.done() for task in tasks):
                if not _connected(request):
                    raise ClientGone(f"client left; aborted {[p.rid for p in prepared]}")
                await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S)
    except* EngineFailure as group:
        raise group.exceptions[0] from None
    except* ClientGone as group:
        raise group.exceptions[0] from None
    return [task.result() for task in tasks]


def admin_only(handler):
    """Mark ``handler`` as a weight or control route, as SGLang marks its own with
    ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` (srt/utils/auth.py): with an admin key set only that key opens it;
    with only an API key, that key; with neither, anyone."""
    handler.admin_only = True
    return handler


def request_rid(body: dict) -> str | None:
    """The body's ``rid`` (SGLang's request-id field: a string of at most 256 characters, or None); RequestError
    (400) otherwise."""
    rid = body.get("rid")
    if rid is not None and (not isinstance(rid, str) or len(rid) > 256):
        raise RequestError("rid must be a string of at most 256 characters")
    return rid


def answer(ok: bool, message: str, **extra) -> web.Response:
    """SGLang's weight-route answer: {success, message} with 200, or 400 when success is false."""
    return web.json_response({"success": ok, "message": message, **extra}, status=200 if ok else 400)
