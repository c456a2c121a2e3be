"""The one policy interface: admission, loop ordering and preemption victim.

A run combines two plugin classes: the admission policy (``--policy``, which
overrides :meth:`AdmissionPolicy.admit`) and the loop ordering
(``--loop-order``, which overrides :meth:`AdmissionPolicy.order`). Both are
subclasses of :class:`AdmissionPolicy`; a class overrides only what it changes
and inherits the defaults for the rest (FIFO admission, prefill-first order,
the most recently admitted request as preemption victim).

The scheduler validates every answer (:class:`PolicyError` names the plugin).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from roseinfer.sequence import Sequence as Seq


class PolicyError(RuntimeError):
    """A policy plugin returned an answer the scheduler cannot use.

    The message names the plugin and what was wrong (not waiting, duplicate,
    over budget, too many sequences).
    """


class Phase(enum.Enum):
    """One forward pass of an iteration."""

    PREFILL = "prefill"  # admit waiting requests and compute their prompts
    DECODE = "decode"  # one new token for every running request


PREFILL_FIRST: tuple[Phase, ...] = (Phase.PREFILL, Phase.DECODE)
DECODE_FIRST: tuple[Phase, ...] = (Phase.DECODE, Phase.PREFILL)


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Knobs handed to every policy instance.

    Attributes:
        lookahead: how many waiting requests ``pack`` looks at (seed 033 default 64).
        force_fifo_every: every N-th admission round is strict FIFO; 0 disables.
        extra: third-party knobs from ``--policy-arg key=value`` (strings).
    """

    lookahead: int = 64
    force_fifo_every: int = 0
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.lookahead <= 0:
            raise ValueError(f"lookahead must be > 0, got {self.lookahead}")
        if self.force_fifo_every < 0:
            raise ValueError(
                f"force_fifo_every must be >= 0 (0 disables), got {self.force_fifo_every}"
            )


@dataclass(frozen=True, slots=True)
class Budget:
    """What an admission round may still take.

    Attributes:
        max_tokens: prompt tokens that may be prefilled this round (the seeds'
            ``prefill_max_tokens``), or None for no token limit.
        max_seqs: how many requests may be admitted: min(``prefill_max_seqs``,
            ``max_num_seqs`` - running).
        num_free_blocks: free KV blocks (including evictable cached ones). The
            scheduler admits a selection in order and stops at the first request
            whose blocks don't fit, so a policy need not check this.
    """

    max_tokens: int | None
    max_seqs: int
    num_free_blocks: int

    def fits(self, num_tokens: int) -> bool:
        """True when ``num_tokens`` prompt tokens fit the token limit."""
        return self.max_tokens is None or num_tokens <= self.max_tokens


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """Read-only facts about the scheduler for one policy call.

    Attributes:
        now_s: scheduler time in seconds (virtual in the simulator, real in the executor).
        admission_round: 1-based count of admission rounds so far, this one included.
        num_running: requests in the running set.
        num_waiting: requests in the waiting queue.
        max_model_len: the max context length in tokens.
        cost: ``cost(seq)`` -> prompt tokens this request would compute if
            admitted now: tokens not in the prefix cache, capped at
            ``max_model_len`` (seed 031's ``min(len(prompt), max_context)``).
    """

    now_s: float
    admission_round: int
    num_running: int
    num_waiting: int
    max_model_len: int
    cost: Callable[[Seq], int]


class AdmissionPolicy:
    """Base class of every policy and loop ordering plugin.

    Subclasses set ``name`` and a one-line ``description`` and override what they
    change. Instances are made per run with :class:`PolicyOptions` and may keep
    state across rounds (e.g. a counter).

    Class attributes:
        name: the CLI name (``--policy NAME`` or ``--loop-order NAME``).
        description: one line shown by ``--list-policies``.
        uses_token_budget: True if ``admit`` honours ``budget.max_tokens``;
            the CLI rejects ``--prefill-max-tokens`` with a policy that ignores it.
        uses_lookahead: True if ``admit`` reads ``options.lookahead``.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    uses_token_budget: ClassVar[bool] = False
    uses_lookahead: ClassVar[bool] = False

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options if options is not None else PolicyOptions()

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Seq]:
        """Choose the waiting requests to prefill this round.

        Args:
            waiting: the waiting queue in arrival order (preempted requests first);
                a read-only view, never mutate it.
            budget: token, seat and block limits of this round.
            ctx: scheduler facts, including ``ctx.cost(seq)``.

        Returns:
            A list of distinct members of ``waiting``, in the order to admit
            them. Its total cost must fit ``budget.max_tokens`` unless it holds a
            single request (an oversize request goes alone so nothing
            deadlocks), and it holds at most ``budget.max_seqs`` requests.
            Returning an empty list while nothing runs stalls the run and is an
            error.

        Default: FIFO, no token limit (the ``fifo`` policy).
        """
        return list(_head(waiting, budget.max_seqs))

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Return the phases of the next iteration, in order.

        Called once per iteration that has both waiting and running requests.
        Default: prefill-first (admit, then one decode step).
        """
        return PREFILL_FIRST

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Pick the running request to preempt (by recompute) when a decode
        cannot get a KV block.

        Args:
            running: the running set in admission order (non-empty).

        Returns:
            A member of ``running``. Default: the most recently admitted one
            (vLLM's choice for FCFS).
        """
        return running[-1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PolicyWrapper(AdmissionPolicy):
    """A policy that wraps the run's admission policy and delegates to it.

    Subclasses set ``name``, ``description``, ``option`` (the
    :class:`PolicyOptions` field that turns it on, for ``--list-policies``),
    implement :meth:`enabled` and override what they change.

    Args:
        inner: the wrapped policy.
        options: the run's options.
    """

    option: ClassVar[str] = ""

    def __init__(self, inner: AdmissionPolicy, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.inner = inner

    @classmethod
    def enabled(cls, options: PolicyOptions) -> bool:
        """True when ``options`` ask for this wrapper."""
        return False

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Seq]:
        """Delegate to the wrapped policy."""
        return self.inner.admit(waiting, budget, ctx)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Delegate to the wrapped policy."""
        return self.inner.order(ctx)

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Delegate to the wrapped policy."""
        return self.inner.select_victim(running, ctx)


class ComposedPolicy(AdmissionPolicy):
    """The policy a run uses: admission and victim from one plugin class
    (possibly wrapped), loop ordering from another.

    Args:
        admission: instance answering ``admit`` and ``select_victim``.
        ordering: instance answering ``order``.
    """

    def __init__(self, admission: AdmissionPolicy, ordering: AdmissionPolicy) -> None:
        super().__init__(admission.options)
        self.admission = admission
        self.ordering = ordering
        self.label = f"{_label(admission)}+{ordering.name}"
        self.base = _base(admission)

    @property
    def uses_token_budget(self) -> bool:  # type: ignore[override]
        """Whether the chosen admission policy (not its wrappers) honours the budget."""
        return self.base.uses_token_budget

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Seq]:
        """Delegate to the admission policy."""
        return self.admission.admit(waiting, budget, ctx)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Delegate to the loop ordering."""
        return self.ordering.order(ctx)

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Delegate to the admission policy."""
        return self.admission.select_victim(running, ctx)


def _label(policy: AdmissionPolicy) -> str:
    if isinstance(policy, PolicyWrapper):
        return f"{_label(policy.inner)}+{policy.name}"
    return policy.name


def _base(policy: AdmissionPolicy) -> AdmissionPolicy:
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy


def _head(waiting: Sequence[Any], n: int) -> Sequence[Any]:
    return [waiting[i] for i in range(min(n, len(waiting)))]
