"""Per-tenant fairness: ``vtc``, the Virtual Token Counter.

Source: Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024
(Algorithm 2); asked for in llm-d-router #1182.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from roseinfer import hookimpl
from roseinfer.admission import head_choice
from roseinfer.interface import (
    CHUNK_HEAD_OPTION,
    AdmissionPolicy,
    Budget,
    Choice,
    PolicyContext,
    PolicyOption,
    StepReport,
)
from roseinfer.sequence import Sequence as Seq

Tenant = str | None
MAX_VTC_WEIGHT = 1e6
"""Largest counter weight of a token: weights are price ratios of tokens (the paper's
1 and 2), so 1e6 is beyond any; it keeps every counter finite (1e6 x 2^63 tokens is
far below 1e308), where weights of 1e308 overflowed to inf and made vtc a fifo."""


class VirtualTokenCounter(AdmissionPolicy):
    """Admit from the backlogged tenant that has received the least service.

    Each tenant has a counter of weighted service: ``w_p`` per prompt token and
    ``w_q`` per output token it computed (``--vtc-input-weight``,
    ``--vtc-output-weight``; the paper's 1 and 2), updated from
    :meth:`observe_step`. Each admission takes the oldest waiting request of
    the tenant with the smallest counter (ties: the older head), charging
    ``w_p`` x its uncached prompt within the round. A tenant that becomes
    backlogged again has its counter lifted to the smallest counter among the
    backlogged tenants (or, with none, to the counter of the last tenant that
    left the backlog; of several that left in one round, the largest), so idle
    time banks no credit. Requests without a tenant
    form one tenant. Recompute after a preemption is service received, and
    counted. Bound (the paper's Theorem 4.3): two continuously backlogged
    tenants' service differs by at most ``2 * (w_p * L_in + w_q * M)``, with
    ``L_in`` the longest prompt and ``M`` the KV pool in tokens.
    """

    name = "vtc"
    description = "per-tenant virtual token counters: least-served tenant first (VTC, OSDI'24)"
    uses_token_budget = True
    observes_steps = True
    guarantees = ("vtc-bound",)
    option_specs = (
        PolicyOption(
            "vtc_input_weight", float, 1.0, "vtc: counter weight of a prompt token (w_p)",
            minimum=0.0, maximum=MAX_VTC_WEIGHT,
        ),
        PolicyOption(
            "vtc_output_weight", float, 2.0, "vtc: counter weight of an output token (w_q)",
            minimum=0.0, maximum=MAX_VTC_WEIGHT,
        ),
        CHUNK_HEAD_OPTION,
    )  # fmt: skip

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self.counters: dict[Tenant, float] = {}
        self._backlogged: set[Tenant] = set()
        self._last_left = 0.0
        self._weights = (self.opt("vtc_input_weight"), self.opt("vtc_output_weight"))
        if not any(self._weights):
            raise ValueError(
                "--vtc-input-weight and --vtc-output-weight are both 0: no service would "
                "count and vtc would admit as fifo; give one a weight > 0"
            )

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """vtc needs two tenants to share anything."""
        tenants = {r.tenant for r in requests}
        if len(tenants) < 2 and requests:
            who = "no request names a tenant" if tenants == {None} else "one tenant"
            return [f"vtc: {who}, so vtc admits in arrival order, as fifo "
                    "(give a 'tenant' trace column)"]  # fmt: skip
        return []

    def observe_step(self, report: StepReport) -> None:
        """Charge every tenant for the tokens its requests computed."""
        w_p, w_q = self._weights
        counters = self.counters
        for item in report.items:
            weight = w_q if item.is_decode else w_p
            counters[item.tenant] = counters.get(item.tenant, 0.0) + weight * item.num_tokens

    def _lift(self, queues: dict[Tenant, list[Seq]]) -> None:
        """The paper's counter lift for tenants that (re)join the backlog."""
        now = set(queues)
        left = self._backlogged - now
        if left:  # several at once: the largest counter (set order varies with PYTHONHASHSEED)
            self._last_left = max(self.counters.get(t, 0.0) for t in left)
        joined = now - self._backlogged
        if joined:
            stayed = [self.counters.get(t, 0.0) for t in now & self._backlogged]
            floor = min(stayed) if stayed else self._last_left
            for t in joined:
                self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._backlogged = now

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """Least-served tenant's oldest request, repeatedly, under the budget."""
        queues: dict[Tenant, list[Seq]] = {}
        for seq in waiting:
            queues.setdefault(seq.request.tenant, []).append(seq)
        self._lift(queues)
        heap = [
            (self.counters[t], q[0].request.arrival_time_s, q[0].seq_id, t)
            for t, q in queues.items()
        ]
        heapq.heapify(heap)
        taken = dict.fromkeys(queues, 0)
        selected: list[Choice] = []
        num_tokens = 0
        while heap and len(selected) < budget.max_seqs:
            counter, _, _, tenant = heapq.heappop(heap)
            seq = queues[tenant][taken[tenant]]
            cost = ctx.cost(seq)
            if budget.max_tokens is not None and num_tokens + cost > budget.max_tokens:
                if not selected:
                    selected.append(head_choice(seq, cost, budget, self.opt("chunk_head")))
                break
            selected.append(seq)
            num_tokens += cost
            taken[tenant] += 1
            if taken[tenant] < len(queues[tenant]):
                nxt = queues[tenant][taken[tenant]]
                entry = (counter + self._weights[0] * cost, nxt.request.arrival_time_s, nxt.seq_id)
                heapq.heappush(heap, (*entry, tenant))
        return selected


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The fairness policies."""
    return [VirtualTokenCounter]
