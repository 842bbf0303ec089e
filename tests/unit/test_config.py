"""Config: TOML + overrides, validation with clear errors, and a dump that loads back equal."""

import dataclasses
import json
import typing
from pathlib import Path

import pytest

from arpo_async.config import ActorConfig, ConfigError, LearnerConfig, RunConfig, ServeConfig, dump_toml, load_config
from arpo_serve.engine import LOGPROB_MODES
from learner.algo.grpo import CORRECTION_MODES
from learner.algo.replay import REPLAY_MODES
from learner.algo.task_selection import SELECTION_STRATEGIES


def test_defaults_are_the_embedded_run():
    config = load_config()
    assert config.actors.actors == 8 and config.learner.steps == 3
    assert config.learner.batch_trajectories == config.learner.group_size * config.learner.groups_per_step


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "x"\n[learner]\nlr = 1\ngroup_size = 8\n[actors]\ninference_urls = ["http://a:1"]\n')
    config = load_config(path, ["learner.steps=7", "actors.constrained=false", 'actors.image="img:1"'])
    assert config.run_dir == "x" and config.learner.lr == 1.0 and config.learner.group_size == 8
    assert config.learner.steps == 7 and config.actors.constrained is False and config.actors.image == "img:1"
    assert config.actors.inference_urls == ("http://a:1",)


