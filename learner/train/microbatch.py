"""How one optimizer step's samples are laid out: shares per rank, then micro-batches under a token budget.

Pure functions of the samples' token counts, so every rank computes the same plan from the same samples without
talking to the others (the learner hands every rank the whole batch, see learner.train.distributed). A micro-batch is
forwarded as one right-padded batch, so its cost is ``len(micro_batch) * longest sequence`` tokens (the padded
size), and that is what the budget bounds.

Sources: longest-processing-time-first assignment (Graham 1969) for the ranks' shares, as verl's
``get_seqlen_balanced_partitions`` balances sequence lengths over data-parallel ranks; longest-first packing
under a token budget as verl's ``rearrange_micro_batches`` (``use_dynamic_bsz``, ``max_token_len``) does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["MicroBatchBudgetError", "microbatches", "rank_shares", "step_plan"]


class MicroBatchBudgetError(ValueError):
    """One sample is longer than ``learner.max_tokens_per_microbatch``: no micro-batch can hold it."""


def rank_shares(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Split sample indices over ``ranks`` so that each rank's token count is about equal.

    Longest first, each sample goes to the rank with the fewest tokens so far (ties: the lowest rank). Each
    share lists its indices in ascending order. A rank gets no sample when there are fewer samples than ranks.

    Args:
        lengths: tokens per sample (prompt + completion), each >= 1.
        ranks: number of data-parallel ranks, >= 1.
    Returns:
        ``ranks`` lists of indices into ``lengths``; together they hold every index once.
    Raises:
        ValueError: ``ranks`` < 1.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    heap = [(0, r) for r in range(ranks)]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, r = heapq.heappop(heap)
        shares[r].append(i)
        heapq.heappush(heap, (tokens + lengths[i], r))
    return [sorted(s) for s in shares]


def microbatches(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Pack ``indices`` longest first into micro-batches whose padded size stays within ``budget`` tokens.

    A micro-batch takes samples in order of decreasing length while ``count * longest <= budget``, where
    ``longest`` is its first sample's length (every row is padded to it). ``budget`` 0 = one micro-batch.

    Args:
        indices: the samples to pack (indices into ``lengths``).
        lengths: tokens per sample (prompt + completion).
        budget: most padded tokens per micro-batch, or 0 for no limit.
    Returns:
        Lists of indices, longest micro-batch first; none is empty; an empty ``indices`` gives ``[]``.
    Raises:
        MicroBatchBudgetError: a sample alone is longer than ``budget`` (names the key and both numbers).
    """
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    if not budget:
        return [order] if order else []
    out: list[list[int]] = []
    for i in order:
        if lengths[i] > budget:
            raise MicroBatchBudgetError(
                f"a sample of {lengths[i]} tokens does not fit learner.max_tokens_per_microbatch = {budget}; "
                f"raise it to at least {lengths[i]} (prompt + completion of the longest sample)")
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def step_plan(lengths: Sequence[int], ranks: int, budget: int) -> tuple[list[list[list[int]]], int]:
    """Every rank's micro-batches for one step, and how many forward/backward passes each rank runs.

    Ranks run the same number of passes (FSDP's collectives pair up pass by pass); a rank with fewer
    micro-batches repeats one with weight 0 (see learner.train.trainer), so the count is the largest over ranks.

    Returns:
        ``(plans, passes)``: ``plans[r]`` is rank r's list of micro-batches (lists of indices), ``passes`` =
        max over ranks of ``len(plans[r])`` (at least 1 when there is a sample).
    Raises:
        MicroBatchBudgetError: as :func:`microbatches`.
    """
    plans = [microbatches(share, lengths, budget) for share in rank_shares(lengths, ranks)]
    return plans, max((len(p) for p in plans), default=0)
