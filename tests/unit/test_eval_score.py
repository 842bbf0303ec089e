"""OSWorld's number in `arpo eval`'s report and the learner's held-out rounds (issue 50 items 1 and 6): the mean
score over the planned episodes (errored and unfinished ones 0, partial credit kept), the mean over the episodes
that ran (OSWorld's show_result.py), errors by cause, the mean of K runs, and a 95% interval that resamples tasks,
not episodes, against hand-computed values and a plain-loop reference."""
from __future__ import annotations

import math

import numpy as np
import pytest

from actors.eval.causes import error_cause
from actors.eval.report import build_report, headline, render_markdown
from actors.eval.results import EpisodeRecord
from actors.eval.stats import cluster_bootstrap_interval, clustered_standard_error, wilson_interval
from arpo_async.config import EvalConfig
from arpo_async.messages import Outcome, Trajectory
from arpo_async.tasks import Task
from arpo_cli.curve import held_out
from learner.rollouts.evaluation_rounds import RESULT_KEYS, EvaluationRounds

THRESHOLD = 0.1


def rec(domain: str, task: str, repeat: int, score: float, outcome: str = "", error: str = "") -> EpisodeRecord:
    """A record as actors.eval.runner.record_of writes it: SUCCESS iff the score is above THRESHOLD."""
    outcome = outcome or ("SUCCESS" if score > THRESHOLD else "FAILURE")
    return EpisodeRecord(domain=domain, task_id=task, repeat=repeat, score=score, success=outcome == "SUCCESS",
                         outcome=outcome, error=error or (f"{outcome}: boom" if outcome in (
                             "ENV_ERROR", "TASK_ERROR", "ABORTED") else ""), steps=1)


def report_of(records, repeats=1, tasks=None, planned=None):
    tasks = tasks if tasks is not None else sorted({(r.domain, r.task_id) for r in records})
    planned = planned if planned is not None else repeats * len(tasks)
    return build_report(records, repeats=repeats, planned=planned, meta={"policy": {"kind": "model", "name": "m"}},
                        tasks=tasks, threshold=THRESHOLD)


def test_partial_credit_gives_osworlds_mean_not_the_success_rate():
    # the example: scores 0.5, 0.2, 0, 0 are 0.175 in OSWorld (0.50 as a success rate at 0.1)
    report = report_of([rec("chrome", "a", 0, 0.5), rec("chrome", "b", 0, 0.2), rec("os", "c", 0, 0.0),
                        rec("os", "d", 0, 0.0)])
    overall = report["overall"]
    assert overall["score_mean"] == pytest.approx(0.175)
    assert (overall["score_sum"], overall["score_total"]) == (pytest.approx(0.7), 4)
    assert overall["success_rate"] == 0.5 and overall["ci95"] == pytest.approx(list(wilson_interval(2, 4)))
    assert overall["ran_mean"] == pytest.approx(0.175) and overall["ran_episodes"] == 4
    assert report["threshold"] == THRESHOLD
    assert report["domains"]["chrome"]["score_mean"] == pytest.approx(0.35)
    assert report["tasks_detail"]["chrome/b"]["score_sum"] == pytest.approx(0.2)
    lines = headline(report)
    assert lines[0].startswith("score 0.7/4 (17.5%), 95% interval ")
    assert "mean over episodes that ran (OSWorld show_result.py): 17.5% of 4" in lines[1]
    assert lines[2].startswith("success rate at threshold 0.1: 50.0% (2 of 4")
    assert "the harness could not run it: 0 / the agent's episode failed: 0" in lines[3]
    assert any(line.startswith("chrome: score 0.7/2 (35.0%)") for line in lines)
    assert render_markdown(report).startswith("# Evaluation report\n\n- score 0.7/4 (17.5%)")


