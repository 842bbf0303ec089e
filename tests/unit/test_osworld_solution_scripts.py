"""actors.osworld.solutions: the stored reference solutions load, every step renders as a reply the episode loop
parses back to the stored action (text, keys, points), and malformed solution files are refused with one line
naming the file, task and step."""
from __future__ import annotations

import json
import re

import pytest

from actors.osworld.solutions import SolutionError, load_solutions, read_solutions, reply_action
from actors.uitars.actions import parse_reply

SCREEN = (1280, 720)


def _point(x: float, y: float) -> str:
    return f"({round(x)},{round(y)})"


def test_stored_solutions_cover_at_least_40_tasks_in_6_domains():
    solutions = load_solutions()
    assert len(solutions) >= 40 and len({s.domain for s in solutions.values()}) >= 6
    assert all(len(task_id) == 36 for task_id in solutions)  # OSWorld's uuid file names


def test_every_stored_step_parses_back_to_itself():
    for sol in load_solutions().values():
        for step in sol.steps:
            thought, action = reply_action(step, _point)
            parsed = parse_reply(f"Thought: {thought}\nAction: {action}", resized_size=SCREEN, screen_size=SCREEN,
                                 coordinate_mode="absolute").action
            kind = next(k for k in ("type", "hotkey", "click", "left_double", "wait", "call_user", "finished")
                        if k in step)
            expected = {"call_user": "fail"}.get(kind, kind)
            assert parsed.kind == expected, (sol.task_id, step)
            if kind == "type":
                assert parsed.text == step["type"], sol.task_id
            if kind == "hotkey":
                assert parsed.key == step["hotkey"], sol.task_id
            if kind in ("click", "left_double"):
                assert parsed.point == tuple(float(v) for v in step[kind])


def test_a_type_step_with_quotes_backslashes_and_newlines_survives_the_reply():
    text = "sed -i 's/^\\[qt\\]$/&\\nx=1/' ~/f; echo \"a'b\"\n"
    _, action = reply_action({"type": text}, _point)
    parsed = parse_reply(f"Action: {action}", resized_size=SCREEN, screen_size=SCREEN, coordinate_mode="absolute")
    assert parsed.action.text == text and parsed.action.submits


HOSTILE = {
    "not json": ("{", "cannot read it"),
    "no screen": ({"solutions": {}}, "'screen' must be"),
    "screen of zero": ({"screen": [0, 720], "solutions": {}}, "'screen' must be"),
    "solutions a list": ({"screen": [1280, 720], "solutions": []}, "'solutions' must be an object"),
    "no note": ({"t": {"steps": [{"wait": True}]}}, "task t: needs 'steps'"),
    "empty steps": ({"t": {"note": "", "steps": []}}, "task t: needs 'steps'"),
    "two actions": ({"t": {"note": "", "steps": [{"wait": True, "hotkey": "a"}]}}, "step 0: needs exactly one"),
    "unknown field": ({"t": {"note": "", "steps": [{"wait": True, "sleep": 3}]}}, "step 0: needs exactly one"),
    "unknown key": ({"t": {"note": "", "steps": [{"hotkey": "ctrl hyper"}]}}, "step 0: unknown key 'hyper'"),
    "bad point": ({"t": {"note": "", "steps": [{"click": [1, "a"]}]}}, "step 0: click needs [x, y]"),
    "scroll, no direction": ({"t": {"note": "", "steps": [{"scroll": [1, 2]}]}}, "step 0: scroll needs a direction"),
    "call_user first": ({"t": {"note": "", "steps": [{"call_user": True}, {"wait": True}]}},
                        "step 0: call_user ends the episode"),
    "bad regex": ({"t": {"note": "", "steps": [{"wait": True, "then_window": "(["}]}},
                  "step 0: then_window needs a regular expression"),
    "type not text": ({"t": {"note": "", "steps": [{"type": 3}]}}, "step 0: type needs a string"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_malformed_solution_file_is_refused_naming_what_is_wrong(tmp_path, case):
    body, message = HOSTILE[case]
    if isinstance(body, dict) and "screen" not in body and "solutions" not in body:
        body = {"screen": [1280, 720], "solutions": body}
    path = tmp_path / "os.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(SolutionError, match="^" + re.escape(str(path)) + ".*" + re.escape(message)):
        read_solutions(path)


def test_a_task_solved_in_two_files_is_refused(tmp_path):
    body = {"screen": [1280, 720], "solutions": {"t": {"note": "", "steps": [{"wait": True}]}}}
    for name in ("os.json", "vlc.json"):
        (tmp_path / name).write_text(json.dumps(body))
    with pytest.raises(SolutionError, match="task t is already solved in os.json"):
        load_solutions(tmp_path)


def test_a_plan_gets_its_closing_finished_unless_it_ends_the_episode_itself(tmp_path):
    path = tmp_path / "os.json"
    path.write_text(json.dumps({"screen": [1280, 720], "solutions": {
        "a": {"note": "", "steps": [{"hotkey": "ctrl alt t"}, {"type": "ls\n"}]},
        "b": {"note": "", "steps": [{"call_user": True}]}}}))
    assert {s.task_id: s.actions for s in read_solutions(path)} == {"a": 3, "b": 1}


ACTING_DOMAINS_BEFORE = {"os", "gimp", "vlc", "chrome"}
"""The domains whose stored solutions acted (did more than call_user) before issue 51 item 5's additions."""


def test_at_least_12_solutions_act_in_at_least_3_domains_that_had_none_acting():
    acting = [s for s in load_solutions().values() if s.steps[-1] != {"call_user": True}]
    new = [s for s in acting if s.domain not in ACTING_DOMAINS_BEFORE]
    assert len(new) >= 12 and len({s.domain for s in new}) >= 3, sorted((s.domain, s.task_id[:8]) for s in new)
