"""Built-in wrapper: ``force-fifo`` (seed 033's fairness fallback)."""

from __future__ import annotations

from collections.abc import Sequence

from roseinfer import hookimpl
from roseinfer.admission import fifo_under_budget
from roseinfer.interface import Budget, Choice, PolicyContext, PolicyOptions, PolicyWrapper
from roseinfer.sequence import Sequence as Seq


class ForceFifo(PolicyWrapper):
    """Every N-th admission round admits in strict FIFO under the budget.

    Wraps any admission policy. A policy that skips the head (``pack``) could
    starve a long request forever; forcing FIFO every N rounds admits the head
    within N rounds of it reaching the front (given free seats and blocks).
    N is ``options.force_fifo_every`` (seed 033's ``prefill_force_fifo_every``).
    """

    name = "force-fifo"
    description = "every N-th admission round is FIFO under the budget (seed 033)"
    option = "force_fifo_every"
    uses_token_budget = True

    @classmethod
    def enabled(cls, options: PolicyOptions) -> bool:
        """On when ``force_fifo_every`` > 0."""
        return options.force_fifo_every > 0

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """FIFO on rounds that are multiples of N, else the wrapped policy."""
        if ctx.admission_round % self.options.force_fifo_every == 0:
            return fifo_under_budget(waiting, budget, ctx, chunk_head=self.options.chunk_head)
        return self.inner.admit(waiting, budget, ctx)

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """The wrapped policy's preemptions, except when the next admission round
        is a FIFO one: it would re-admit the victims first (the preempted wait at
        the head), and preempting again would never end."""
        if (ctx.admission_round + 1) % self.options.force_fifo_every == 0:
            return []
        return self.inner.preempt(waiting, ctx)


@hookimpl
def register_policy_wrappers() -> list[type[PolicyWrapper]]:
    """The built-in wrappers."""
    return [ForceFifo]
