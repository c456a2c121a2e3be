"""Built-in admission policies: ``fifo``, ``budget``, ``pack``.

Semantics follow the seed posts (``../shared/seeds``): 027 (pending-queue
admission), 031 (prefill token budget), 033 (lookahead packing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from roseinfer import hookimpl
from roseinfer.interface import AdmissionPolicy, Budget, Choice, PolicyContext
from roseinfer.sequence import Sequence as Seq


def fifo_under_budget(
    waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext, *, chunk_head: bool = False
) -> list[Choice]:
    """Arrival order under the token budget (seed 031).

    Takes requests from the head while their summed cost fits
    ``budget.max_tokens``; stops at the first misfit, which stays at the head
    for the next round (order is never broken). An oversize head goes alone so
    nothing deadlocks, or, with ``chunk_head``, is admitted with a chunk that
    fills the budget (chunked prefill). No token limit: the first
    ``budget.max_seqs`` requests.
    """
    return take_under_budget(islice(waiting, budget.max_seqs), budget, ctx, chunk_head=chunk_head)


def take_under_budget(
    ordered: Iterable[Seq], budget: Budget, ctx: PolicyContext, *, chunk_head: bool = False
) -> list[Choice]:
    """Requests from ``ordered`` (at most ``budget.max_seqs`` of them, already
    ranked) while their summed cost fits ``budget.max_tokens``; the first misfit
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


class Fifo(AdmissionPolicy):
    """Arrival order, limited only by seats and KV blocks (seed 027)."""

    name = "fifo"
    description = "arrival order; ignores the token budget (seed 027)"
    preserves_arrival_order = True
    admits_queue_prefix = True


class TokenBudget(AdmissionPolicy):
    """FIFO under a per-round prefill token budget (seed 031)."""

    name = "budget"
    description = "arrival order under --prefill-max-tokens; oversize head alone (seed 031)"
    uses_token_budget = True
    uses_chunk_head = True
    preserves_arrival_order = True
    admits_queue_prefix = True

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """See :func:`fifo_under_budget`."""
        return fifo_under_budget(waiting, budget, ctx, chunk_head=self.options.chunk_head)


class Pack(AdmissionPolicy):
    """Lookahead packing under the token budget (seed 033).

    Looks at the first ``lookahead`` waiting requests, takes them greedily by
    (cost, arrival) while they fit the budget and the seat limit, and admits
    the chosen ones in arrival order; the rest keep their places at the front.
    A request costlier than the whole budget is skipped; if nothing fits, the
    head goes alone (or, with ``options.chunk_head``, gets a chunk filling the
    budget). Without a token budget it is FIFO.
    """

    name = "pack"
    description = "greedy by cost in a --lookahead window under the budget (seed 033)"
    uses_token_budget = True
    uses_lookahead = True
    uses_chunk_head = True
    preserves_arrival_order = True

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """See the class docstring."""
        chunk_head = self.options.chunk_head
        if budget.max_tokens is None:
            return fifo_under_budget(waiting, budget, ctx, chunk_head=chunk_head)
        window = [waiting[i] for i in range(min(self.options.lookahead, len(waiting)))]
        costs = [ctx.cost(seq) for seq in window]
        chosen = [False] * len(window)
        num_tokens = num_chosen = 0
        for i in sorted(range(len(window)), key=lambda j: (costs[j], j)):
            if num_chosen >= budget.max_seqs:
                break
            if num_tokens + costs[i] <= budget.max_tokens:
                chosen[i] = True
                num_tokens += costs[i]
                num_chosen += 1
        if not num_chosen and window:  # nothing fits: the head alone
            return [head_choice(window[0], costs[0], budget, chunk_head)]
        return [seq for seq, take in zip(window, chosen) if take]


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The built-in admission policies."""
    return [Fifo, TokenBudget, Pack]
