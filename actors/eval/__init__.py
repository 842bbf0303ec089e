"""Scoring a policy on a task set with real desktops: ``arpo eval`` and :func:`evaluate`, one code path.

Modules, one role each:

- :mod:`actors.eval.stats`: success-rate interval (Wilson), pass@k (the unbiased estimator) and the mean score's
  interval (a cluster bootstrap over tasks);
- :mod:`actors.eval.causes`: whose fault an errored episode is (the harness's or the agent's);
- :mod:`actors.eval.results`: one episode's result on disk, laid out as OSWorld's own runner lays it out;
- :mod:`actors.eval.folder`: the results folder's manifest (arpo-eval.json): what a resume may trust and delete;
- :mod:`actors.eval.report`: report.json / report.md from the episodes' results, led by OSWorld's mean score;
- :mod:`actors.eval.runner`: :func:`evaluate`, the episodes on a pool of desktops, resumable.
"""

from actors.eval.runner import EvalSettings, evaluate

__all__ = ["EvalSettings", "evaluate"]
