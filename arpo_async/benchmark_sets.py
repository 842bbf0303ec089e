"""Task sets and step budgets as researchers name them: OSWorld's 369 tasks, its 361 without the Google Drive
tasks, ARPO's 128 training tasks (named splits of a folder of OSWorld's task files), and the step budgets 15, 50
and 100 that OpenCUA and the OSWorld-Verified leaderboard report.

A named split is a file in ``arpo_async/splits/benchmarks/<name>.json`` in OSWorld's ``test_all.json`` form
(``{domain: [task id, ...]}``); :func:`arpo_async.task_sets.resolve_split_path` finds it by name, so it serves
wherever a split is accepted (``arpo eval --split``, ``eval.split``). It names OSWorld's task ids only: the task
files themselves come from OSWorld's repository (``evaluation_examples/examples``, given as ``--tasks``).

Sources, each checked here (the tests count every file and compare it with OSWorld's when
``$OSWORLD_EXAMPLES`` is set):

- ``osworld-369``: ``evaluation_examples/test_all.json`` of https://github.com/xlang-ai/OSWorld (Apache-2.0),
  as copied for this project's tests; unchanged, in its order.
- ``osworld-361``: OSWorld's ``evaluation_examples/test_nogdrive.json`` (the set the OSWorld-Verified
  leaderboard scores, e.g. "209.55/361"): ``test_all.json`` less the 8 multi_apps tasks whose setup or evaluator
  uses Google Drive (a ``googledrive`` config step: they need an account). Built from ``test_all.json`` by that
  rule; OSWorld's own file could not be fetched here to compare byte for byte.
- ``arpo-128``: the 128 tasks ARPO trains and evaluates on, ``evaluation_examples/
  test_success_uitars1.5_wo_impossible.json`` of ARPO's OSWorld fork (https://github.com/FanbinLu/OSWorld, the
  ``OSWorld`` submodule of https://github.com/dvlab-research/ARPO at commit 7a6409d, named as
  ``data.train_files`` and ``data.val_files`` in ARPO's ``examples/osworld_full_arpo.sh`` at commit 7489ae3;
  both Apache-2.0). Ids and order match the copy in github.com/super-jw/AgentHijack at 13ae55d.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BENCHMARK_SPLITS_DIR = Path(__file__).resolve().parent / "splits" / "benchmarks"
"""The named splits' files, ``<name>.json``."""


@dataclass(frozen=True)
class NamedSplit:
    """A task set as researchers name it.

    Attributes:
        name: how ``--split`` names it (the file's stem).
        tasks: how many task ids it lists (each once).
        title: what it is, in a few words.
        source: where its list is published (URL and file).
        licence: the licence of that source.
    """

    name: str
    tasks: int
    title: str
    source: str
    licence: str

    @property
    def path(self) -> Path:
        """Its file, ``arpo_async/splits/benchmarks/<name>.json``."""
        return BENCHMARK_SPLITS_DIR / f"{self.name}.json"


NAMED_SPLITS: dict[str, NamedSplit] = {s.name: s for s in (
    NamedSplit("osworld-369", 369, "OSWorld's whole Ubuntu task set",
               "https://github.com/xlang-ai/OSWorld evaluation_examples/test_all.json", "Apache-2.0"),
    NamedSplit("osworld-361", 361, "OSWorld's tasks without the 8 Google Drive tasks (OSWorld-Verified's set)",
               "https://github.com/xlang-ai/OSWorld evaluation_examples/test_nogdrive.json", "Apache-2.0"),
    NamedSplit("arpo-128", 128, "ARPO's 128 training tasks",
               "https://github.com/dvlab-research/ARPO (its OSWorld submodule, FanbinLu/OSWorld) "
               "evaluation_examples/test_success_uitars1.5_wo_impossible.json", "Apache-2.0"),
)}
"""The named splits, by name (module docstring: where each list comes from)."""

STEP_BUDGETS: dict[int, str] = {15: "OSWorld 15-step", 50: "OSWorld 50-step", 100: "OSWorld 100-step"}
"""The step budgets (``--max-steps``) results are reported at: the OSWorld-Verified leaderboard
(https://os-world.github.io, its max-steps column) and OpenCUA (arXiv:2508.09123, its OSWorld-Verified table)
report success at 15, 50 and 100 steps; a score is comparable only to one at the same budget."""


def step_budget(max_steps: int) -> dict:
    """The step budget of an evaluation as report.json records it: ``{"max_steps": max_steps, "preset": label}``,
    the label of :data:`STEP_BUDGETS` ("OSWorld 15-step") or None when ``max_steps`` is none of them."""
    return {"max_steps": max_steps, "preset": STEP_BUDGETS.get(max_steps)}
