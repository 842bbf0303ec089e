"""`arpo run`'s progress display (arpo_cli.progress) and crash reports: plain lines are rate-limited, a live line
is redrawn in place, and a real child process that crashes logs its traceback at ERROR, which
arpo_cli.launcher.crash_excerpt quotes."""

from __future__ import annotations

import asyncio
import io
import json
import sys

import pytest

from arpo_async.config import load_config
from arpo_async.metrics import MetricsWriter
from arpo_cli.launcher import crash_excerpt, spawn
from arpo_cli.progress import LiveLine, PlainLines, TrajectoryRate, open_display, progress_line


def test_trajectory_rate_is_per_minute_over_the_last_window():
    rate = TrajectoryRate(window_s=60.0)
    assert rate.add(0.0, 0) == 0.0  # one sample: no rate yet
    assert rate.add(30.0, 10) == 20.0
    assert rate.add(90.0, 40) == 30.0  # the sample at 0 s fell out: 30 trajectories in the last 60 s
    assert rate.add(95.0, 0) == 0.0  # a restarted learner's total starts again: never negative


def test_plain_lines_are_rate_limited_but_never_silent():
    out = io.StringIO()
    plain = PlainLines(out, every_s=5.0, heartbeat_s=30.0)
    plain.update("[ 0s] step 0", now=0.0)
    plain.update("[ 1s] step 0", now=1.0)  # unchanged
    plain.update("[ 2s] step 1", now=2.0)  # changed, but too soon
    plain.update("[ 6s] step 1", now=6.0)  # changed since the last printed line, 6 s later
    plain.update("[40s] step 1", now=40.0)  # unchanged, but 34 s of silence
    plain.update("[41s] step 2", now=41.0, force=True)  # the final line
    assert out.getvalue().splitlines() == ["[ 0s] step 0", "[ 6s] step 1", "[40s] step 1", "[41s] step 2"]


def test_a_live_line_is_redrawn_and_messages_stay():
    out = io.StringIO()
    live = LiveLine(out)
    live.update("step 1/5 version 1", now=0.0)
    live.say("arpo-serve ready")
    live.update("step 2/5 version 2", now=1.0)
    live.close()
    text = out.getvalue()
    assert "arpo-serve ready" in text and "step 2/5 version 2" in text
    assert isinstance(open_display(io.StringIO()), PlainLines)  # not a terminal


def test_progress_line_shows_rate_lag_and_desktops_busy(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=5", "actors.actors=8"])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 1, "policy_version": 1, "trajectories": 8, "success_rate": 0.25, "reward_mean": 0.1,
                   "loss": 0.0123, "replay_injections": 0, "staleness_mean": 0.5, "wall_s": 9.0})
    metrics.close()
    status = {"policy_version": 1, "trajectories": 10, "running": 5, "queues": {"actor_running": 6},
              "outcomes": {"SUCCESS": 2, "FAILURE": 8}}
    (tmp_path / "status.json").write_text(json.dumps(status))
    rate = TrajectoryRate()
    progress_line(config, started=0.0, rate=rate, now=0.0)
    status["trajectories"] = 20
    (tmp_path / "status.json").write_text(json.dumps(status))
    line = progress_line(config, started=0.0, rate=rate, now=30.0)
    assert "step 1/5 version 1 | trajectories 20 (20.0/min)" in line
    assert "success 0.25 (last 10 steps 0.25) loss 0.0123 lag 0.50 | desktops 6/8 busy" in line
    assert line.endswith("failure=8 success=2") and "\n" not in line


def test_progress_line_counts_optimizer_steps_when_a_batch_takes_several(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=8", "learner.updates_per_batch=2"])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    for batch in (1, 2):  # two rollout batches of 2 optimizer steps each: versions 1, 2; steps 2, 4
        metrics.write({"step": 2 * batch, "policy_version": batch, "updates": 2, "trajectories": 16,
                       "success_rate": 0.5, "reward_mean": 0.5, "loss": 0.0, "replay_injections": 0,
                       "staleness_mean": 0.0, "wall_s": 1.0})
    metrics.close()
    assert "step 4/8 version 2 |" in progress_line(config, started=0.0, now=1.0)


def test_progress_line_shows_held_out_success_and_the_round_in_progress(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=80", 'eval.tasks="grid4-test"'])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 22, "policy_version": 11, "trajectories": 16, "success_rate": 0.5, "reward_mean": 0.5,
                   "loss": 0.0, "replay_injections": 0, "staleness_mean": 0.0, "wall_s": 1.0,
                   "eval_success": 0.375, "eval_step": 20, "eval_policy_version": 10})
    metrics.close()
    (tmp_path / "status.json").write_text(json.dumps(
        {"evaluation": {"rounds": 3, "step": 40, "policy_version": 20, "episodes_back": 3, "episodes": 8}}))
    line = progress_line(config, started=0.0, now=1.0)
    assert "| held-out 0.38 (step 20) | evaluating step 40: 3/8 | desktops" in line
    (tmp_path / "status.json").write_text(json.dumps({"evaluation": {"rounds": 3}}))  # between rounds
    line = progress_line(config, started=0.0, now=1.0)
    assert "held-out 0.38 (step 20) | desktops" in line and "evaluating" not in line


