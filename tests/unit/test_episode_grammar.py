"""The actors' sampling parameters: the action regex follows the coordinate format of the config."""

from __future__ import annotations

import re

from actors.episode import RELATIVE_MAX, EpisodeRunner
from arpo_async.config import load_config
from arpo_async.model.inputs import PromptEncoder


def _points(regex: str, reply_points: list[str]) -> list[bool]:
    pattern = re.compile(regex)
    return [bool(pattern.fullmatch(f"Thought: go\nAction: click(start_box='{p}')")) for p in reply_points]


def test_relative1000_fixed_width_regex_covers_the_whole_screen(tiny_model):
    runner = EpisodeRunner(PromptEncoder(tiny_model), None, load_config(None, []).actors)
    regex = runner.sampling_params["regex"]
    assert RELATIVE_MAX == 999
    assert _points(regex, ["(000,000)", "(999,999)", "(512,007)"]) == [True, True, True]
    assert _points(regex, ["(0,0)", "(1000,5)", "(45,730)"]) == [False, False, False]


def test_absolute_plain_regex_keeps_points_on_the_resized_image(tiny_model):
    actors = load_config(None, ['actors.coordinate_mode="absolute"', "actors.fixed_width_coordinates=false"]).actors
    runner = EpisodeRunner(PromptEncoder(tiny_model), None, actors)
    w, h = runner.resized_size
    regex = runner.sampling_params["regex"]
    assert _points(regex, [f"({w - 1},{h - 1})", "(0,0)", f"({w},0)", "(007,5)"]) == [True, True, False, False]


def test_unconstrained_actors_send_no_regex(tiny_model):
    runner = EpisodeRunner(PromptEncoder(tiny_model), None, load_config(None, ["actors.constrained=false"]).actors)
    assert "regex" not in runner.sampling_params
