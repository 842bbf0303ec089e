"""The `arpo` command's help and messages: nothing points outside the repository, and messages name CLI flags."""
from __future__ import annotations

import argparse
import re

import pytest

from arpo_cli.cli import build_parser, main


def _all_help(parser: argparse.ArgumentParser, name: str = "arpo") -> dict[str, str]:
    """Every command's and subcommand's ``--help`` text, by command line."""
    texts = {name: parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                texts.update(_all_help(subparser, f"{name} {sub}"))
    return texts


def test_no_help_text_names_a_path_outside_the_repository_or_a_package_index_name():
    """Users have the clone only: no ../shared/, DESIGN.md or REFERENCE.md, and the package is on no index, so
    an extra is installed from the clone (pip install -e '.[cluster]'), never as 'arpo-async[...]'."""
    texts = _all_help(build_parser())
    assert {"arpo tasks check", "arpo run", "arpo curve", "arpo view", "arpo init-model"} <= set(texts)
    for command, text in texts.items():
        flat = " ".join(text.split())
        for bad in ("../", "shared/", "DESIGN.md", "REFERENCE.md", "arpo-async["):
            assert bad not in flat, f"`{command} --help` names {bad!r}"
    assert "arpo_async/tasks_builtin" in " ".join(texts["arpo tasks check"].split())


def test_eval_help_names_every_config_section_it_reads():
    """`arpo eval` reads learner.osworld_files (the mirror of OSWorld's files its download steps use) and
    learner.success_threshold besides [actors] and [serve]: its help must not say those two sections are all."""
    flat = " ".join(_all_help(build_parser())["arpo eval"].split())
    assert "reads the run file's top-level keys (run_dir, model, run_id), [learner], [actors], [serve]." in flat

def test_init_model_names_the_flag_that_replaces_a_folder(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "something").write_text("x")
    assert main(["init-model", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"arpo init-model: {out} exists and is not empty; add --force to replace it" in err
    assert not re.search(r"overwrite\s*=", err) and (out / "something").exists()


@pytest.mark.parametrize("folder", ["runs/demo", "2024", "runs/a\\b", 'runs/"q"x', "true"])
def test_run_flags_set_the_path_as_written(folder):
    """--out and --model become run_dir and model exactly (a str key takes an override's text as written)."""
    from arpo_cli.cli import _run_config

    config = _run_config(build_parser().parse_args(["run", "--out", folder, "--model", f"{folder}/m"]))
    assert (config.run_dir, config.model) == (folder, f"{folder}/m")
