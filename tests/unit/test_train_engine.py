"""The training-engine seam (learner.train.train_engine, issue 52 item 4): the one-rank Trainer and rank 0's
LeadTrainer each declare every TrainEngine member themselves with the protocol's own signature and types, and the
lead forwards nothing by name. tests/integration/test_ranks.py calls each member through both on real ranks."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

import learner.train.lead_trainer as lead_module
from learner.train.lead_trainer import LeadTrainer
from learner.train.train_engine import TrainEngine
from learner.train.trainer import Trainer

METHODS = sorted(name for name, member in vars(TrainEngine).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
PROPERTIES = sorted(name for name, member in vars(TrainEngine).items() if isinstance(member, property))
ATTRIBUTES = {"steps", "model_dir"}
"""Members the Trainer holds as plain attributes (set in TrainState.__init__), the protocol as read-only properties."""


def mismatches(engine: type) -> list[str]:
    """Every way ``engine`` differs from TrainEngine: a method missing or with another signature (parameter names,
    kinds, defaults, resolved types), a property missing or of another type; [] when it implements the seam."""
    found = []
    for name in METHODS:
        want = inspect.signature(getattr(TrainEngine, name))
        member = inspect.getattr_static(engine, name, None)
        if not inspect.isfunction(member):
            found.append(f"{name}: not a method of {engine.__name__}")
            continue
        got = inspect.signature(member)
        if [(p.name, p.kind, p.default) for p in got.parameters.values()] != \
                [(p.name, p.kind, p.default) for p in want.parameters.values()]:
            found.append(f"{name}: parameters {got} instead of {want}")
        elif typing.get_type_hints(member) != typing.get_type_hints(getattr(TrainEngine, name)):
            found.append(f"{name}: types {typing.get_type_hints(member)}")
    for name in PROPERTIES:
        member = inspect.getattr_static(engine, name, None)
        if isinstance(member, property):
            want = typing.get_type_hints(vars(TrainEngine)[name].fget)["return"]
            if typing.get_type_hints(member.fget)["return"] != want:
                found.append(f"{name}: a property of another type")
        elif not (engine is Trainer and name in ATTRIBUTES):
            found.append(f"{name}: not a property of {engine.__name__}")
    return found


def test_the_protocol_has_the_calls_the_learner_makes():
    assert METHODS == ["checkpoint_state_dict", "compute_logprobs", "full_state_dict", "load_checkpoint",
                       "save_checkpoint", "save_weights", "train_batch", "train_step"]
    assert PROPERTIES == ["checkpoint_name", "model_dir", "steps", "vocab_size"]


@pytest.mark.parametrize("engine", [Trainer, LeadTrainer], ids=lambda c: c.__name__)
def test_both_trainers_implement_every_member_with_its_signature(engine):
    assert mismatches(engine) == []


def test_the_signature_check_can_fail():
    class Partial:
        def train_batch(self, samples, minibatches=1):  # keyword-only in the protocol
            return {}

        def train_step(self, samples: list[int], *, proximal_logprobs=None) -> dict[str, float]:
            return {}

        steps = 0

    found = mismatches(Partial)
    assert any(f.startswith("train_batch: parameters") for f in found)
    assert any(f.startswith("train_step: parameters") or f.startswith("train_step: types") for f in found)
    assert "save_weights: not a method of Partial" in found
    assert "steps: not a property of Partial" in found and "vocab_size: not a property of Partial" in found


def test_the_lead_forwards_nothing_by_name():
    # before issue 52 item 4 the lead had __getattr__ and a tuple of method names; getattr(x, name) on either side
    # would make a call that no type checker sees
    assert "__getattr__" not in vars(LeadTrainer)
    tree = ast.parse(Path(lead_module.__file__).read_text())
    calls = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"]
    assert calls == []


def test_each_lead_call_sends_the_command_that_runs_the_same_trainer_method():
    # every command's run() calls the Trainer method whose name it carries, and each TrainEngine method of the
    # lead builds the command of its own name
    commands = {cls.name: cls for cls in typing.get_args(lead_module.Command)}
    assert set(METHODS) <= set(commands)
    for name in METHODS:
        run = ast.parse(inspect.getsource(commands[name].run).strip())
        called = {node.func.attr for node in ast.walk(run)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
        assert called == {name}, (name, called)
        body = ast.parse(inspect.getsource(getattr(LeadTrainer, name)).strip())
        built = {node.func.id for node in ast.walk(body) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Name) and node.func.id in {c.__name__ for c in commands.values()}}
        assert built == {commands[name].__name__}, (name, built)
