"""The learner's trajectory sample: which trajectories are kept, what their record holds, the disk budget."""

import asyncio
import io
import json

import pytest
from PIL import Image

from arpo_async.messages import Outcome, Step, Trajectory
from arpo_async.tasks import Task
from learner.rollouts.trajectory_sample import (RECORD_FILE, TrajectorySampler, image_size, image_suffix,
                                                parse_compact_actions, thought_of)

TASK = Task.from_dict({"id": "grid4-red", "instruction": "Click the red square.", "config": [],
                       "evaluator": {"func": "infeasible"}})


def png(width: int = 64, height: int = 36, colour: str = "white") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, "PNG")
    return out.getvalue()


def trajectory(tid: str, outcome: Outcome = Outcome.FAILURE, *, shots: int = 2, pad: int = 0,
               task_id: str = "grid4-red") -> Trajectory:
    screenshots = [png(colour=c) for c in ("white", "black", "red")[:shots]]
    if pad:
        screenshots[0] += b"\0" * pad  # a bigger file, same header
    steps = [Step(prompt_ids=[1], image_indices=[0], output_ids=[5, 6], logprobs=[-0.1, -0.2], versions=[3, 4],
                  text="Thought: red is left\nAction: click(start_box='(10,20)')", action="click(10,20)",
                  generate_s=0.5, act_s=0.1, observe_s=0.2),
             Step(prompt_ids=[1], image_indices=[0, 1], output_ids=[7], logprobs=[-0.3], versions=[4],
                  text="Action: drag(...)", action="drag(1,2,30,40)")]
    return Trajectory(tid, "actor-1", task_id, "g1", 0, outcome.value, 1.0 if outcome == Outcome.SUCCESS else 0.0,
                      True, steps, screenshots, timings={"reset_s": 1.5, "episode_s": 3.0}, assigned_version=3)


def test_parse_compact_actions():
    assert parse_compact_actions("click(640,360)") == [
        {"kind": "click", "point": [640.0, 360.0], "end_point": None, "detail": ""}]
    assert parse_compact_actions("drag(10,20,300,40)")[0]["end_point"] == [300.0, 40.0]
    assert parse_compact_actions("type('a; b(1,2)\\n'); hotkey('ctrl c')") == [
        {"kind": "type", "point": None, "end_point": None, "detail": "a; b(1,2)\n"},
        {"kind": "hotkey", "point": None, "end_point": None, "detail": "ctrl c"}]
    assert parse_compact_actions("finished()") == [{"kind": "finished", "point": None, "end_point": None,
                                                    "detail": ""}]
    assert parse_compact_actions("") == []
    assert parse_compact_actions("click(1,2,3)") == []
    assert parse_compact_actions("not an action") == []


def test_small_helpers():
    assert thought_of("Thought: go left\nAction: click(1,2)") == "go left"
    assert thought_of("Action: click(1,2)") == ""
    assert image_suffix(png()) == ".png" and image_suffix(b"\xff\xd8\xff") == ".jpg" and image_suffix(b"x") == ".bin"
    assert image_size(png(80, 40)) == (80, 40) and image_size(b"garbage") == (0, 0)
    # a received screenshot is a memoryview of its ZeroMQ frame (arpo_async.codec)
    assert image_suffix(memoryview(png())) == ".png" and image_size(memoryview(png(80, 40))) == (80, 40)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="rate"):
        TrajectorySampler(tmp_path, rate=1.5, disk_mb=1)
    with pytest.raises(ValueError, match="budget"):
        TrajectorySampler(tmp_path, rate=0.1, disk_mb=0)


def test_record_holds_what_the_viewer_shows(tmp_path):
    sampler = TrajectorySampler(tmp_path / "trajectories", rate=1.0, disk_mb=10)
    folder = asyncio.run(sampler.offer(trajectory("abc"), TASK, step=7, version=4))
    assert folder is not None and folder.name == "000007-grid4-red-abc"
    record = json.loads((folder / RECORD_FILE).read_text())
    assert record["instruction"] == "Click the red square." and record["outcome"] == "FAILURE"
    assert record["screen_size"] == [64, 36] and record["screenshots"] == ["shot-0.png", "shot-1.png"]
    assert (folder / "shot-1.png").read_bytes() == png(colour="black")
    first, second = record["steps"]
    assert first["thought"] == "red is left" and first["screenshot"] == 0 and first["versions"] == [3, 4]
    assert first["actions"][0]["point"] == [10.0, 20.0] and first["generate_s"] == 0.5
    assert second["screenshot"] == 1 and second["actions"][0]["end_point"] == [30.0, 40.0]
    assert record["policy_version"] == 4 and record["assigned_version"] == 3 and record["learner_step"] == 7
    assert record["timings"] == {"reset_s": 1.5, "episode_s": 3.0}
    assert not list(tmp_path.glob("trajectories/.*"))  # no temporary folder left behind


def test_first_success_of_each_task_is_kept_at_rate_zero(tmp_path):
    sampler = TrajectorySampler(tmp_path, rate=0.0, disk_mb=10)
    kept = [asyncio.run(sampler.offer(trajectory(tid, outcome, task_id=task), TASK, step=1, version=1))
            for tid, outcome, task in [("a", Outcome.FAILURE, "t1"), ("b", Outcome.SUCCESS, "t1"),
                                       ("c", Outcome.SUCCESS, "t1"), ("d", Outcome.SUCCESS, "t2")]]
    assert [k is not None for k in kept] == [False, True, False, True]
    assert json.loads((kept[1] / RECORD_FILE).read_text())["first_success"] is True
    # a resumed learner still knows which tasks have their first success kept
    again = TrajectorySampler(tmp_path, rate=0.0, disk_mb=10)
    assert again.solved == {"t1", "t2"} and len(again.kept) == 2
    assert asyncio.run(again.offer(trajectory("e", Outcome.SUCCESS, task_id="t1"), TASK, step=2, version=2)) is None


def test_rate_is_a_fraction_of_ids_and_stable(tmp_path):
    sampler = TrajectorySampler(tmp_path, rate=0.05, disk_mb=10)
    ids = [f"{i:032x}" for i in range(4000)]
    chosen = [tid for tid in ids if sampler.chosen(tid)]
    assert 0.035 < len(chosen) / len(ids) < 0.065
    assert chosen == [tid for tid in ids if TrajectorySampler(tmp_path, rate=0.05, disk_mb=10).chosen(tid)]


def test_disk_budget_deletes_oldest_unpinned(tmp_path):
    budget_mb = 0.05  # 52,428 bytes: room for two 20 kB samples, not three
    sampler = TrajectorySampler(tmp_path, rate=1.0, disk_mb=budget_mb)
    pinned = asyncio.run(sampler.offer(trajectory("s0", Outcome.SUCCESS, pad=20_000), TASK, step=0, version=0))
    folders = [asyncio.run(sampler.offer(trajectory(f"f{i}", pad=20_000), TASK, step=i + 1, version=0))
               for i in range(4)]
    assert pinned.is_dir()  # a first success is never deleted
    assert folders[-1].is_dir() and not folders[0].exists() and not folders[1].exists()
    assert sampler.deleted >= 2
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file())
    assert on_disk <= budget_mb * 2 ** 20 and on_disk == sampler.used_bytes
