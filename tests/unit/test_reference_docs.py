"""The generated reference pages (docs/reference/*.md, arpo_cli.reference_docs) against the code: the pages on disk
are what the code generates today, the config page has every field of every config class, the CLI page every
command of `arpo` and every flag, and the metric fields (arpo_async.metric_fields) are exactly the keys a record
can carry: those of a record the real learner.train.records.step_record builds from a real LearnerService (with a real
ZeroMQ socket pump for ``messages``), plus the keys its caller learner.train.loop.TrainingLoop.train adds, read
from that caller's source, and the evaluation fields learner.rollouts.evaluation_rounds returns."""

import argparse
import ast
import asyncio
import dataclasses
import inspect
import itertools
import os
import socket
import textwrap

import pytest
import zmq
import zmq.asyncio

from arpo_async.config import SECTION_TYPES, RunConfig
from arpo_async.metric_fields import METRIC_FIELDS, WHEN
from arpo_async.tasks import Task
from arpo_async.transport import Outbox, SocketPump
from arpo_cli import reference_docs
from arpo_cli.cli import build_parser
from learner.algo.batcher import ScoredGroup
from learner.rollouts import evaluation_rounds
from learner.rollouts.scheduler import GroupScheduler
from learner.rollouts.service import LearnerService
from learner.rollouts.staleness import StalenessManager
from learner.train import loop as training_loop
from learner.train.records import CORRECTION_STATS, step_record
from tests.support import loop_counters


def test_pages_on_disk_are_what_the_code_generates():
    stale = reference_docs.stale_pages()
    assert not stale, (f"{[str(p) for p in stale]} differ from what the code generates: run "
                       f"`{reference_docs.REGENERATE}` from the repository root and commit docs/reference/")


def test_check_exits_1_until_the_pages_are_written(tmp_path, capsys):
    assert reference_docs.main(["--check", "--docs", str(tmp_path)]) == 1
    assert reference_docs.REGENERATE in capsys.readouterr().err
    assert reference_docs.main(["--docs", str(tmp_path)]) == 0
    assert reference_docs.main(["--check", "--docs", str(tmp_path)]) == 0
    (tmp_path / "reference" / "cli.md").write_text("edited by hand\n")
    assert reference_docs.main(["--check", "--docs", str(tmp_path)]) == 1
    assert "cli.md" in capsys.readouterr().err


def test_pages_do_not_depend_on_the_machine(monkeypatch):
    before = reference_docs.pages()
    monkeypatch.setenv("ARPO_API_KEY", "secret-from-the-environment")
    monkeypatch.setenv("COLUMNS", "37")
    after = reference_docs.pages()
    assert after == before
    text = "".join(after.values())
    assert "secret-from-the-environment" not in text
    assert f"{socket.gethostname()}-{os.getpid()}" not in text
    assert str(reference_docs.ROOT) not in text


def test_config_page_lists_every_field_of_every_config_class():
    page = reference_docs.config_page()
    classes = {"": RunConfig, **SECTION_TYPES}
    for section, cls in classes.items():
        anchor = "top-level-keys" if section == "" else section
        assert f"(#{anchor})" in page
        heading = "## Top-level keys" if section == "" else f"## `[{section}]`"
        assert heading in page
        for field in dataclasses.fields(cls):
            if section == "" and field.name in SECTION_TYPES:
                continue
            key = f"{section}.{field.name}" if section else field.name
            assert f'| <a id="{key}"></a>`{field.name}` |' in page, f"config page lacks {key}"
    rows = [line for line in page.splitlines() if line.startswith("| <a id=")]
    assert len(rows) == sum(len(dataclasses.fields(c)) for c in classes.values()) - len(SECTION_TYPES)
    assert "(no docstring)" not in page


def test_config_types_show_bounds_and_choices():
    page = reference_docs.config_page()
    assert '| <a id="learner.lr"></a>`lr` | float > 0, finite | `0.0005` |' in page
    assert '`schedule` | one of `"async"`, `"lockstep"` | `"async"` |' in page
    assert '`screenshot_quality` | int in [1, 100] |' in page


