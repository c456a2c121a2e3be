"""The admission rule every ordered policy shares: take requests in order under the budget.

A policy orders the waiting queue (arrival order, or its :meth:`rank
<roseinfer.interface.AdmissionPolicy.rank>`); this rule turns the order into an
admission: the first requests while their summed cost fits the round's token
budget, at most the free seats, stopping at the first misfit (so the order is
never broken). An oversize head goes alone so nothing deadlocks, or, with
``chunk_head``, gets a chunk that fills the budget (chunked prefill). Seed 031
(token budget) and 033 (force-FIFO) define the rule; sjf, srpt, hrrn,
priority, edf and lpm apply it to their rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # NOTE: types only: interface.py imports this module
    from roseinfer.interface import Budget, Choice, PolicyContext
    from roseinfer.sequence import Sequence as Seq


def take_under_budget(
    ordered: Iterable[Seq], budget: Budget, ctx: PolicyContext, *, chunk_head: bool = False
) -> list[Choice]:
    """Requests from ``ordered`` (at most ``budget.max_seqs`` of them, already
    ordered) while their summed cost fits ``budget.max_tokens``; the first misfit
    ends the selection, and goes alone (or as a chunk filling the budget, with
    ``chunk_head``) when nothing was selected before it. Without a token limit no
    cost is asked for."""
    if budget.max_tokens is None:
        return list(islice(ordered, budget.max_seqs))
    selected: list[Choice] = []
    num_tokens = 0
    for seq in islice(ordered, budget.max_seqs):
        cost = ctx.cost(seq)
        if num_tokens + cost > budget.max_tokens:
            if not selected:
                selected.append(head_choice(seq, cost, budget, chunk_head))
            break
        selected.append(seq)
        num_tokens += cost
    return selected


def head_choice(seq: Seq, cost: int, budget: Budget, chunk_head: bool) -> Choice:
    """An oversize head: alone with its whole prompt, or a chunk filling the budget."""
    room = budget.max_chunk_tokens
    if chunk_head and room is not None and 0 < room < cost:
        return (seq, room)
    return seq


def fifo_under_budget(
    waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext, *, chunk_head: bool = False
) -> list[Choice]:
    """Arrival order under the token budget (seed 031): :func:`take_under_budget`
    of the queue as it stands."""
    return take_under_budget(waiting, budget, ctx, chunk_head=chunk_head)


def admit_ranked(
    waiting: Sequence[Seq],
    budget: Budget,
    ctx: PolicyContext,
    key: Callable[[Seq], Any],
    *,
    chunk_head: bool = False,
) -> list[Choice]:
    """The best-ranked waiting requests (smallest ``key``) under the budget: every
    admission outranks every request left waiting (a strict order)."""
    ranked = heapq.nsmallest(budget.max_seqs, waiting, key=key)
    return take_under_budget(ranked, budget, ctx, chunk_head=chunk_head)
