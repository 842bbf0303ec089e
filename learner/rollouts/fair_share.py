"""Fair shares of the admitted rollouts: max-min fairness over the peers' announced slots.

Role: a pure function the admission's dispatcher (learner.rollouts.peers) asks how many running rollouts each peer
may hold, so that one peer, or a storm of them, cannot hold every rollout the admission rule allows while another
waits. The share is the classic water-filling allocation (max-min fairness; Bertsekas and Gallager, "Data
Networks", 2nd ed., section 6.5.2): every peer gets min(its slots, level), with the level chosen so that the shares
add up to the capacity (or every peer gets all its slots, when they fit). A peer that asks for little keeps all of
it; the rest is split evenly among the others.
"""

from __future__ import annotations


def fair_shares(slots: dict[str, int], capacity: int) -> dict[str, int]:
    """Water-filling shares of ``capacity`` rollouts.

    Args:
        slots: peer -> the most rollouts it asks for (its Hello's slots, capped), each >= 0.
        capacity: the rollouts to share (>= 0): those running plus those the admission rule admits now.

    Returns:
        peer -> its share, an int in [0, slots[peer]]; the shares add up to min(capacity, sum of slots). The
        remainder of an uneven split goes to the peers asking for most (ties broken by name), so the result does
        not depend on the dict's order.

    Raises:
        ValueError: a negative capacity or slot count.
    """
    if capacity < 0 or any(s < 0 for s in slots.values()):
        raise ValueError(f"capacity and slots must be >= 0, got {capacity} and {min(slots.values(), default=0)}")
    order = sorted(slots, key=lambda peer: (slots[peer], peer))
    shares: dict[str, int] = {}
    left = capacity
    for i, peer in enumerate(order):
        shares[peer] = min(slots[peer], left // (len(order) - i))
        left -= shares[peer]
    return shares
