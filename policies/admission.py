"""Built-in admission policies: ``fifo``, ``budget``, ``pack``.

Semantics follow the seed posts (``../shared/seeds``): 027 (pending-queue
admission), 031 (prefill token budget), 033 (lookahead packing).
"""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer import hookimpl
from roseinfer.admission import fifo_under_budget, head_choice
from roseinfer.interface import (
    CHUNK_HEAD_OPTION,
    AdmissionPolicy,
    Budget,
    Choice,
    PolicyContext,
    PolicyOption,
)
from roseinfer.sequence import Sequence as Seq

LOOKAHEAD_OPTION = PolicyOption(
    "lookahead", int, 64, "pack: waiting requests looked at (default 64, seed 033)", minimum=1
)


class Fifo(AdmissionPolicy):
    """Arrival order, limited only by seats and KV blocks (seed 027)."""

    name = "fifo"
    description = "arrival order; ignores the token budget (seed 027)"
    preserves_arrival_order = True
    admits_queue_prefix = True


class TokenBudget(AdmissionPolicy):
    """FIFO under a per-round prefill token budget (seed 031): the default
    admission (:func:`roseinfer.admission.fifo_under_budget`) with the budget on."""

    name = "budget"
    description = "arrival order under --prefill-max-tokens; oversize head alone (seed 031)"
    uses_token_budget = True
    option_specs = (CHUNK_HEAD_OPTION,)
    preserves_arrival_order = True
    admits_queue_prefix = True


class Pack(AdmissionPolicy):
    """Lookahead packing under the token budget (seed 033).

    Looks at the first ``lookahead`` waiting requests, takes them greedily by
    (cost, arrival) while they fit the budget and the seat limit, and admits
    the chosen ones in arrival order; the rest keep their places at the front.
    A request costlier than the whole budget is skipped; if nothing fits, the
    head goes alone (or, with ``chunk_head``, gets a chunk filling the
    budget). Without a token budget it is FIFO.
    """

    name = "pack"
    description = "greedy by cost in a --lookahead window under the budget (seed 033)"
    uses_token_budget = True
    option_specs = (LOOKAHEAD_OPTION, CHUNK_HEAD_OPTION)
    preserves_arrival_order = True

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """See the class docstring."""
        chunk_head = self.opt("chunk_head")
        if budget.max_tokens is None:
            return fifo_under_budget(waiting, budget, ctx, chunk_head=chunk_head)
        window = [waiting[i] for i in range(min(self.opt("lookahead"), len(waiting)))]
        costs = [ctx.cost(seq) for seq in window]
        chosen = [False] * len(window)
        num_tokens = num_chosen = 0
        for cost, i in sorted(zip(costs, range(len(window)))):  # by (cost, arrival)
            if num_chosen >= budget.max_seqs:
                break
            if num_tokens + cost <= budget.max_tokens:
                chosen[i] = True
                num_tokens += cost
                num_chosen += 1
        if not num_chosen and window:  # nothing fits: the head alone
            return [head_choice(window[0], costs[0], budget, chunk_head)]
        return [seq for seq, take in zip(window, chosen) if take]


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The built-in admission policies."""
    return [Fifo, TokenBudget, Pack]
