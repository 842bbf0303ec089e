"""Training on a split of a task folder (``learner.split``, arpo_async.task_sets.select_tasks) and the run file of
ARPO's recipe on ARPO's 128 OSWorld tasks (configs/arpo-osworld.toml)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from arpo_async.config import RunConfig, load_config
from arpo_async.task_sets import select_tasks
from arpo_async.tasks import Task, TaskFormatError
from arpo_cli import launcher
from learner.rollouts.evaluation_rounds import evaluation_tasks
from tests.support import osworld_examples

ROOT = Path(__file__).resolve().parents[2]
OSWORLD_TASKS = ROOT / "tests" / "data" / "tasks" / "osworld"
ARPO_OSWORLD = ROOT / "configs" / "arpo-osworld.toml"
OSWORLD_EXAMPLES = osworld_examples()


def split_file(tmp_path: Path, split: dict) -> str:
    path = tmp_path / "split.json"
    path.write_text(json.dumps(split))
    return str(path)


def run_config(tasks: Path | str, split: str, *more: str) -> RunConfig:
    return load_config(None, [f'learner.tasks="{tasks}"', f'learner.split="{split}"', *more])


def test_learner_split_trains_on_the_tasks_it_lists_in_its_order(tmp_path):
    split = split_file(tmp_path, {"os": ["arpo-os-until"], "chrome": ["arpo-chrome-history", "arpo-chrome-bookmark"]})
    config = run_config(OSWORLD_TASKS, split)
    assert [t.id for t in select_tasks(config.learner)] == ["arpo-os-until", "arpo-chrome-history",
                                                           "arpo-chrome-bookmark"]
    assert launcher.check_tasks(config) == (3, 0)
    cut = run_config(OSWORLD_TASKS, split, 'learner.task_ids=["arpo-chrome-"]')  # task_ids still cuts the split
    assert [t.id for t in select_tasks(cut.learner)] == ["arpo-chrome-history", "arpo-chrome-bookmark"]


@pytest.mark.parametrize("split, named", [
    ({"os": ["arpo-os-until", "not-a-task"]}, "os/not-a-task"),  # listed, not in the folder
    ({"vs_code": ["arpo-os-until"]}, "vs_code/arpo-os-until"),  # in the folder under another domain
])
def test_a_split_task_missing_from_the_folder_stops_the_run_naming_it(tmp_path, split, named):
    config = run_config(OSWORLD_TASKS, split_file(tmp_path, split))
    with pytest.raises(TaskFormatError, match=named):
        select_tasks(config.learner)
    with pytest.raises(launcher.RunInputError, match=f"learner.split = .*{named}"):
        launcher.check_tasks(config)


def test_a_split_that_cannot_be_read_stops_the_run_naming_it(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    for split in (str(tmp_path / "absent.json"), str(tmp_path / "bad.json")):
        with pytest.raises(launcher.RunInputError, match="learner.split"):
            launcher.check_tasks(run_config(OSWORLD_TASKS, split))


def test_a_task_file_repeating_another_ones_id_trains_under_its_file_name(tmp_path):
    """Two of ARPO's 128 (thunderbird/a10b69e1-..., dfac9ee8-...) carry chrome tasks' ``id`` fields: each is a task of
    its own, named by its file as OSWorld's runner names it, in the learner and in the task the actors rebuild, and
    by that name whatever split cuts the folder (its files are looked up in the mirror under it)."""
    folder = tmp_path / "examples"
    (folder / "chrome").mkdir(parents=True)
    (folder / "thunderbird").mkdir()
    shutil.copy(OSWORLD_TASKS / "chrome" / "arpo-chrome-history.json", folder / "chrome" / "arpo-chrome-history.json")
    twin = json.loads((OSWORLD_TASKS / "chrome" / "arpo-chrome-bookmark.json").read_text())
    twin["id"] = "arpo-chrome-history"  # the other file's id, as in OSWorld's thunderbird files
    (folder / "thunderbird" / "twin-task.json").write_text(json.dumps(twin))
    split = split_file(tmp_path, {"chrome": ["arpo-chrome-history"], "thunderbird": ["twin-task"]})
    config = run_config(folder, split, f'eval.tasks="{folder}"', f'eval.split="{split}"')
    for tasks in (select_tasks(config.learner), evaluation_tasks(config)):
        assert [t.id for t in tasks] == ["arpo-chrome-history", "twin-task"]
        assert tasks[1].instruction == twin["instruction"]
        assert Task.from_dict(tasks[1].to_dict()).id == "twin-task"  # what an actor rebuilds from the wire
    alone = split_file(tmp_path, {"thunderbird": ["twin-task"]})  # the same name in a split without the other one
    assert [t.id for t in select_tasks(run_config(folder, alone).learner)] == ["twin-task"]
    with pytest.raises(TaskFormatError, match="duplicate task id"):  # the whole folder, no split: as before
        select_tasks(load_config(None, [f'learner.tasks="{folder}"']).learner)


def test_the_arpo_osworld_run_file_sets_arpos_recipe():
    config = load_config(ARPO_OSWORLD, [])
    lc, ac, ev = config.learner, config.actors, config.eval
    assert (lc.split, ev.split, lc.group_size, lc.groups_per_step, lc.updates_per_batch) == ("arpo-128", "arpo-128",
                                                                                           8, 16, 2)
    assert (ac.max_steps, ac.history_images, ac.image_profile, ac.desktop_memory_mb) == (15, 15, "osworld", 2048)
    assert lc.replay and lc.replay_mode == "arpo" and lc.prepass_k > 0 and lc.prepass_min_success == 1
    assert lc.osworld_files and ev.tasks == lc.tasks and ev.enabled
    assert config.model == ""  # the tiny policy runs as written; UI-TARS-1.5-7B is commented
    assert "# model = \"/ckpt/UI-TARS-1.5-7B\"" in ARPO_OSWORLD.read_text()


@pytest.mark.skipif(OSWORLD_EXAMPLES is None, reason="$OSWORLD_EXAMPLES names no folder of OSWorld's task files")
def test_the_arpo_osworld_run_file_trains_and_evaluates_on_arpos_128_distinct_tasks():
    config = load_config(ARPO_OSWORLD, [f'learner.tasks="{OSWORLD_EXAMPLES}"', f'eval.tasks="{OSWORLD_EXAMPLES}"'])
    assert launcher.check_tasks(config) == (128, 128)
    assert len({t.id for t in select_tasks(config.learner)}) == 128
