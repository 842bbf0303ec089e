"""Statistics of an evaluation: a 95% interval for a success rate, pass@k over repeated episodes, and a 95%
interval for a mean score that resamples tasks, not episodes (repeats of one task are not independent).

Sources:

- Wilson score interval: E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
  JASA 22 (1927); recommended over the normal (Wald) interval for small n and rates near 0 or 1 by Brown, Cai and
  DasGupta, "Interval Estimation for a Binomial Proportion", Statistical Science 16(2), 2001.
- pass@k: the unbiased estimator of Chen et al., "Evaluating Large Language Models Trained on Code" (2021),
  eq. 1: with n samples of a task of which c succeed, ``pass@k = 1 - C(n-c, k) / C(n, k)``; a task set's pass@k
  is the mean over its tasks.
- Cluster bootstrap and clustered standard errors for the mean score: :func:`cluster_bootstrap_interval` and
  :func:`clustered_standard_error` (Miller, arXiv:2411.00640, 2024; Efron and Tibshirani 1993).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975 (a two-sided 95% interval)."""


def wilson_interval(successes: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a success rate: ``(low, high)``, both in [0, 1]; ``(0.0, 1.0)`` when n is 0.
    ``successes`` is a count, or a sum of n scores in [0, 1] (the rate is then a mean score).

    Raises:
        ValueError: ``successes`` outside ``[0, n]``.
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n]; got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of ``k`` episodes drawn without replacement from ``n`` (of which ``c``
    succeeded) succeeds: ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, eq. 1).

    Raises:
        ValueError: ``k`` outside ``[1, n]`` or ``c`` outside ``[0, n]``.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n]; got {c} of {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


BOOTSTRAP_RESAMPLES = 10_000
"""Resamples of :func:`cluster_bootstrap_interval` (a percentile interval needs its 2.5% and 97.5% quantiles,
which want thousands of resamples; Efron and Tibshirani 1993, ch. 13 and 19)."""
BOOTSTRAP_SEED = 0
"""The fixed seed of :func:`cluster_bootstrap_interval`: the same scores always give the same interval."""


def cluster_bootstrap_interval(clusters: Sequence[Sequence[float]], *, resamples: int = BOOTSTRAP_RESAMPLES,
                               seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
    """A 95% interval for a mean score that does not treat repeats of one task as independent: the percentile
    interval of a cluster bootstrap over tasks. ``clusters`` holds, per task, the scores of its planned episodes
    (errored or unfinished ones as 0.0); each resample draws ``len(clusters)`` tasks with replacement and takes the
    mean of their per-task means; the interval is the 2.5% and 97.5% quantiles of ``resamples`` such means, drawn
    from ``numpy.random.default_rng(seed)`` (reproducible). With one task the clusters are its episodes (the
    population is then that task's repeats).

    A percentile bootstrap cannot see variation it did not observe: with one cluster, or all cluster means equal
    (every task scored 0, say), its interval has zero width. Then the interval is the Wilson interval of the mean
    with n = the number of clusters (:func:`wilson_interval` with the sum of the cluster means as "successes"):
    a mean score in [0, 1] has variance at most mean x (1 - mean), the Bernoulli's, so Wilson's binomial interval
    is a conservative one for it; ``(0.0, 1.0)`` with no cluster.

    Why clusters: the K repeats of a task are correlated (the same task is easy or hard every time), so a rate
    over episodes treated as independent draws has an interval too narrow by up to a factor sqrt(K); E. Miller,
    "Adding Error Bars to Evals: A Statistical Approach to Language Model Evaluations", arXiv:2411.00640 (2024),
    recommends clustered standard errors when questions come in clusters, and a per-question mean when answers are
    resampled; the bootstrap over clusters is the resampling form of the same idea (B. Efron and R. Tibshirani, "An
    Introduction to the Bootstrap", Chapman & Hall 1993, ch. 13: percentile intervals; A. C. Davison and D. V. Hinkley,
    "Bootstrap Methods and their Application", CUP 1997, ch. 3: hierarchical data, resampling the top level).
    With equal cluster sizes (every task planned K times) the mean of the per-task means is the mean score.

    Shapes and units: scores in [0, 1]; returns ``(low, high)`` with ``low <= high``, both in [0, 1]; a resample
    of a percentile interval never leaves the range of the per-task means.

    Raises:
        ValueError: a cluster is empty, a score is not a finite number, or ``resamples`` < 1.
    """
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1; got {resamples}")
    groups = [np.asarray(c, dtype=float) for c in clusters]
    if any(g.size == 0 for g in groups):
        raise ValueError("every cluster (task) needs at least one planned episode")
    if any(not np.all(np.isfinite(g)) for g in groups):
        raise ValueError("scores must be finite numbers")
    if len(groups) == 1:
        groups = [g[i:i + 1] for g in groups for i in range(g.size)]
    means = np.array([g.mean() for g in groups])
    if len(means) < 2 or means.min() == means.max():
        return wilson_interval(min(float(means.sum()), len(means)), len(means))
    rng = np.random.default_rng(seed)
    n, drawn, chunk = len(means), [], max(1, 2_000_000 // len(means))
    for start in range(0, resamples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        drawn.append(means[idx].mean(axis=1))
    low, high = np.quantile(np.concatenate(drawn), [0.025, 0.975])
    return max(0.0, float(low)), min(1.0, float(high))


def clustered_standard_error(clusters: Sequence[Sequence[float]]) -> float:
    """The clustered standard error of the mean of all scores in ``clusters`` (one list per task): Miller
    (arXiv:2411.00640, 2024), clustered standard errors, in the form
    ``sqrt(sum_c (sum_{i in c} (s_ic - s_mean))^2) / n`` with n scores in all (the cluster-robust sandwich for a
    mean, without a small-sample correction). Not in the report (its interval is
    :func:`cluster_bootstrap_interval`); the tests use it as the bootstrap's reference. 0.0 with fewer than 2
    clusters.

    Raises:
        ValueError: no score at all.
    """
    scores = [float(s) for c in clusters for s in c]
    if not scores:
        raise ValueError("no score")
    if len(clusters) < 2:
        return 0.0
    mean = sum(scores) / len(scores)
    return math.sqrt(sum(sum(s - mean for s in c) ** 2 for c in clusters)) / len(scores)
