"""The one policy interface: admission, loop ordering, preemption, observation.

A run combines two plugin classes: the admission policy (``--policy``, which
overrides :meth:`AdmissionPolicy.admit`) and the loop ordering
(``--loop-order``, which overrides :meth:`AdmissionPolicy.order`). Both are
subclasses of :class:`AdmissionPolicy`; a class overrides only what it changes
and inherits the defaults for the rest (FIFO admission, prefill-first order,
the most recently admitted request as preemption victim).

Policies that need more than ``admit`` opt in with class attributes: a
policy that names running requests to preempt for waiting ones
(``may_preempt``, :meth:`AdmissionPolicy.preempt`), one that drops waiting
requests (``may_drop``, :meth:`AdmissionPolicy.drop`), one that watches what
every step computed (``observes_steps``, :meth:`AdmissionPolicy.observe_step`),
and typed knobs (``option_specs``, :class:`PolicyOption`: real CLI flags).

The scheduler validates every answer (:class:`PolicyError` names the plugin).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, Union

from roseinfer.admission import admit_ranked, fifo_under_budget

if TYPE_CHECKING:
    from roseinfer.sequence import Sequence as Seq


_T = TypeVar("_T")


class PolicyError(RuntimeError):
    """A policy plugin returned an answer the scheduler cannot use.

    The message names the plugin and what was wrong (not waiting, duplicate,
    over budget, too many sequences).
    """


class Phase(enum.Enum):
    """What one step (one forward pass) of an iteration computes.

    Every phase is planned as tokens per request (``num_new_tokens``), so a
    whole prompt, a prefill chunk and a decode are the same mechanism; the
    phase says which requests a step may hold.
    """

    PREFILL = "prefill"  # running partial prefills' next chunks, then admissions
    DECODE = "decode"  # one new token for every decoding request
    MIXED = "mixed"  # decodes first, then prefill chunks, in one forward (vLLM v1, Sarathi-Serve)


PREFILL_FIRST: tuple[Phase, ...] = (Phase.PREFILL, Phase.DECODE)
DECODE_FIRST: tuple[Phase, ...] = (Phase.DECODE, Phase.PREFILL)
MIXED_ORDER: tuple[Phase, ...] = (Phase.MIXED,)


class PolicyOptions:
    """The knob values of a run's policy instances: name -> value.

    Every knob is declared by the plugin that reads it (:class:`PolicyOption` in
    its ``option_specs``: ``pack``'s ``lookahead``, the ``force-fifo`` wrapper's
    ``force_fifo_every``, ``chunk_head``, a predictor's ``length_predictor_sigma``,
    ...); a plugin reads its own with :meth:`AdmissionPolicy.opt`, which applies
    the declared default and type. Values come from the plugins' flags or
    ``--policy-arg key=value`` (strings, converted by the declared type), or
    from Python: ``PolicyOptions(force_fifo_every=8, lookahead=16)``.

    Attributes:
        values: knob name -> value (read-only by convention).
    """

    __slots__ = ("values",)

    def __init__(self, values: Mapping[str, Any] | None = None, **knobs: Any) -> None:
        self.values: dict[str, Any] = {**(values or {}), **knobs}

    def get(self, name: str, default: Any = None) -> Any:
        """The value given for ``name`` (not converted), else ``default``."""
        return self.values.get(name, default)

    def replace(self, **knobs: Any) -> PolicyOptions:
        """A copy with ``knobs`` set."""
        return PolicyOptions(self.values, **knobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyOptions) and self.values == other.values

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PolicyOptions({self.values!r})"


def parse_bool(text: str) -> bool:
    """``"1"/"true"/"yes"/"on"`` -> True, ``"0"/"false"/"no"/"off"`` -> False.

    Raises:
        ValueError: for anything else.
    """
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True, slots=True)
class PolicyOption:
    """A typed knob a plugin declares (``option_specs``); the CLIs turn it into
    a real flag ``--{name with dashes}`` shown by ``--help``, and accept it as
    ``--policy-arg name=value``.

    Attributes:
        name: snake_case key in :attr:`PolicyOptions.extra`.
        type: ``int``, ``float``, ``str`` or ``bool`` (parsed by :func:`parse_bool`).
        default: value when not given.
        help: one line for ``--help`` (units included).
        choices: allowed values, or None.
        minimum: smallest allowed value of an ``int`` or ``float`` knob, or None.
        maximum: largest allowed value of an ``int`` or ``float`` knob, or None.
        A ``float`` knob must be finite (no NaN or inf).
    """

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None

    @property
    def flag(self) -> str:
        """The CLI flag, e.g. ``--length-predictor``."""
        return "--" + self.name.replace("_", "-")

    def convert(self, value: Any) -> Any:
        """``value`` (a string from the command line, or typed) as this option's type.

        Raises:
            ValueError: naming the flag, if it does not parse or is not a choice.
        """
        try:
            if isinstance(value, str):
                value = parse_bool(value) if self.type is bool else self.type(value)
            value = _typed(value, self.type)
        except (ValueError, TypeError):
            kind = {"int": "an integer", "float": "a number", "bool": "true or false"}.get(
                self.type.__name__, f"a {self.type.__name__}"
            )
            raise ValueError(f"{self.flag} takes {kind}, got {value!r}") from None
        if self.type is float and not math.isfinite(value):
            raise ValueError(f"{self.flag} must be a finite number, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.flag} must be >= {self.minimum:g}, got {value!r}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"{self.flag} must be <= {self.maximum:g}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            known = ", ".join(map(str, self.choices))
            raise ValueError(f"{self.flag} must be one of {known}, got {value!r}")
        return value


def _typed(value: Any, kind: type) -> Any:
    """``value`` as ``kind`` when it already is one (an int for a float knob is
    widened); anything else (a float for an int knob, a bool for a number) is a
    TypeError."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float) and isinstance(value, bool):
        raise TypeError(value)
    if not isinstance(value, kind):
        raise TypeError(value)
    return value


