"""Urgency-ordered admission: ``priority`` (with preemption) and ``edf`` (deadlines)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from roseinfer import hookimpl
from roseinfer.interface import CHUNK_HEAD_OPTION, AdmissionPolicy, PolicyContext, PolicyOption
from roseinfer.policies.ranked import preempt_for
from roseinfer.sequence import Sequence as Seq


class Priority(AdmissionPolicy):
    """vLLM's priority scheduling: lower ``priority`` is more urgent, ties by arrival.

    Waiting requests are admitted in (priority, arrival) order (vLLM v1
    ``--scheduling-policy priority``: vllm/v1/core/sched/request_queue.py). The
    KV-pressure victim is the running request with the largest (priority,
    arrival), as vLLM v1's scheduler picks it. A waiting request that lacks a
    seat or blocks preempts running requests of strictly lower priority (vLLM
    v0's ``_schedule_priority_preemption``; vLLM #40004, SGLang #8743).
    """

    name = "priority"
    description = "lowest priority value first (vLLM); preempts less urgent running requests"
    uses_token_budget = True
    may_preempt = True
    option_specs = (CHUNK_HEAD_OPTION,)
    guarantees = ("ranked-prefix", "strict-priority", "preempt-strictly-lower-priority")

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """priority needs two priority values to order anything."""
        values = {r.priority for r in requests}
        if len(values) < 2 and requests:
            return [f"priority: every request has priority {values.pop()}, so priority "
                    "admits in arrival order, as fifo (give a 'priority' trace column)"]  # fmt: skip
        return []

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[int, float, int]:
        """(priority, arrival time, seq_id)."""
        return (seq.request.priority, seq.request.arrival_time_s, seq.seq_id)

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Less urgent running requests, for more urgent waiting ones that need room."""
        return preempt_for(
            waiting,
            ctx,
            lambda s: self.rank(s, ctx),
            lambda a, b: a.request.priority < b.request.priority,
        )

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """Never asks again while requests only decode: priorities do not change."""
        return math.inf

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """The running request with the largest (priority, arrival)."""
        return max(running, key=lambda s: self.rank(s, ctx))


class EarliestDeadline(AdmissionPolicy):
    """Earliest deadline first on first-token deadlines.

    A request's deadline is ``arrival + deadline_s`` (its first token is due
    then; no ``deadline_s``: never due). Waiting requests are admitted by
    deadline, except that those already past it with no token yet (they can no
    longer meet it) go after every request that still can, by deadline among
    themselves. With ``--drop-late`` they are dropped (rejected) instead.
    Source: Liu and Layland, JACM 1973 (EDF); the Gateway API inference
    extension's EDF request ordering (#1797) and SLO tiers in vLLM #30256.
    """

    name = "edf"
    description = "earliest first-token deadline first; late requests last (or --drop-late)"
    uses_token_budget = True
    may_drop = True
    guarantees = ("ranked-prefix",)
    option_specs = (
        PolicyOption(
            "drop_late",
            bool,
            False,
            "edf: reject waiting requests past their first-token deadline instead of "
            "serving them last",
        ),
        CHUNK_HEAD_OPTION,
    )

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """edf needs deadlines."""
        if requests and all(r.deadline_s is None for r in requests):
            return ["edf: no request has a deadline_s, so edf admits in arrival order, as "
                    "fifo (give a 'deadline_s' trace column)"]  # fmt: skip
        return []

    @staticmethod
    def due_s(seq: Seq) -> float:
        """Time (s) its first token is due (inf without a deadline)."""
        deadline = seq.request.deadline_s
        return math.inf if deadline is None else seq.request.arrival_time_s + deadline

    def is_late(self, seq: Seq, now_s: float) -> bool:
        """True when its first token is still to come and its deadline has passed."""
        return seq.num_output_tokens == 0 and self.due_s(seq) < now_s

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[bool, float, int]:
        """(late, deadline, seq_id)."""
        return (self.is_late(seq, ctx.now_s), self.due_s(seq), seq.seq_id)

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """With ``--drop-late``, until the next waiting request's deadline passes."""
        if not self.opt("drop_late"):
            return math.inf
        return min((self.due_s(s) for s in waiting if not self.is_late(s, ctx.now_s)),
                   default=math.inf)  # fmt: skip

    def drop(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """With ``--drop-late``, every late waiting request."""
        if not self.opt("drop_late"):
            return []
        return [s for s in waiting if self.is_late(s, ctx.now_s)]


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The urgency policies."""
    return [Priority, EarliestDeadline]
