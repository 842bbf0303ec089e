"""Environment actors, and the public API for using our desktops and episode loop from your own agent.

Exports (``from actors import DesktopEnv, EpisodeRunner, ...``), loaded on first use so that importing one
submodule (say ``actors.uitars``) stays light:

- :class:`DesktopEnv`, :class:`Observation`: one desktop, step by step (actors.desktop_env);
- :class:`EpisodeRunner`, :func:`load_task`: our episode loop, with ``run_task`` for use without a learner
  (actors.episode);
- :class:`Policy`, :func:`as_policy`, :func:`text_generation`, :class:`PolicyClient`, :class:`RetryPolicy`,
  :class:`Generation`: what the loop asks of a policy, and the SGLang HTTP client (actors.policy,
  arpo_async.inference_client);
- :class:`OpenAIChatPolicy`: a policy on any OpenAI-compatible ``/v1/chat/completions`` server (actors.openai_policy);
- :class:`TrajectorySink`, :class:`ListSink`, :class:`JsonlSink`: where trajectories go (actors.sinks);
  ``LearnerLink`` (actors.link) is the sink that sends them to a learner;
- :class:`Action`, :func:`parse_reply`: the UI-TARS action language (actors.uitars);
- :class:`Task`, :class:`Trajectory`, :class:`Outcome`, :class:`ActorConfig`: the shared contract (arpo_async).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "DesktopEnv": "actors.desktop_env", "Observation": "actors.desktop_env",
    "EpisodeRunner": "actors.episode", "load_task": "actors.episode",
    "Policy": "actors.policy", "CallablePolicy": "actors.policy", "as_policy": "actors.policy",
    "text_generation": "actors.policy",
    "OpenAIChatPolicy": "actors.openai_policy",
    "TrajectorySink": "actors.sinks", "ListSink": "actors.sinks", "JsonlSink": "actors.sinks",
    "LearnerLink": "actors.link",
    "Action": "actors.uitars.actions", "ActionParseError": "actors.uitars.actions",
    "parse_reply": "actors.uitars.actions",
    "PolicyClient": "arpo_async.inference_client", "RetryPolicy": "arpo_async.inference_client",
    "Generation": "arpo_async.inference_client",
    "ActorConfig": "arpo_async.config", "Task": "arpo_async.tasks",
    "Trajectory": "arpo_async.messages", "Outcome": "arpo_async.messages",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
