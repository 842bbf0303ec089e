"""The keys of `arpo-serve`'s aiohttp application: what every route finds on ``request.app``.

Role: names the shared state of one server process, set once by :func:`arpo_serve.app.build_app` and read by the
route modules (arpo_serve.app, arpo_serve.openai_api, arpo_serve.weight_routes). It imports no route module, so
the routes and the app that registers them all point here (aiohttp's typed ``web.AppKey``, aiohttp 3.9+).
"""

from __future__ import annotations

from aiohttp import web

from arpo_serve.engine import Engine
from arpo_serve.scheduler import Scheduler

ENGINE_KEY = web.AppKey("engine", Engine)
"""The model and its tokenizer, grammars and weights (one per process)."""
SCHEDULER_KEY = web.AppKey("scheduler", Scheduler)
"""The continuous-batching scheduler every generation and weight change goes through."""
GROUPS_KEY = web.AppKey("weight_groups", dict)
"""Weight-group name -> its joined ``arpo_async.weight_sync.WeightGroup``."""
JOINS_KEY = web.AppKey("weight_group_joins", list)
"""The weight-group joins in progress (their clients' rids), bounded by arpo_serve.weight_routes."""
GROUP_OWNERS_KEY = web.AppKey("weight_group_owners", dict)
"""Weight-group name -> the rid that joined it (None: joined without one)."""
SESSION_KEY = web.AppKey("weight_session", dict)
"""The weight-update session: ``open``, its ``owner`` rid, ``selector``, ``loaded``, ``active`` (monotonic s of
its last use), ``receiving`` (updates in flight) and ``last_owner`` (the rid that last opened one)."""
WEIGHTS_ROOT_KEY = web.AppKey("weights_root", object)
"""The folder weights may be loaded from (``--weights-root``; None: any folder this process can read)."""
IMAGE_ROOT_KEY = web.AppKey("image_root", object)
"""The folder local image files may be read from (None: none at all)."""
