"""Whose fault an evaluation episode's error is: the harness's (the task could not be run) or the agent's (its
episode failed). One table, one function; the report (:mod:`actors.eval.report`) counts errors by it.

| outcome        | listed as an error | cause     | what happened                                                    |
|----------------|--------------------|-----------|------------------------------------------------------------------|
| TASK_ERROR     | yes                | harness   | the task did not load, or a setup step, getter or metric raised  |
|                |                    |           | (a getter or app we lack, a task-file field of the wrong type)   |
| ENV_ERROR      | yes                | harness   | the desktop died or timed out, setup failed (no network, a step  |
|                |                    |           | that failed), no desktop could be started                        |
| ABORTED        | yes                | agent     | the policy server stayed unreachable, no reply within            |
|                |                    |           | ``actors.policy_timeout_s``, the server aborted a generation, or |
|                |                    |           | the evaluation was cut short mid-episode                         |
| POLICY_ERROR   | no (scored)        | (agent's) | the reply did not parse: a scored failure, as the evaluator      |
|                |                    |           | scored the desktop (usually 0); counted in ``policy_errors``     |
| SUCCESS, FAILURE, TRUNCATED | no    | -         | the episode ran and was scored                                   |

Every listed error scores 0 in the headline mean (OSWorld's leaderboard divides by every task of the set) and is
left out of the mean over the episodes that ran (OSWorld's ``show_result.py`` reads only the ``result.txt`` files
its runner wrote, and its runner writes none for an example that raised). POLICY_ERROR is not an error: the agent
ran and its reply was judged, so it is in both means with its score, as OSWorld scores an episode whose agent
answered badly; it is the agent's own doing, and counted apart so a format problem is visible.
"""
from __future__ import annotations

from arpo_async.messages import Outcome

HARNESS = "harness"
"""The harness could not run the episode (task, setup, app, getter, network, desktop)."""
AGENT = "agent"
"""The agent's episode failed (its policy server, timeout or generation)."""

CAUSES: dict[Outcome, str] = {Outcome.TASK_ERROR: HARNESS, Outcome.ENV_ERROR: HARNESS, Outcome.ABORTED: AGENT}
"""The cause of each outcome listed as an error (the module table); other outcomes are scored, not errors."""


def error_cause(outcome: str) -> str | None:
    """``"harness"`` or ``"agent"`` for an outcome listed as an error (module table), None for a scored outcome.
    ``outcome`` is an :class:`arpo_async.messages.Outcome` value, in any case ("ENV_ERROR", "env_error").

    Raises:
        ValueError: ``outcome`` names no Outcome.
    """
    return CAUSES.get(Outcome(str(outcome).upper()))
