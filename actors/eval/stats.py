"""Statistics of an evaluation: a 95% interval for a success rate, and pass@k over repeated episodes.

Sources:

- Wilson score interval: E. B. Wilson, "Probable inference, the law of succession, and statistical inference",
  JASA 22 (1927); recommended over the normal (Wald) interval for small n and rates near 0 or 1 by Brown, Cai and
  DasGupta, "Interval Estimation for a Binomial Proportion", Statistical Science 16(2), 2001.
- pass@k: the unbiased estimator of Chen et al., "Evaluating Large Language Models Trained on Code" (2021),
  eq. 1: with n samples of a task of which c succeed, ``pass@k = 1 - C(n-c, k) / C(n, k)``; a task set's pass@k
  is the mean over its tasks.
"""
from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""The standard normal quantile of 0.975 (a two-sided 95% interval)."""


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a success rate: ``(low, high)``, both in [0, 1]; ``(0.0, 1.0)`` when n is 0.

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
