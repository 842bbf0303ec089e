"""Discoverable config: `arpo config show` (arpo_async.config_doc + arpo_cli.cli), the commented example run files,
`--config`/`--set` and the config pointer in every command's --help, and arpo-serve's flags-over-run-file rule."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from arpo_async.config import (ActorConfig, ClusterConfig, EvalConfig, LearnerConfig, RunConfig, ServeConfig,
                               TransportConfig, load_config)
from arpo_async.config_doc import SECTIONS, describe, field_docs, render_toml
from arpo_serve.main import parse_args as serve_args

ROOT = Path(__file__).resolve().parents[2]
SECTION_CLASSES = {"": RunConfig, "transport": TransportConfig, "learner": LearnerConfig, "actors": ActorConfig,
                   "serve": ServeConfig, "eval": EvalConfig, "cluster": ClusterConfig}


def arpo(*args: str, module: str = "arpo_cli.cli") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *module.split(), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ARPO_API_KEY": ""})


def key_block(text: str, section: str, name: str) -> str:
    """The comment lines above ``name = ...`` in ``[section]`` of `arpo config show`'s output, and that line."""
    text = "\n" + text
    body = (text if section == "" else text.split(f"\n[{section}]\n", 1)[1]).split("\n[", 1)[0]
    match = re.search(rf"((?:^#.*\n)*)^{re.escape(name)} = .*$", body, re.MULTILINE)
    assert match, f"{section}.{name} not in the output"
    return match.group(0)


def test_sections_are_the_run_configs_tables():
    assert SECTIONS == ("transport", "learner", "actors", "serve", "eval", "cluster")


def test_every_key_shows_with_its_docstring_value_and_default(tmp_path):
    proc = arpo("config", "show", "--set", "learner.lr=1e-3", "--set", 'actors.grammar_actions=["click"]')
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    count = 0
    for section, cls in SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            if section == "" and f.name in SECTIONS:
                continue  # the tables themselves; actors.actors is a key
            count += 1
            doc = field_docs(cls).get(f.name, "")
            assert doc, f"{section or 'top'}.{f.name} has no attribute docstring in arpo_async/config.py"
            block = re.sub(r"\s*\n#\s*", " ", key_block(text, section, f.name))
            first_words = " ".join(doc.split()[:8])
            assert first_words in block, (section, f.name, block)
    assert count == len(describe()) > 60
    assert key_block(text, "learner", "lr").endswith("lr = 0.001  # default: 0.0005")
    assert key_block(text, "actors", "grammar_actions").endswith('grammar_actions = ["click"]  # default: []')
    assert key_block(text, "learner", "group_size").endswith("group_size = 4  # (default)")
    assert "AdamW learning rate" in key_block(text, "learner", "lr")
    # the output is a run file: it loads back to the same config
    (tmp_path / "shown.toml").write_text(text)
    assert load_config(tmp_path / "shown.toml") == load_config(None, ["learner.lr=1e-3",
                                                                      'actors.grammar_actions=["click"]'])


def test_show_reads_a_run_file_and_filters_sections():
    proc = arpo("config", "show", "--config", "examples/run-multihost.toml", "--section", "actors", "--section", "top")
    assert proc.returncode == 0, proc.stderr
    assert "[actors]" in proc.stdout and "[learner]" not in proc.stdout and "[serve]" not in proc.stdout
    assert key_block(proc.stdout, "actors", "actors").endswith("actors = 64  # default: 8")
    assert key_block(proc.stdout, "", "run_id").endswith('run_id = "multihost"  # default: ""')


def test_show_refuses_an_unknown_key_with_its_name():
    proc = arpo("config", "show", "--set", "learner.no_such_key=1")
    assert proc.returncode == 2 and "learner.no_such_key" in proc.stderr and proc.stdout == ""


def test_field_docs_reads_attribute_docstrings_only(tmp_path):
    @dataclasses.dataclass
    class Sample:
        """Class docstring, not a field's."""

        a: int = 1
        """First line.

            Indented second paragraph."""
        b: str = "x"
        c: float = 0.5  # a comment is no docstring
        "c's docstring"

        def method(self) -> None:
            """A method's docstring is no field's."""

        d: typing.ClassVar[int] = 3

    assert field_docs(Sample) == {"a": "First line.\n\nIndented second paragraph.", "c": "c's docstring"}
    text = render_toml(RunConfig(), width=60)
    assert all(len(line) <= 60 for line in text.splitlines() if line.startswith("#") and " " in line[2:])


@pytest.mark.parametrize("name", ["run-default.toml", "run-multihost.toml", "uitars-1.5-7b.toml"])
def test_example_run_files_load(name):
    assert isinstance(load_config(ROOT / "examples" / name), RunConfig)
    assert (ROOT / "examples" / name).read_text().startswith("# ")  # commented for the reader