@pytest.mark.parametrize("overrides,message", [
    (["learner.nope=1"], "unknown config key"),
    (["learner.group_size=1"], "learner.group_size: must be >= 2, got 1"),
    (["learner.lr=fast"], "learner.lr: must be float, got 'fast'"),
    (["actors.coordinate_mode=pixels"], "absolute"),
    (["actors.prompt_style=verbose"], "actors.prompt_style: must be 'compact' or 'uitars'"),
    (["actors.desktop_max_episodes=0"], "actors.desktop_max_episodes: must be > 0, got 0"),
    (["transport.endpoint=localhost:1"], "ZeroMQ endpoint"),
    (["learner"], "section.key=value"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unreadable_toml(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[learner\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(path)


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not UTF-8 text"),
    (("a = " + "[" * 50_000 + "]" * 50_000).encode(), "nested too deeply"),
    (b"[learner]\nlr = 1e400\n", "learner.lr: must be a finite number"),
])
def test_a_binary_or_deeply_nested_file_is_one_error_naming_the_file(tmp_path, content, message):
    """Issue 39 item 10: a ConfigError naming the file (its commands print it as one line), not a traceback."""
    path = tmp_path / "run.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path)
    assert "\n" not in str(caught.value) and (str(path) in str(caught.value) or "learner.lr" in str(caught.value))


@pytest.mark.parametrize("overrides, message", [
    (["serve.port=70000"], "serve.port: must be <= 65535"),
    (["serve.port=-1"], "serve.port: must be >= 0"),
    (["actors.step_timeout_s=inf"], "actors.step_timeout_s: must be a finite number"),
    (["learner.sync_timeout_s=nan"], "learner.sync_timeout_s: must be a finite number"),
    (["transport.resend_after_s=-1"], r"transport.resend_after_s: must be in \[0, 2,592,000\] seconds"),
    (["learner.dist_timeout_s=1e9"], r"learner.dist_timeout_s: must be in \[0, 2,592,000\] seconds"),
    (["actors.setup_timeout_s=" + "[" * 5000 + "]" * 5000], "actors.setup_timeout_s"),
])
def test_ports_and_durations_are_bounded(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_dump_round_trip(tmp_path):
    config = load_config(None, ["learner.task_ids=['grid4-']", "actors.max_steps=3", 'model="/m"'])
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(config))
    assert load_config(path) == config
    assert isinstance(config, RunConfig)


def test_the_gpu_example_config_loads_with_every_key_valid():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "uitars-1.5-7b.toml"
    config = load_config(example, [])
    lc = config.learner
    assert (lc.device, lc.dtype, lc.weight_sync, lc.gradient_checkpointing) == ("cuda", "bfloat16", "distributed", True)
    assert config.actors.prompt_style == "uitars" and not config.actors.constrained


def test_learner_hardware_keys_are_checked():
    for bad in ('learner.device="tpu"', 'learner.dtype="float16"', "learner.max_tokens_per_microbatch=-1",
                'learner.weight_sync="nfs"', 'learner.sync_backend="mpi"', "learner.sync_bucket_mb=0",
                "learner.dist_timeout_s=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


def test_the_run_file_round_trips_strings_toml_must_escape(tmp_path):
    """dump_toml writes with tomli_w: a newline, a tab, quotes and a backslash in a string come back unchanged
    (the hand-written writer escaped only backslash and quote, so a newline wrote invalid TOML)."""
    from arpo_async.config import dump_toml, load_config

    awkward = 'line one\nline "two"\t\\ end'
    config = load_config(None, [f"run_id={json.dumps(awkward)}"])
    assert config.run_id == awkward
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(config))
    assert load_config(path, []) == config


@pytest.mark.parametrize("override,message", [
    ("learner.steps=true", "learner.steps: must be int, got True"),  # a bool is not an int
    ('learner.lr="1e-3"', "learner.lr: must be float, got '1e-3'"),  # a str is not a number
    ("learner.replay=1", "learner.replay: must be bool, got 1"),
    ("learner.max_staleness=1.5", "learner.max_staleness: must be int"),
    ("learner.task_ids=[1]", "learner.task_ids: must be str, got 1"),
    ("actors.inference_urls=[]", "actors.inference_urls: needs at least 1"),
    ("learner=3", "learner: must be a table"),
    ("nosection.key=1", r"unknown config section 'nosection' \(`arpo config show` lists the known keys\)"),
    ("transport.peer_timeout_s=4", "transport.peer_timeout_s: must be more than 2 heartbeats"),
])
def test_types_are_strict_and_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_toml_value_of_the_wrong_type_is_refused_in_a_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("run_dir = 3\n")
    with pytest.raises(ConfigError, match="run_dir: must be str, got 3"):
        load_config(path)


@pytest.mark.parametrize("override,meant", [
    ("lr=1", "did you mean learner.lr?"),  # a key of one section, written bare
    ("actors.lr=1", "did you mean learner.lr?"),  # ... or in the wrong section
    ("learner.run_dir=x", "did you mean run_dir?"),  # a top-level key inside a section
    ("learner.lrr=1", "did you mean learner.lr?"),  # a typo: difflib over the section's keys
    ("learner.stepz=1", "did you mean learner.steps?"),
    ("lrr=1", "did you mean learner.lr?"),  # a typo of a section's key, written bare
    ("tasks=x", "did you mean learner.tasks or eval.tasks?"),  # a name two sections have
    ("lerner.lr=1", "unknown config section 'lerner'; did you mean learner?"),
])
def test_an_unknown_key_is_pointed_to_the_key_it_probably_meant(override, meant):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert meant in str(error.value) and "known:" not in str(error.value)


def test_an_unknown_key_in_a_run_file_is_pointed_to_the_key_it_probably_meant(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("lr = 1e-3\n[learner]\ngroup = 4\n[actor]\nactors = 2\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert "unknown config key 'lr'; did you mean learner.lr?" in message
    assert "unknown config key 'learner.group'; did you mean learner.group_size?" in message
    assert "unknown config section 'actor'; did you mean actors?" in message


def test_a_key_far_from_every_known_one_gets_where_the_keys_are_listed():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.xyzzy' \(`arpo config show --section "
                                          r"learner` lists the known keys\)$"):
        load_config(None, ["learner.xyzzy=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'xyzzy' \(`arpo config show` lists the known keys\)$"):
        load_config(None, ["xyzzy=1"])


def test_set_values_are_parsed_by_the_fields_type():
    """A str field takes the text as written (a TOML-quoted string is unquoted); every other field a TOML value."""
    config = load_config(None, ["run_id=2024", 'model="/m 1"', "run_dir='r'", "learner.tasks=true",
                                "learner.schedule=lockstep", 'actors.image_profile="osworld"',
                                "learner.task_ids=2024", "actors.inference_urls=['http://a:1', 'http://b:1']",
                                "learner.lr=1e-3", "learner.steps=7", "actors.constrained=false",
                                "learner.replay=true", "learner.replay_alpha=0.5"])
    assert (config.run_id, config.model, config.run_dir, config.learner.tasks) == ("2024", "/m 1", "r", "true")
    assert config.learner.schedule == "lockstep" and config.actors.image_profile == "osworld"
    assert config.learner.task_ids == ("2024",) and config.actors.inference_urls == ("http://a:1", "http://b:1")
    assert config.learner.lr == 1e-3 and config.learner.steps == 7 and config.actors.constrained is False
    assert config.learner.replay is True and config.learner.replay_alpha == 0.5
    with pytest.raises(ConfigError, match="learner.steps: must be int, got '7x'"):
        load_config(None, ["learner.steps=7x"])


def test_an_int_is_a_float_and_a_list_or_one_value_a_tuple():
    config = load_config(None, ["learner.lr=1", "actors.inference_urls=http://x", "learner.task_ids=['a', 'b']"])
    assert config.learner.lr == 1.0 and type(config.learner.lr) is float
    assert config.actors.inference_urls == ("http://x",) and config.learner.task_ids == ("a", "b")


def test_every_problem_and_every_unknown_key_is_named_at_once():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["learner.nope=1", "learner.nope2=1", "learner.lr=0", "learner.schedule=x"])
    message = str(error.value)
    assert "unknown config key 'learner.nope' (" in message and "unknown config key 'learner.nope2' (" in message
    assert "known: [" not in message and "`arpo config show --section learner` lists the known keys" in message
    assert "learner.lr: must be > 0, got 0" in message
    assert "learner.schedule: must be 'async' or 'lockstep', got 'x'" in message


def test_building_a_config_directly_validates_it_and_names_the_key():
    with pytest.raises(ConfigError, match="learner.schedule: must be 'async' or 'lockstep'"):
        LearnerConfig(schedule="x")
    with pytest.raises(ConfigError, match="actors.max_steps: must be > 0"):
        dataclasses.replace(ActorConfig(), max_steps=0)
    with pytest.raises(ConfigError, match=r"unknown config key 'learner.no_such' \("):
        LearnerConfig(no_such=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LearnerConfig().lr = 1.0  # type: ignore[misc]
    assert dataclasses.replace(LearnerConfig(), lr=2).lr == 2.0


@pytest.mark.parametrize("kwargs", [
    {"lr": 0.0}, {"lr": float("inf")}, {"lr": float("nan")}, {"weight_decay": -0.1}, {"grad_clip": -1.0},
    {"eps_low": 1.0}, {"eps_high": 0.0}, {"dual_clip": 1.0}, {"max_tokens_per_microbatch": -1}, {"device": "tpu"},
    {"dtype": "float16"}, {"torch_threads": 0}, {"logprob_chunk_tokens": 0}, {"correction": "none"},
    {"decoupled_cap": 1.0}, {"decoupled_cap": float("inf")}, {"tis_cap": 0.0}, {"tis_cap": float("inf")},
])
def test_the_trainers_ranges_are_checked(kwargs):
    (name,) = kwargs
    with pytest.raises(ConfigError, match=f"learner.{name}: "):
        LearnerConfig(**kwargs)


@pytest.mark.parametrize("cls,key,modes", [
    (LearnerConfig, "correction", CORRECTION_MODES), (LearnerConfig, "replay_mode", REPLAY_MODES),
    (LearnerConfig, "task_strategy", SELECTION_STRATEGIES), (ServeConfig, "logprob_mode", LOGPROB_MODES),
])
def test_the_choices_are_those_of_the_code_that_takes_them(cls, key, modes):
    """arpo_async may not import learner/ or arpo_serve/, so the config spells their choices out as a Literal."""
    assert typing.get_args(typing.get_type_hints(cls)[key]) == modes


def test_the_correction_cap_is_the_selected_modes():
    assert LearnerConfig(correction="tis").correction_cap == 2.0 and LearnerConfig().correction_cap == 5.0


def test_the_trainers_runtime_config_errors_are_config_errors():
    """learner.device "cuda" without CUDA or a sample over the micro-batch budget is found only when training
    starts (learner.train.trainer's TrainerConfigError); one ``except ConfigError`` catches it with the rest."""
    from learner.train.trainer_errors import TrainerConfigError

    assert issubclass(TrainerConfigError, ConfigError)


CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads_and_names_built_in_tasks(path):
    """configs/*.toml (the README's runs) load with every key valid, and their task_ids name built-in tasks (a config
    that trains on a task folder, configs/arpo-osworld.toml, is checked in tests/unit/test_learner_split.py)."""
    from arpo_async.tasks import load_tasks

    config = load_config(path, [])
    if config.learner.tasks:
        return
    ids = {t.id for t in load_tasks()}
    assert config.learner.task_ids and all(any(i == p or i.startswith(p) for i in ids) for p in config.learner.task_ids)


def test_the_old_baseline_keys_are_read_as_the_prepass_keys_with_one_warning_each(tmp_path, caplog):
    """Issue 52 item 3: ARPO's task pre-pass is no longer called "baseline"; a run file written before the rename
    still loads (c7b7a74 has no learner.prepass_k, so this fails there), and says which key to use now."""
    path = tmp_path / "old.toml"
    path.write_text("[learner]\nbaseline_k = 4\nbaseline_min_success = 2\nbaseline_drop_solved = true\n")
    with caplog.at_level("WARNING", logger="arpo_async.config"):
        lc = load_config(path).learner
    assert (lc.prepass_k, lc.prepass_min_success, lc.prepass_drop_solved) == (4, 2, True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(str(path) in line and "rename it" in line for line in lines)
    for old, new in [("learner.baseline_k", "learner.prepass_k"), ("learner.baseline_drop_solved",
                                                                   "learner.prepass_drop_solved")]:
        assert sum(f"{old} is now called {new}" in line for line in lines) == 1
    assert "prepass_k = 4" in dump_toml(load_config(path)) and "baseline" not in dump_toml(load_config(path))
    caplog.clear()
    with caplog.at_level("WARNING", logger="arpo_async.config"):  # an override by the old name, too
        assert load_config(None, ["learner.baseline_k=3"]).learner.prepass_k == 3
    assert [r.getMessage().count("learner.prepass_k") > 0 for r in caplog.records] == [True]
    with pytest.raises(ConfigError, match="learner.prepass_k: must be int, got 'many'"):
        load_config(None, ["learner.baseline_k=many"])  # the value is checked under the new name


@pytest.mark.parametrize("table", ["baseline_k = 4\nprepass_k = 4",
                                   "prepass_min_success = 1\nbaseline_min_success = 2"])
def test_a_run_file_with_both_the_old_and_the_new_prepass_key_is_refused(tmp_path, table):
    path = tmp_path / "both.toml"
    path.write_text(f"[learner]\n{table}\n")
    with pytest.raises(ConfigError, match=rf"config {path}: both learner\.baseline_\w+ and learner\.prepass_\w+ "
                                          r"are given; .* keep only learner\.prepass_"):
        load_config(path)
    old_only = tmp_path / "old.toml"
    old_only.write_text("[learner]\nbaseline_k = 4\n")  # an override by the new name on an old file is no clash
    assert load_config(old_only, ["learner.prepass_k=6"]).learner.prepass_k == 6
