"""The arms and task setup of the learning benchmarks (bench/bench_learning.py, bench/probe_learning.py) and of
the learnability tests, which train with arm a: each arm a list of config overrides on top of :data:`TASK_SETUP`,
and :func:`task_selection` for the tasks a ``--family`` names.

Test infrastructure, not product: the tests import it from here and so do the benchmarks (no test imports bench/).
"""

from __future__ import annotations

import json
from pathlib import Path

from arpo_async.config import load_config
from arpo_async.tasks import Task, load_tasks
from learner.main import select_tasks

ARMS: dict[str, tuple[str, list[str]]] = {
    "a": ("async + correction + prioritized replay",
          ['learner.schedule="async"', 'learner.correction="decoupled"', 'learner.replay_mode="prioritized"',
           "learner.updates_per_batch=2"]),
    "b": ("async, no replay",
          ['learner.schedule="async"', 'learner.correction="decoupled"', 'learner.replay_mode="off"',
           "learner.updates_per_batch=2"]),
    "c": ("lockstep, ARPO recipe",
          ['learner.schedule="lockstep"', 'learner.correction="arpo"', 'learner.replay_mode="arpo"',
           "learner.updates_per_batch=2"]),
}
"""Arm c is ARPO's recipe where the paper fixes it: lockstep batches, no off-policy correction, ARPO's FIFO replay,
2 optimizer steps per rollout batch, G = 8 (TASK_SETUP). Its batches of distinct tasks (learner.stratified) match
ARPO's dataloader, which draws a batch's task ids without replacement. The learning rate (1e-6 for a 7B model) and
the action grammar are not ARPO's: they are sized for the tiny policy, alike in every arm. The async arms a and b
take 2 optimizer steps per batch too (configs/grid4.toml does the same): in bench/probe_learning.py's 3 seeds, arm a
reached 80% at 104-114 batches with 2 and at 155 / never / never in 200 with 1 (docs/benchmarks.md; the record:
``git show 3588234:bench/README.md``)."""

TASK_SETUP = ['actors.grammar_actions=["click"]', "actors.max_steps=1", "actors.max_thought_chars=1",
              "learner.group_size=8", "learner.groups_per_step=4", "learner.steps=100000"]
"""The task as every arm poses it: one click per episode, groups of 8, 4 groups per optimizer step (one per grid4
task), the default lr (5e-4: on the grid4 family 1e-3 took twice the steps, 2e-3 did not learn in 150 steps
and 3e-3 not in 80; probe_learning.py, issue 12, in ``git log -p bench/README.md``)."""


MULTI_STEP = {"settings": 2, "settings-apply": 3}
"""The built-in multi-step families -> the actions each of their tasks takes (episodes get that many steps)."""


def task_selection(family: str) -> tuple[str, list[str]]:
    """What ``--family`` names -> (its name for run folders and plots, the `--set` overrides that pick its tasks).

    ``family``: an existing folder of task files (all its tasks, as ``learner.tasks``, made absolute; named after
    the folder); a multi-step family of :data:`MULTI_STEP` (its tasks by id, episodes of its number of actions,
    the last 2 screenshots in the prompt: configs/multistep.toml); else a family of the task suite such as
    ``grid4`` (every ``grid4-*`` task) or one task id such as ``grid4-green`` (``learner.task_ids``, a prefix
    filter). Only a multi-step family loads the built-in suite (to find its tasks): see :func:`check_tasks`.
    """
    folder = Path(family)
    if folder.is_dir():
        folder = folder.resolve()
        return folder.name, [f"learner.tasks={json.dumps(str(folder))}"]
    if family in MULTI_STEP:
        ids = [t.id for t in load_tasks() if t.family == family]
        return family, [f"learner.task_ids={json.dumps(ids)}", f"actors.max_steps={MULTI_STEP[family]}",
                        "actors.history_images=2", f"learner.groups_per_step={len(ids)}"]
    prefix = family if "-" in family else f"{family}-"  # a family, or one task of it
    return family, [f"learner.task_ids=[{json.dumps(prefix)}]"]


def check_tasks(selection: list[str]) -> list[Task]:
    """The tasks ``selection`` (overrides from :func:`task_selection`) trains on, as the learner will pick them.

    Raises:
        ValueError: a malformed task file or folder (TaskFormatError), a bad override (ConfigError), or no task
            matches.
    """
    return select_tasks(load_config(None, selection).learner)