def test_errors_score_zero_in_the_denominator_are_left_out_of_the_ran_mean_and_split_by_cause():
    records = [rec("d", "ok", 0, 0.6), rec("d", "parse", 0, 0.0, "POLICY_ERROR"),
               rec("d", "setup", 0, 0.0, "ENV_ERROR"), rec("d", "load", 0, 0.0, "TASK_ERROR"),
               rec("d", "server", 0, 0.0, "ABORTED"),
               # a hand-edited record: errored but a score of 0.9; it still scores 0 (errors never add credit)
               EpisodeRecord(domain="d", task_id="edited", repeat=0, score=0.9, success=False, outcome="ENV_ERROR",
                             error="ENV_ERROR: edited"),
               # an outcome nobody knows, with an error: listed, counted as the harness's, scored 0
               EpisodeRecord(domain="d", task_id="odd", repeat=0, score=0.0, success=False, outcome="WEIRD",
                             error="WEIRD: ?")]
    report = report_of(records)
    overall = report["overall"]
    assert (overall["score_sum"], overall["score_total"]) == (pytest.approx(0.6), 7)
    assert overall["score_mean"] == pytest.approx(0.6 / 7)
    # ran: "ok" and "parse" (a reply that did not parse is a scored failure, not an error)
    assert overall["ran_episodes"] == 2 and overall["ran_mean"] == pytest.approx(0.3)
    assert (overall["errors"], overall["harness_errors"], overall["agent_errors"], overall["policy_errors"]) == (
        5, 4, 1, 1)
    assert {e["task_id"]: e["cause"] for e in report["errors"]} == {
        "setup": "harness", "load": "harness", "edited": "harness", "odd": "harness", "server": "agent"}
    assert "the harness could not run it: 4 / the agent's episode failed: 1" in headline(report)[3]
    assert "replies that did not parse (scored, not errors): 1" in headline(report)[3]


def test_error_causes_cover_every_outcome():
    assert {o: error_cause(o) for o in Outcome} == {
        Outcome.SUCCESS: None, Outcome.FAILURE: None, Outcome.TRUNCATED: None, Outcome.POLICY_ERROR: None,
        Outcome.ENV_ERROR: "harness", Outcome.TASK_ERROR: "harness", Outcome.ABORTED: "agent"}
    assert error_cause("env_error") == "harness"  # any case
    with pytest.raises(ValueError):
        error_cause("no such outcome")


def test_an_incomplete_run_scores_its_unfinished_episodes_zero_over_the_plan():
    plan = [("a", "t1"), ("a", "t2"), ("b", "t3")]
    records = [rec("a", "t1", 0, 1.0), rec("a", "t1", 1, 0.5)]  # 2 of 6 planned episodes finished
    report = report_of(records, repeats=2, tasks=plan)
    assert not report["complete"] and report["finished"] == 2
    overall = report["overall"]
    assert (overall["score_sum"], overall["score_total"], overall["score_mean"]) == (1.5, 6, 0.25)
    assert overall["ran_mean"] == 0.75 and overall["episodes"] == 2
    assert overall["mean_of_k"] == {"runs": [pytest.approx(1 / 3), pytest.approx(1 / 6)], "mean": 0.25}
    assert report["domains"]["b"]["score_total"] == 2 and report["domains"]["b"]["score_mean"] == 0.0
    assert report["domains"]["a"]["score_mean"] == pytest.approx(1.5 / 4)
    assert report["tasks_detail"]["b/t3"]["episodes"] == 0 and report["tasks_detail"]["b/t3"]["score_sum"] == 0.0
    assert "INCOMPLETE: unfinished episodes score 0" in render_markdown(report)
    # without the plan's task list (the older call): the overall total is still the planned count
    unnamed = build_report(records, repeats=2, planned=6, meta={})
    assert (unnamed["overall"]["score_total"], unnamed["overall"]["score_mean"]) == (6, 0.25)


def test_mean_of_k_runs_and_pass_at_k_with_repeats():
    scores = {"t1": [1.0, 0.0, 0.5], "t2": [0.0, 0.0, 0.0], "t3": [1.0, 1.0, 0.2]}
    records = [rec("d", t, j, s) for t, row in scores.items() for j, s in enumerate(row)]
    overall = report_of(records, repeats=3)["overall"]
    runs = [sum(row[j] for row in scores.values()) / 3 for j in range(3)]
    assert overall["mean_of_k"]["runs"] == pytest.approx(runs)
    assert overall["mean_of_k"]["mean"] == pytest.approx(overall["score_mean"]) == pytest.approx(3.7 / 9)
    # pass@1 over the thresholded successes: (2/3 + 0 + 3/3) / 3; pass@3: (1 + 0 + 1) / 3
    assert overall["pass_at_k"] == {"1": pytest.approx(5 / 9), "3": pytest.approx(2 / 3)}
    assert "mean of 3 runs (as OpenCUA reports): 66.7%, 33.3%, 23.3%; mean 41.1%" in "\n".join(
        headline(report_of(records, repeats=3)))


