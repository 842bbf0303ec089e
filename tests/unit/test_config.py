"""Config: TOML + overrides, validation with clear errors, and a dump that loads back equal."""

import json

import pytest

from arpo_async.config import ConfigError, RunConfig, dump_toml, load_config


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
    (["learner.group_size=1"], "at least 2"),
    (["learner.lr=fast"], "must be float"),
    (["actors.coordinate_mode=pixels"], "absolute"),
    (["actors.prompt_style=verbose"], "actors.prompt_style: must be 'compact' or 'uitars'"),
    (["actors.desktop_max_episodes=0"], "actors.desktop_max_episodes: must be >= 1"),
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