def test_a_solved_runs_evaluation_record_gives_the_held_out_part_and_the_last_batch_the_rest(tmp_path):
    """The evaluation record a run that stops as solved ends with (learner.train.records.evaluation_record) has no
    training field: the line's success, loss and lag stay the last batch's, its held-out part is the final round."""
    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.steps=80", 'eval.tasks="grid4-test"'])
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    metrics.write({"step": 22, "policy_version": 11, "trajectories": 16, "success_rate": 0.75, "reward_mean": 0.5,
                   "loss": 0.0123, "replay_injections": 0, "staleness_mean": 0.5, "wall_s": 1.0,
                   "eval_success": 0.375, "eval_step": 20, "eval_policy_version": 10})
    metrics.write({"step": 22, "policy_version": 11, "wall_s": 9.0, "eval_success": 0.875, "eval_step": 22,
                   "eval_policy_version": 11})
    with pytest.raises(ValueError, match="lacks"):  # neither a batch's record nor an evaluation record
        metrics.write({"step": 22, "policy_version": 11, "wall_s": 9.0})
    with pytest.raises(ValueError, match="lacks"):  # a batch's record missing a training field
        metrics.write({"step": 22, "policy_version": 11, "wall_s": 9.0, "eval_success": 0.5, "loss": 0.1})
    metrics.close()
    line = progress_line(config, started=0.0, now=1.0)
    assert "step 22/80 version 11 |" in line
    assert "success 0.75 (last 10 steps 0.75) loss 0.0123 lag 0.50 | held-out 0.88 (step 22) |" in line


async def test_a_crashed_child_logs_its_traceback_at_error_and_the_excerpt_quotes_it(tmp_path):
    log = tmp_path / "learner.log"
    log.write_text("".join(f"earlier line {i}\n" for i in range(200)))
    proc = await spawn([sys.executable, "-m", "learner.main", "--set", f'run_dir="{tmp_path / "run"}"',
                        "--set", 'learner.task_ids=["no-such-task"]',
                        "--set", 'transport.endpoint="tcp://127.0.0.1:0"'], log)
    async with asyncio.timeout(300):
        assert await proc.wait() == 1
    text = log.read_text()
    assert "arpo-learner ERROR Traceback (most recent call last):" in text
    excerpt = crash_excerpt(log)
    lines = excerpt.splitlines()
    assert lines[:2] == ["earlier line 198", "earlier line 199"]  # 2 lines of context before the traceback
    assert "Traceback (most recent call last):" in lines[2]
    assert "in select_tasks" in excerpt
    assert lines[-1] == "arpo-learner failed: TaskFormatError: no task matches learner.task_ids=['no-such-task']"
    assert crash_excerpt(tmp_path / "missing.log") == ""


def test_progress_line_names_the_tasks_set_aside(tmp_path):
    config = load_config(None, [f'run_dir="{tmp_path}"'])
    (tmp_path / "status.json").write_text(json.dumps({"outcomes": {"TASK_ERROR": 3}, "set_aside": ["bad-task"]}))
    line = progress_line(config, started=0.0, now=1.0)
    assert "task_error=3" in line and line.endswith("| SET ASIDE (task errors): bad-task")


@pytest.mark.parametrize("key", ["prepass", "baseline"])  # "baseline": the status.json of a run before issue 52
def test_progress_line_shows_the_task_prepass_under_its_new_and_its_old_status_key(tmp_path, key):
    config = load_config(None, [f'run_dir="{tmp_path}"'])
    (tmp_path / "status.json").write_text(json.dumps({key: {"groups_recorded": 3, "groups_planned": 8}}))
    line = progress_line(config, started=0.0, now=1.0)
    assert "task pre-pass 3/8 groups | " in line and "baseline" not in line


def test_progress_line_shows_groups_without_a_reward_difference_and_a_waiting_step(tmp_path):
    """Issue 49 item 1: the share of groups dropped for no reward difference, and, once groups_per_step of them
    came back since the last step, that the next step waits for groups with one; then the tasks solved."""
    from arpo_cli.progress import flat_text, stop_line

    config = load_config(None, [f'run_dir="{tmp_path}"', "learner.groups_per_step=2"])
    assert flat_text({}, 2) == "" and stop_line(config) == ""  # no status yet, no group yet
    status = {"step": 40, "totals": {"groups": 200}, "drops": {"zero_variance": 120}, "zero_variance_since_step": 1}
    (tmp_path / "status.json").write_text(json.dumps(status))
    line = progress_line(config, started=0.0, now=1.0)
    assert line.endswith("| no reward difference: 120 of 200 groups (60%)")
    status |= {"zero_variance_since_step": 12, "solved": ["grid4-green"]}
    (tmp_path / "status.json").write_text(json.dumps(status))
    line = progress_line(config, started=0.0, now=2.0)
    assert line.endswith("| no reward difference: 120 of 200 groups (60%) | the next step waits for groups with a "
                         "reward difference (12 since step 40 had none) | solved (set aside): grid4-green")
    assert "since the start had none" in flat_text({"step": 0, "totals": {"groups": 2}, "drops": {"zero_variance": 2},
                                                    "zero_variance_since_step": 2}, 2)
    status["stopped"] = "every task is solved in its last 4 groups: training stops"
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert stop_line(config) == status["stopped"]
    (tmp_path / "status.json").write_text("[1, 2]")  # not an object: no reason, no error
    assert stop_line(config) == ""
