"""Every OSWorld getter type we implement -> its implementation: actors.osworld.getters (files, commands, app
settings, Chrome's profile), getters_web (the browser's pages) and getters_more (slides, VS Code, time rules,
the cache folder). ``arpo_async.task_names.GETTER_TYPES`` lists the same names (a unit test keeps them equal)."""
from __future__ import annotations

from actors.osworld.getters import BASE_GETTERS, Getter
from actors.osworld.getters_more import MORE_GETTERS
from actors.osworld.getters_web import WEB_GETTERS

GETTERS: dict[str, Getter] = {**BASE_GETTERS, **WEB_GETTERS, **MORE_GETTERS}
"""Getter type (OSWorld's name, ``evaluator.result.type``) -> async ``(controller, config, EvalContext) -> value``."""