CHUNK_HEAD_OPTION = PolicyOption(
    "chunk_head",
    bool,
    False,
    "a head that does not fit the token budget is admitted with a chunk that fills it, "
    "instead of alone with its whole prompt (needs chunked prefill)",
)
"""The ``chunk_head`` knob of the policies that admit under the token budget; the
default :meth:`AdmissionPolicy.admit` reads it when the class declares it."""


@dataclass(frozen=True, slots=True)
class StepItem:
    """What one request computed in a step (for :meth:`AdmissionPolicy.observe_step`).

    Attributes:
        seq: the request's state (read it, never change it).
        tenant: ``seq.request.tenant`` (None: no tenant).
        num_tokens: tokens computed (prompt chunk or decodes; a multi-step decode
            output counts each of its steps).
        is_decode: True for decode tokens, False for prompt (prefill) tokens.
    """

    seq: Seq
    tenant: str | None
    num_tokens: int
    is_decode: bool


@dataclass(frozen=True, slots=True)
class StepReport:
    """The end of one scheduler output (one step, or a multi-step decode run).

    Attributes:
        end_s: end time of its last step (s).
        num_steps: steps it covered.
        items: one :class:`StepItem` per scheduled request.
    """

    end_s: float
    num_steps: int
    items: tuple[StepItem, ...]


