"""Built-in wrapper: ``force-fifo`` (seed 033's fairness fallback)."""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer import hookimpl
from roseinfer.admission import fifo_under_budget
from roseinfer.interface import (
    CHUNK_HEAD_OPTION,
    Budget,
    Choice,
    PolicyContext,
    PolicyOption,
    PolicyOptions,
    PolicyWrapper,
)
from roseinfer.sequence import Sequence as Seq

FORCE_FIFO_EVERY_OPTION = PolicyOption(
    "force_fifo_every",
    int,
    0,
    "strict FIFO every N-th admission round, for any policy (default 0 = off; seed 033)",
    minimum=0,
)


class ForceFifo(PolicyWrapper):
    """Every N-th admission round admits in strict FIFO under the budget.

    Wraps any admission policy. A policy that skips the head (``pack``) could
    starve a long request forever; forcing FIFO every N rounds admits the head
    within N rounds of it reaching the front (given free seats and blocks).
    N is the ``force_fifo_every`` knob (seed 033's ``prefill_force_fifo_every``).
    """

    name = "force-fifo"
    description = "every N-th admission round is FIFO under the budget (seed 033)"
    option = "force_fifo_every"
    uses_token_budget = True
    option_specs = (FORCE_FIFO_EVERY_OPTION,)

    @classmethod
    def enabled(cls, options: PolicyOptions) -> bool:
        """On when ``force_fifo_every`` > 0."""
        return int(FORCE_FIFO_EVERY_OPTION.convert(options.get("force_fifo_every", 0))) > 0

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """FIFO on rounds that are multiples of N, else the wrapped policy (the
        wrapped policy's ``chunk_head`` applies to the FIFO rounds too)."""
        if ctx.admission_round % self.opt("force_fifo_every") == 0:
            chunk_head = CHUNK_HEAD_OPTION.convert(self.options.get("chunk_head", False))
            return fifo_under_budget(waiting, budget, ctx, chunk_head=chunk_head)
        return self.inner.admit(waiting, budget, ctx)

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """The wrapped policy's preemptions, except when the next admission round
        is a FIFO one: it would re-admit the victims first (the preempted wait at
        the head), and preempting again would never end."""
        if (ctx.admission_round + 1) % self.opt("force_fifo_every") == 0:
            return []
        return self.inner.preempt(waiting, ctx)


@hookimpl
def register_policy_wrappers() -> list[type[PolicyWrapper]]:
    """The built-in wrappers."""
    return [ForceFifo]