def subcommands(parser: argparse.ArgumentParser):
    """Every parser below ``parser`` (argparse keeps them in its subparsers action's ``choices``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield child
                yield from subcommands(child)


def test_cli_page_names_every_command_and_flag():
    page = reference_docs.cli_page()
    commands = list(subcommands(build_parser()))
    assert {"arpo run", "arpo config show", "arpo tasks check", "arpo eval"} <= {p.prog for p in commands}
    for parser in commands:
        assert f"## `{parser.prog}`" in page
        assert f"usage: {parser.prog} [-h]" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in page, f"cli page lacks {parser.prog} {flag}"
    for script in ("arpo-learner", "arpo-actors", "arpo-serve"):
        assert f"### `{script}`" in page


# --------------------------------------------------------------------------------------------------- metric fields


TASK = Task.from_dict({"id": "grid4-red", "instruction": "click red", "config": [],
                       "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                     "expected": {"type": "rule", "rules": {"expected": "x"}}}})


async def real_record() -> dict:
    """A record of the real step_record from a real LearnerService whose message counts come from a real
    ZeroMQ SocketPump (as learner.main wires them), with every trainer statistic step_record copies."""
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.ROUTER)
    try:
        outbox = Outbox(routed=True)
        pump = SocketPump(sock, inbox=asyncio.Queue(), outbox=outbox, max_bytes=1 << 20)
        order = itertools.cycle([TASK])
        service = LearnerService(outbox, GroupScheduler([TASK], group_size=2, pick_task=lambda: next(order)),
                                 StalenessManager(2, 0), message_counts=pump.message_counts)
        batch = [ScoredGroup("grid4-red", [], [1.0, 0.0], [1.0, -1.0], False, 0.5, [0, 1])]
        stats = {"loss": 0.1, "grad_norm": 1.0, "clip_frac": 0.0, "tokens": 8.0, "seconds": 0.2,
                 "dropped_samples": 0.0, **{k: 0.0 for k in CORRECTION_STATS}}
        counters = loop_counters(service)
        return step_record(1, 1, batch, stats, service.stats.window.take(), counters, 0.1, 2.0)
    finally:
        sock.close(0)
        context.term()


def caller_keys() -> set[str]:
    """The keys TrainingLoop (learner/train/loop.py) adds to step_record's: the keyword arguments of its
    step_record call and every ``record["key"] = ...`` (or ``record["a"], x = ...``) in the module."""
    tree = ast.parse(inspect.getsource(training_loop))
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "step_record":
            keys |= {k.arg for k in node.keywords if k.arg}
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            keys |= {t.slice.value for t in targets
                     if isinstance(t, ast.Subscript) and getattr(t.value, "id", None) == "record"
                     and isinstance(t.slice, ast.Constant)}
    return keys


def evaluation_keys() -> set[str]:
    """The keys of the dict EvaluationRounds.result_of returns (read from its source)."""
    source = textwrap.dedent(inspect.getsource(evaluation_rounds.EvaluationRounds.result_of))
    returned = [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Return)]
    return {k.value for d in returned if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}


async def test_a_real_record_carries_exactly_the_documented_every_record_fields():
    record = await real_record()
    documented = {k for k, f in METRIC_FIELDS.items() if f.when in ("every", "pump")}
    assert set(record) == documented
    assert set(record["correction"]) == set(CORRECTION_STATS)


def test_the_callers_keys_are_documented():
    """What TrainingLoop.train and the evaluation rounds add: read from their source (no training loop runs)."""
    added = caller_keys()
    assert {"schedule", "updates", "checkpoint_s", "resumed_from"} <= added  # the reading finds them
    evaluation = evaluation_keys()
    assert evaluation == set(evaluation_rounds.RESULT_KEYS)
    documented = {k for k, f in METRIC_FIELDS.items() if f.when not in ("every", "pump")}
    assert documented == added | evaluation
    assert {k for k in METRIC_FIELDS if METRIC_FIELDS[k].when == "eval"} == evaluation


def test_every_metric_field_has_a_known_when_and_the_page_lists_it():
    page = reference_docs.metrics_page()
    for key, field in METRIC_FIELDS.items():
        assert field.when in WHEN
        assert f'| <a id="{key}"></a>`{key}` |' in page


@pytest.mark.parametrize("key", ["step", "loss", "eval_success", "messages"])
def test_metrics_page_row_has_the_description(key):
    assert reference_docs._md(METRIC_FIELDS[key].description) in reference_docs.metrics_page()