@dataclass(frozen=True, slots=True)
class Budget:
    """What an admission round may still take.

    Attributes:
        max_tokens: prompt tokens that may still be prefilled this step (the
            seeds' ``prefill_max_tokens`` less the chunks of running partial
            prefills), or None for no such limit. A policy that declares
            ``uses_token_budget`` honours it.
        max_seqs: how many requests may be admitted: min(``prefill_max_seqs``,
            ``max_num_seqs`` - running).
        num_free_blocks: free KV blocks (including evictable cached ones). The
            scheduler admits a selection in order and stops at the first request
            whose blocks don't fit, so a policy need not check this.
        max_batched_tokens: tokens left in this step under
            ``max_num_batched_tokens`` (decodes and earlier chunks taken), or None
            for no limit. The scheduler enforces it itself: with chunked prefill
            it cuts a request's chunk to what is left, without it a request that
            does not fit waits; an explicit chunk must fit it.
    """

    max_tokens: int | None
    max_seqs: int
    num_free_blocks: int
    max_batched_tokens: int | None = None

    def fits(self, num_tokens: int) -> bool:
        """True when ``num_tokens`` prompt tokens fit the token limit."""
        return self.max_tokens is None or num_tokens <= self.max_tokens

    @property
    def max_chunk_tokens(self) -> int | None:
        """The largest chunk a policy may ask for: min(max_tokens, max_batched_tokens)."""
        limits = [x for x in (self.max_tokens, self.max_batched_tokens) if x is not None]
        return min(limits) if limits else None


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
        running: the running set in admission order (a read-only view; never
            mutate it or the sequences).
        num_free_blocks: free KV blocks (evictable cached ones included).
        block_size: tokens per KV block.
        max_num_seqs: the running-set cap.
        free_seats: requests that may be admitted now: min(``prefill_max_seqs``,
            ``max_num_seqs`` - running).
    """

    now_s: float
    admission_round: int
    num_running: int
    num_waiting: int
    max_model_len: int
    cost: Callable[[Seq], int]
    running: Sequence[Seq] = ()
    num_free_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 0
    free_seats: int = 0


GUARANTEES: dict[str, str] = {
    "ranked-prefix": "every selection is the best-ranked prefix of the waiting queue under "
    "its rank (force-FIFO rounds aside)",
    "strict-priority": "no admitted request has a larger priority value than one left waiting",
    "aging-bound": "a request waiting longer than the aging bound (--lpm-aging-s) is passed "
    "only by older requests",
    "vtc-bound": "while two tenants are backlogged their weighted service differs by at most "
    "2 * (w_p * longest prompt + w_q * KV pool tokens) (Sheng et al., OSDI 2024, Thm 4.3)",
    "later-only-if-shorter": "a later arrival is admitted before a waiting request only with a "
    "strictly shorter predicted output",
    "preempt-strictly-longer": "every policy preemption's victim has strictly more remaining "
    "predicted output than a waiting request it makes room for",
    "preempt-pays-recompute": "a policy preemption happens only when the victim's remaining "
    "work exceeds --srpt-preempt-factor times the waiting request's remaining work plus the "
    "victim's recompute",
    "preempt-strictly-lower-priority": "every policy preemption's victim has a strictly larger "
    "priority value than a waiting request it makes room for",
}
"""The one registry of guarantee names a policy may declare in ``guarantees``:
name -> what it promises. ``tests/test_properties.py`` checks each declared name
for each policy that declares it; a name not in here is an error when the
policy is registered (:func:`check_guarantees`). A third-party plugin that
promises something new adds its name here, with its check."""


def check_guarantees(cls: type) -> None:
    """Check that every name in ``cls.guarantees`` is in :data:`GUARANTEES`.

    Raises:
        ValueError: naming the class, the unknown name and the known ones.
    """
    declared = getattr(cls, "guarantees", ())
    if isinstance(declared, str) or not isinstance(declared, tuple):
        raise ValueError(f"{cls.__name__}.guarantees must be a tuple of names, got {declared!r}")
    for name in declared:
        if name not in GUARANTEES:
            known = ", ".join(sorted(GUARANTEES))
            raise ValueError(f"{cls.__name__} declares unknown guarantee {name!r}; known: {known}")


Choice = Union["Seq", tuple["Seq", int]]
"""One admission: a waiting request, or ``(request, num_tokens)`` to prefill only
its first ``num_tokens`` uncached tokens this step (a chunk; needs chunked prefill)."""


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
        preserves_arrival_order: declares that every selection lists requests in
            queue order (the property tests check what a policy declares).
        admits_queue_prefix: declares that every selection is a prefix of the
            waiting queue (strict FIFO; implies ``preserves_arrival_order``).
        may_preempt: the scheduler calls :meth:`preempt` before planning a step.
        may_drop: the scheduler calls :meth:`drop` before planning a step.
        observes_steps: the scheduler calls :meth:`observe_step` after every step.
        uses_length_predictor: the registry sets ``self.predictor`` (a
            :class:`roseinfer.prediction.LengthPredictor` named by ``--length-predictor``).
        option_specs: typed knobs this plugin reads (:class:`PolicyOption`); the
            CLIs turn each into a flag, and a knob no plugin of a run declares is
            an error.
        guarantees: names of the properties it declares, from :data:`GUARANTEES`
            (an unknown name is an error at registration); ``tests/test_properties.py``
            checks each one for each policy that declares it.
        fixed_order: a loop ordering whose :meth:`order` answers the same phases
            whatever the context declares them here; the scheduler then takes
            them as they are (checked once, at its start) instead of building a
            context and calling :meth:`order` every iteration, which was a
            quarter of the simulation time of mixed steps on the Azure conv
            trace. None (the default): :meth:`order` is called.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    uses_token_budget: ClassVar[bool] = False
    preserves_arrival_order: ClassVar[bool] = False
    admits_queue_prefix: ClassVar[bool] = False
    may_preempt: ClassVar[bool] = False
    may_drop: ClassVar[bool] = False
    observes_steps: ClassVar[bool] = False
    uses_length_predictor: ClassVar[bool] = False
    option_specs: ClassVar[tuple[PolicyOption, ...]] = ()
    guarantees: ClassVar[tuple[str, ...]] = ()
    fixed_order: ClassVar[tuple[Phase, ...] | None] = None

    def __init__(self, options: PolicyOptions | None = None) -> None:
        self.options = options if options is not None else PolicyOptions()

    def opt(self, name: str) -> Any:
        """The value of the declared option ``name`` (its default when not given),
        converted on the first read and kept: the options of an instance never
        change, and ``admit`` reads its knobs every admission round.

        Raises:
            KeyError: if this class declares no such option.
            ValueError: if the given value does not parse (names the flag).
        """
        known = self._option_values
        if name in known:
            return known[name]
        for spec in type(self).option_specs:
            if spec.name == name:
                value = self.options.get(name)
                known[name] = spec.default if value is None else spec.convert(value)
                return known[name]
        raise KeyError(f"{type(self).__name__} declares no option {name!r}")

    @functools.cached_property
    def _option_values(self) -> dict[str, Any]:
        """The options :meth:`opt` has converted so far, by name."""
        return {}

    @functools.cached_property
    def _chunk_head(self) -> bool:
        """Whether this policy declares ``chunk_head`` and it is on (read once: the
        options of an instance never change)."""
        return bool(self.declares("chunk_head") and self.opt("chunk_head"))

    @classmethod
    def declares(cls, name: str) -> bool:
        """True when the class declares the knob ``name`` in its ``option_specs``."""
        return any(spec.name == name for spec in cls.option_specs)

    def prepare(self, requests: Sequence[Any]) -> None:
        """Called once with the whole workload (``list[Request]`` sorted by
        arrival) before a replay, e.g. to fit a length predictor on a training
        slice. An online server never calls it. Default: nothing."""

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """What this policy needs that the workload lacks, one line each.

        Called once before a replay (after :meth:`prepare`) with the whole
        workload (``list[Request]``) and the run's
        :class:`roseinfer.config.SchedulerConfig` (or None); the driver prints
        each line once as a warning (:func:`roseinfer.driver.start_replay`). A
        policy whose inputs are missing (``lpm`` without prefix caching or token
        ids, ``edf`` without deadlines, ``priority`` with one priority, ``vtc``
        with one tenant) says it behaves as FIFO. Default: nothing.
        """
        return []

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Name running requests to preempt (by recompute) in favour of waiting ones.

        Called before each step is planned while requests wait, only when the
        class sets ``may_preempt``. ``ctx.running`` is the running set.

        Returns:
            Distinct members of ``ctx.running`` (empty: preempt nothing). They
            return to the head of the waiting queue, as after a KV preemption,
            and admission may run in the same step.
        """
        return []

    def drop(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Name waiting requests to end now as rejected (e.g. a missed deadline).

        Called before each step is planned, only when ``may_drop`` is set.

        Returns:
            Distinct members of ``waiting``; each ends with status ``rejected``
            and reason ``dropped by policy ...``.
        """
        return []

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """For a policy that preempts or drops: until when (s) its :meth:`preempt`
        and :meth:`drop` answers stay empty, given that they are empty now and
        that meanwhile the running requests only decode (no arrival, completion
        or admission). The simulator plans the decode steps up to then as one
        run instead of asking before every step.

        Default: ``ctx.now_s`` (ask before every step), which is always right.
        """
        return ctx.now_s

    def observe_step(self, report: StepReport) -> None:
        """Called after every applied scheduler output when ``observes_steps`` is
        set: what each request computed (tokens, tenant). Default: nothing."""

    def rank(self, seq: Seq, ctx: PolicyContext) -> Any:
        """The admission rank of a waiting request: smaller is admitted first.

        A policy that defines it (``sjf``, ``srpt``, ``priority``, ``edf``, ...) needs
        no ``admit``: the default admits the best-ranked requests under the seats
        and the token budget (:func:`roseinfer.admission.admit_ranked`), the
        oversize-head rule and ``chunk_head`` included. Include ``seq.seq_id`` as
        the last key for a total order. Not defined by default (FIFO).
        """
        raise NotImplementedError

    @classmethod
    def ranks(cls) -> bool:
        """True when the class defines :meth:`rank`."""
        return cls.rank is not AdmissionPolicy.rank

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """Choose the waiting requests to prefill this step.

        Args:
            waiting: the waiting queue in arrival order (preempted requests first);
                a read-only view, never mutate it.
            budget: token, seat and block limits of this step.
            ctx: scheduler facts, including ``ctx.cost(seq)``.

        Returns:
            Distinct members of ``waiting`` in the order to admit them, each
            either alone (the scheduler sizes its chunk: the whole uncached
            prompt, or what the step has left when chunked prefill is on) or as
            ``(seq, num_tokens)`` with ``0 < num_tokens <= ctx.cost(seq)`` and
            ``num_tokens <= budget.max_batched_tokens`` (a chunk). The summed
            tokens (``num_tokens``, or the cost) must fit ``budget.max_tokens``
            unless the list holds a single request (an oversize request goes
            alone so nothing deadlocks), and the list holds at most
            ``budget.max_seqs`` requests. Returning an empty list while nothing
            runs stalls the run and is an error. The scheduler admits in list
            order and stops at the first request that cannot start this step
            (KV blocks, step tokens, the partial-prefill cap); each entry is
            checked when it is taken, so the entries after that one are never
            looked at (a long answer costs nothing beyond what is admitted).

        Default: the best-ranked requests when the class defines :meth:`rank`,
        else arrival order, under the token budget (when the policy declares
        ``uses_token_budget``; FIFO is the ``fifo`` policy).
        """
        chunk_head = self._chunk_head
        if budget.max_tokens is not None and not self.uses_token_budget:
            budget = dataclasses.replace(budget, max_tokens=None)  # fifo: seats and blocks only
        if self.ranks():
            key = functools.partial(self.rank, ctx=ctx)
            return admit_ranked(waiting, budget, ctx, key, chunk_head=chunk_head)
        return fifo_under_budget(waiting, budget, ctx, chunk_head=chunk_head)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Return the phases of the next iteration, in order (one step each).

        Called once per iteration that has both prefill work (waiting requests
        with a free seat, or partial prefills) and decoding requests; otherwise
        the iteration is the one phase that has work. Any non-empty tuple is
        valid: phases with nothing to run are skipped, and if a whole iteration
        runs nothing while requests decode, the scheduler runs a decode step so
        they never idle. Default: prefill-first (admit, then one decode step).
        """
        return PREFILL_FIRST

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Pick the running request to preempt (by recompute) when a step
        cannot get a KV block for a running request.

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

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """Delegate to the wrapped policy."""
        return self.inner.admit(waiting, budget, ctx)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Delegate to the wrapped policy."""
        return self.inner.order(ctx)

    @property
    def fixed_order(self) -> tuple[Phase, ...] | None:  # type: ignore[override]
        """The wrapped policy's."""
        return self.inner.fixed_order

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Delegate to the wrapped policy."""
        return self.inner.select_victim(running, ctx)

    def prepare(self, requests: Sequence[Any]) -> None:
        """Delegate to the wrapped policy."""
        self.inner.prepare(requests)

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """Delegate to the wrapped policy."""
        return self.inner.input_warnings(requests, config)

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Delegate to the wrapped policy."""
        return self.inner.preempt(waiting, ctx)

    def drop(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Delegate to the wrapped policy."""
        return self.inner.drop(waiting, ctx)

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """Delegate to the wrapped policy."""
        return self.inner.quiet_until(waiting, ctx)

    def observe_step(self, report: StepReport) -> None:
        """Delegate to the wrapped policy."""
        self.inner.observe_step(report)


class ComposedPolicy(AdmissionPolicy):
    """The policy a run uses: admission and victim from one plugin class
    (possibly wrapped), loop ordering from another.

    An exception raised inside a plugin's ``admit``, ``order`` or
    ``select_victim`` is re-raised as :class:`PolicyError` naming the policy, its
    plugin and the method, so a plugin bug never reads as a bad flag (the
    original exception is the ``__cause__``).

    Args:
        admission: instance answering ``admit`` and ``select_victim``.
        ordering: instance answering ``order``.
        plugins: the plugins that contributed ``admission`` (its wrappers
            included) and ``ordering``, for error messages.
    """

    def __init__(
        self,
        admission: AdmissionPolicy,
        ordering: AdmissionPolicy,
        plugins: tuple[str, str] = ("", ""),
    ) -> None:
        super().__init__(admission.options)
        self.admission = admission
        self.ordering = ordering
        self.plugins = plugins
        self.label = f"{_label(admission)}+{ordering.name}"
        self.base = _base(admission)

    @property
    def uses_token_budget(self) -> bool:  # type: ignore[override]
        """Whether the chosen admission policy (not its wrappers) honours the budget."""
        return self.base.uses_token_budget

    @property
    def may_preempt(self) -> bool:  # type: ignore[override]
        """Whether the chosen admission policy names running requests to preempt."""
        return self.base.may_preempt

    @property
    def fixed_order(self) -> tuple[Phase, ...] | None:  # type: ignore[override]
        """The loop ordering's declared phases, if it declares them."""
        return self.ordering.fixed_order

    @property
    def may_drop(self) -> bool:  # type: ignore[override]
        """Whether the chosen admission policy drops waiting requests."""
        return self.base.may_drop

    @property
    def observes_steps(self) -> bool:  # type: ignore[override]
        """Whether the chosen admission policy watches every step."""
        return self.base.observes_steps

    def prepare(self, requests: Sequence[Any]) -> None:
        """Delegate to the admission policy."""
        self._admission_call("prepare", self.admission.prepare, requests)

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """Delegate to the admission policy."""
        return self._admission_call(
            "input_warnings", self.admission.input_warnings, requests, config
        )

    def preempt(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Delegate to the admission policy."""
        return self._admission_call("preempt", self.admission.preempt, waiting, ctx)

    def drop(self, waiting: Sequence[Seq], ctx: PolicyContext) -> list[Seq]:
        """Delegate to the admission policy."""
        return self._admission_call("drop", self.admission.drop, waiting, ctx)

    def quiet_until(self, waiting: Sequence[Seq], ctx: PolicyContext) -> float:
        """Delegate to the admission policy."""
        return self._admission_call("quiet_until", self.admission.quiet_until, waiting, ctx)

    def observe_step(self, report: StepReport) -> None:
        """Delegate to the admission policy."""
        self._admission_call("observe_step", self.admission.observe_step, report)

    def admit(self, waiting: Sequence[Seq], budget: Budget, ctx: PolicyContext) -> list[Choice]:
        """Delegate to the admission policy."""
        return self._admission_call("admit", self.admission.admit, waiting, budget, ctx)

    def order(self, ctx: PolicyContext) -> tuple[Phase, ...]:
        """Delegate to the loop ordering."""
        try:
            return self.ordering.order(ctx)
        except PolicyError:
            raise
        except (Exception, SystemExit) as err:  # NOTE: a plugin's exit() is its fault too
            raise self._crash("order", self.ordering.name, self.plugins[1], err) from err

    def select_victim(self, running: Sequence[Seq], ctx: PolicyContext) -> Seq:
        """Delegate to the admission policy."""
        return self._admission_call("select_victim", self.admission.select_victim, running, ctx)

    def _admission_call(self, method: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, with any exception but a PolicyError re-raised as one
        naming the plugin (a third-party bug must not look like a user error)."""
        try:
            return fn(*args)
        except PolicyError:
            raise
        except (Exception, SystemExit) as err:  # NOTE: a plugin's exit() is its fault too
            raise self._crash(method, _label(self.admission), self.plugins[0], err) from err

    @staticmethod
    def _crash(method: str, name: str, plugin: str, err: BaseException) -> PolicyError:
        detail = str(err).strip().splitlines()
        what = f"{type(err).__name__}: {detail[0][:200]}" if detail else type(err).__name__
        source = f" (plugin {plugin})" if plugin else ""
        return PolicyError(
            f"policy {name!r}{source} raised {what} in {method}(); a bug in that plugin, "
            "not in the flags: report it to its authors or pick another policy"
        )


def _label(policy: AdmissionPolicy) -> str:
    """The policy's name, with its length predictor (``sjf[oracle]``) and wrappers
    (``pack+force-fifo``), so a result's ``policy`` records both."""
    if isinstance(policy, PolicyWrapper):
        return f"{_label(policy.inner)}+{policy.name}"
    predictor: Any = getattr(policy, "predictor", None)
    predictor_name = str(getattr(predictor, "name", "") or "") if predictor is not None else ""
    return f"{policy.name}[{predictor_name}]" if predictor_name else policy.name


def _base(policy: AdmissionPolicy) -> AdmissionPolicy:
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy
