"""actors.episode.episode_outcome: the module docstring's table for an evaluated episode."""

from __future__ import annotations

import pytest

from actors.episode import episode_outcome
from arpo_async.messages import Outcome


@pytest.mark.parametrize("score, format_ok, last_action, outcome", [
    (1.0, True, "DONE", Outcome.SUCCESS),
    (0.3, True, None, Outcome.SUCCESS),  # the score decides (above learner.success_threshold), whatever ended the loop
    (1.0, False, "FAIL", Outcome.SUCCESS),
    (0.0, False, "PARSE_ERROR", Outcome.POLICY_ERROR),  # no reply parsed: the episode ends there, never as FAIL
    (0.1, True, None, Outcome.TRUNCATED),  # the step budget ran out; 0.1 is no success (strictly above it)
    (0.0, True, "DONE", Outcome.FAILURE),
    (0.0, True, "FAIL", Outcome.FAILURE),
])
def test_outcome_of_an_evaluated_episode(score, format_ok, last_action, outcome):
    assert episode_outcome(score, format_ok, last_action) is outcome
