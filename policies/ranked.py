"""Shared machinery of the ranked policies that preempt: name running requests
to preempt for better-ranked waiting ones (admission itself is the default
``AdmissionPolicy.admit`` over the policy's ``rank``)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

from roseinfer.interface import PolicyContext
from roseinfer.sequence import Sequence as Seq

RankKey = Callable[[Seq], Any]


def preempt_for(
    waiting: Sequence[Seq], ctx: PolicyContext, key: RankKey, outranks: Callable[[Seq, Seq], bool]
) -> list[Seq]:
    """Running requests to preempt so the best-ranked waiting ones get a seat and blocks.

    Walks the waiting requests in rank order; while one lacks a free seat or
    KV blocks (its uncached tokens, rounded up to blocks), preempts the
    worst-ranked running request it ``outranks`` (strictly: a victim never ties
    its beneficiary), crediting the victim's seat and computed blocks. Stops
    at the first waiting request that cannot be served that way. The block
    estimate ignores shared prefix blocks and decode growth: KV preemption
    (``select_victim``) covers the rest.

    Args:
        key: the policy's rank (smaller is better).
        outranks: ``outranks(a, b)`` True when ``a`` may displace ``b``.
    """
    if not ctx.running:
        return []
    seats, free = ctx.free_seats, ctx.num_free_blocks
    if seats >= len(waiting) and _blocks_needed(waiting, ctx) <= free:
        return []  # a seat and blocks for every waiting request: no victim in any rank order
    pool: list[Seq] | None = None  # the running set, worst first: sorted when first needed
    victims: list[Seq] = []
    for cand in heapq.nsmallest(max(ctx.max_num_seqs, 1), waiting, key=key):
        need = -(-ctx.cost(cand) // ctx.block_size)
        while seats < 1 or free < need:
            if pool is None:
                pool = sorted(ctx.running, key=key, reverse=True)
            if not pool or not outranks(cand, pool[0]):
                return victims
            victim = pool.pop(0)
            victims.append(victim)
            seats += 1
            free += -(-victim.num_computed_tokens // ctx.block_size)
        seats -= 1
        free -= need
    return victims


def _blocks_needed(waiting: Sequence[Seq], ctx: PolicyContext) -> int:
    """KV blocks of the uncached tokens of every waiting request."""
    cost, block_size, need = ctx.cost, ctx.block_size, 0
    for seq in waiting:
        need += -(-cost(seq) // block_size)
    return need