def test_run_default_example_is_the_library_default():
    assert load_config(ROOT / "examples" / "run-default.toml") == RunConfig()
    multi = load_config(ROOT / "examples" / "run-multihost.toml")
    assert multi.transport.endpoint == "tcp://0.0.0.0:5555" and multi.serve.host == "0.0.0.0"


@pytest.mark.parametrize(("module", "sections"), [
    ("arpo_cli.cli", ()),
    ("arpo_cli.cli run", ("[transport]", "[learner]", "[actors]", "[serve]")),
    ("arpo_cli.cli config show", ("[learner]",)),
    ("arpo_cli.cli launch", ("[cluster]", "[transport]", "[learner]", "[actors]", "[serve]")),
    ("arpo_cli.cli tasks check", ("[learner]", "[actors]")),
    ("arpo_serve.main", ("[serve]",)),
    ("learner.main", ("[learner]", "[transport]", "[actors]", "[serve]")),
    ("actors.main", ("[actors]", "[transport]", "[learner]", "[serve]")),
])
def test_help_names_the_sections_and_points_to_config_show(module, sections):
    proc = arpo("--help", module=module)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "arpo config show" in text
    for section in sections:
        assert section in text, (module, section)
    if module != "arpo_cli.cli":
        assert "--config FILE" in text and "--set KEY=VALUE" in text
    assert "wires every component" not in text  # developer notes stay in the module docstrings


@pytest.mark.parametrize("module", ["arpo_cli.cli config show", "arpo_cli.cli launch --address 127.0.0.1:1",
                                    "learner.main", "actors.main"])
def test_a_binary_config_file_is_one_line_naming_it(module, tmp_path):
    """Issue 39 item 10: `arpo config show`, `arpo launch`, `arpo-learner` and `arpo-actors` given a binary run file
    print one line naming it and exit non-zero, with no traceback."""
    path = tmp_path / "run.toml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    proc = arpo("--config", str(path), module=module)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if str(path) in ln]
    assert len(lines) == 1 and "not UTF-8 text" in lines[0], proc.stderr


def fake_model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_serve_reads_the_run_file_and_flags_win(tmp_path, monkeypatch):
    monkeypatch.delenv("ARPO_API_KEY", raising=False)
    model = fake_model(tmp_path / "m")
    other = fake_model(tmp_path / "other")
    run = tmp_path / "run.toml"
    run.write_text(f'model = "{model}"\n[serve]\nhost = "0.0.0.0"\nport = 31234\nmax_batch = 3\n'
                   'jump_forward = false\napi_key = "from-file"\n')
    from_file = serve_args(["--config", str(run)])
    s = from_file.serve
    assert (from_file.model_path, s.host, s.port, s.max_batch, s.jump_forward, s.api_key) == (
        model, "0.0.0.0", 31234, 3, False, "from-file")
    flags = serve_args(["--config", str(run), "--set", "serve.port=31235", "--model", str(other), "--host",
                        "127.0.0.1", "--max-batch", "5", "--jump-forward", "--api-key", "from-flag",
                        "--weight-version", "7", "--seed", "3", "--logprob-mode", "sglang"])
    s = flags.serve
    assert (flags.model_path, s.host, s.port, s.max_batch, s.jump_forward, s.api_key) == (
        other.resolve(), "127.0.0.1", 31235, 5, True, "from-flag")
    assert (s.weight_version, s.seed, s.logprob_mode) == ("7", 3, "sglang")
    assert serve_args(["--config", str(run), "--set", "serve.port=1", "--port", "2"]).serve.port == 2  # flag last
    monkeypatch.setenv("ARPO_API_KEY", "from-env")
    assert serve_args(["--config", str(run)]).serve.api_key == "from-env"  # the environment wins over the file
    # without a run file: the flags alone, as before, and the config defaults
    plain = serve_args(["--model", str(model)]).serve
    assert (plain.host, plain.port, plain.max_batch, plain.jump_forward) == ("127.0.0.1", 0, 16, True)  # 0: a free port
    # the empty model key means <run_dir>/../tiny-model, as for the learner and arpo run
    tiny = fake_model(tmp_path / "tiny-model")
    assert serve_args(["--set", f'run_dir="{tmp_path / "demo"}"']).model_path == tiny


@pytest.mark.parametrize(("args", "message"), [
    ([], "--model or --config is required"),
    (["--model", "/nonexistent/model"], "no model at /nonexistent/model"),
    (["--set", "serve.nope=1"], "serve.nope"),
    (["--model", "/nonexistent/model", "--max-batch", "0"], "serve.max_batch"),
])
def test_serve_usage_errors_name_the_problem(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_args(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