def test_the_clustered_interval_is_wider_than_the_naive_one_when_repeats_agree():
    # 10 tasks x 5 repeats; a task is solved every time or never: 10 independent draws, not 50
    clusters = [[1.0] * 5 if i % 2 else [0.0] * 5 for i in range(10)]
    records = [rec("d", f"t{i}", j, s) for i, row in enumerate(clusters) for j, s in enumerate(row)]
    low, high = report_of(records, repeats=5)["overall"]["score_ci95"]
    naive_low, naive_high = cluster_bootstrap_interval([[s] for row in clusters for s in row])
    assert low < 0.5 < high and high - low > 1.8 * (naive_high - naive_low)
    # the bootstrap agrees with the clustered standard error (Miller 2024) within resampling noise; the naive
    # standard error is sqrt(5) times smaller
    se = clustered_standard_error(clusters)
    assert se == pytest.approx(math.sqrt(0.25 / 10)) and (high - low) / 2 == pytest.approx(1.96 * se, rel=0.15)
    assert clustered_standard_error([[s] for row in clusters for s in row]) == pytest.approx(se / math.sqrt(5))


def test_the_bootstrap_matches_a_plain_loop_and_is_reproducible():
    clusters = [[0.5, 0.5], [0.2, 0.0], [0.0, 0.0], [1.0, 0.8]]
    means = [sum(c) / len(c) for c in clusters]
    rng = np.random.default_rng(0)
    draws = []  # the reference: a loop over resamples, same generator and order
    for _ in range(10_000):
        picks = rng.integers(0, len(means), size=len(means))
        draws.append(sum(means[i] for i in picks) / len(means))
    expected = tuple(np.quantile(draws, [0.025, 0.975]))
    assert cluster_bootstrap_interval(clusters) == pytest.approx(expected)
    assert cluster_bootstrap_interval(clusters) == cluster_bootstrap_interval(clusters)  # fixed seed
    assert cluster_bootstrap_interval(clusters, seed=1) != cluster_bootstrap_interval(clusters)


def test_the_interval_never_has_zero_width_from_no_variation_and_rejects_bad_scores():
    # every task 0: the bootstrap sees no variation; the interval is Wilson's over the tasks, not [0, 0]
    assert cluster_bootstrap_interval([[0.0], [0.0]]) == pytest.approx(wilson_interval(0, 2))
    assert cluster_bootstrap_interval([[0.5]]) == pytest.approx(wilson_interval(0.5, 1))  # one episode
    assert cluster_bootstrap_interval([[1.0, 1.0, 1.0]]) == pytest.approx(wilson_interval(3, 3))  # one task, agreed
    low, high = cluster_bootstrap_interval([[1.0, 0.0, 1.0, 0.0]])  # one task: its repeats are the clusters
    assert 0.0 <= low < 0.5 < high <= 1.0
    for bad in ([[0.5], []], [[math.nan], [0.0]], [[math.inf], [0.0]]):
        with pytest.raises(ValueError):
            cluster_bootstrap_interval(bad)
    with pytest.raises(ValueError):
        cluster_bootstrap_interval([[0.0], [1.0]], resamples=0)


def held_task(task_id: str) -> Task:
    return Task.from_dict({"id": task_id, "instruction": "x", "config": [],
                           "evaluator": {"func": "exact_match", "result": {"type": "vm_file", "path": "/r"},
                                         "expected": {"type": "rule", "rules": {"expected": "x"}}}})


def test_a_held_out_round_reports_the_same_mean_score_and_the_curve_plots_it():
    a, b = held_task("held-a"), held_task("held-b")
    rounds = EvaluationRounds([a, b], EvalConfig(tasks="x", repeats=2))
    assert rounds.start(0, 0)
    scores = {(a.id, 0): ("SUCCESS", 0.5), (a.id, 1): ("FAILURE", 0.0), (b.id, 0): ("FAILURE", 0.0),
              (b.id, 1): ("ENV_ERROR", 0.9)}  # an errored episode's score never counts
    result = None
    for _ in range(4):
        rollout = rounds.next_rollout()
        outcome, score = scores[(rollout.task.id, rollout.rollout_index)]
        result = rounds.record(Trajectory(f"t{rollout.rollout_index}", "a", rollout.task.id, rollout.group_id,
                                          rollout.rollout_index, outcome, score, True, [], []))
    assert set(result) == set(RESULT_KEYS)
    assert result["eval_score"] == pytest.approx(0.125) and result["eval_success"] == 0.25  # 0.5 / 4, 1 of 4
    assert result["eval_task_score"] == {a.id: 0.25, b.id: 0.0}
    assert result["eval_score_ran"] == pytest.approx(0.5 / 3) and result["eval_errors"] == 1
    # the curve's held-out points are the mean score; a record from before eval_score keeps its success rate
    records = [{"step": 4, "wall_s": 60.0, **result}, {"step": 8, "wall_s": 120.0, "eval_success": 0.75}]
    assert held_out(records).value == [0.125, 0.75]
