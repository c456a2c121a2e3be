"""Discrete-event simulation: the shared scheduler with a cost-model clock.

Events are arrivals and step completions. Each step's duration comes from the
:class:`~roseinfer.calibration.cost_model.CostModel`; the clock jumps to its end.
Runs of pure decode steps where nothing can change (no admission possible, no
request finishing, no arrival) are planned as one multi-step output and timed
with the vectorized ``decode_run_times_s``, which is what keeps a whole
production trace in a few seconds. ``jump=False`` plans every step alone; both
give the same records (tested).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from roseinfer._core import core_info
from roseinfer.calibration.cost_model import BatchShape, CostModel, RooflineCostModel
from roseinfer.calibration.graph_replay import DECODE_GRAPHS
from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepObserver, StepResult, VirtualClock, drive
from roseinfer.metrics.histogram import LogHistogram
from roseinfer.records import RecordBuilder, frame_of
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence

if TYPE_CHECKING:
    import pandas as pd  # NOTE: pandas costs 0.2 s to import; the records build it lazily


@dataclass(slots=True)
class SimResult:
    """What a simulated run produced.

    Attributes:
        columns: one row per request (``roseinfer.metrics.schema``) as columns
            by name (``RecordBuilder.drain_columns``): what ``summarize`` reads
            without pandas; :attr:`records` is the same as a DataFrame.
        scheduler: the scheduler after the run (step log, block manager, stats).
        policy: the composed policy label, e.g. ``pack+force-fifo+decode-first``.
        wall_s: wall-clock seconds the simulation took.
        num_steps: engine steps simulated.
        info: extra facts for the result file (cost model, workload notes).
        itl: the inter-token gaps as a histogram when the run kept no token
            times (``records.token_times_s`` is then None): pass it to
            ``summarize(records, itl=result.itl)``.
    """

    columns: dict[str, Any]
    scheduler: Scheduler
    policy: str
    wall_s: float
    num_steps: int
    info: dict[str, object] = field(default_factory=dict)
    itl: LogHistogram | None = None
    _frame: Any = field(default=None, repr=False)

    @property
    def records(self) -> pd.DataFrame:
        """The records as a DataFrame (built on first use; pandas is imported then)."""
        if self._frame is None:
            self._frame = frame_of(self.columns)
        return self._frame

    @property
    def duration_s(self) -> float:
        """Simulated seconds from the first arrival to the last step end."""
        ends = self.scheduler.step_log.end_s
        if not len(ends):
            return 0.0
        arrivals = self.columns["arrival_s"]
        first = float(arrivals.min()) if len(arrivals) else 0.0
        return float(ends[-1]) - first


def batch_shape(out: SchedulerOutput) -> BatchShape:
    """The cost model's view of a one-step output: the totals the scheduler counted
    while planning, and (when a cost model asks) per-sequence arrays of the prefill
    chunks (new tokens, context after the step) and decodes (context including
    the decoded token)."""

    def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        items = out.scheduled
        new = [i.num_new_tokens for i in items if not i.is_decode]
        context = [i.num_context_tokens for i in items if not i.is_decode]
        decode = [i.num_context_tokens for i in items if i.is_decode]
        return tuple(np.array(v, dtype=np.int64) for v in (new, context, decode))  # type: ignore[return-value]

    return BatchShape.lazy(out.totals(), arrays)


COMPILED = not __file__.endswith(".py")  # built by setup.py: price roofline steps in C
_INF = math.inf  # NOTE: a C constant in the compiled core (no module lookup per step)


class _Roofline:
    """A roofline cost model's step time as a typed function of a step's totals:
    ``RooflineCostModel._time_s``'s expression in its order, on its
    :meth:`~roseinfer.calibration.cost_model.RooflineCostModel.pricing_terms`
    (the compiled core's pricing; equal bit for bit, tested)."""

    __slots__ = (
        "flops_per_token", "flops_per_seq", "flops_per_attn_pair", "achievable_flops",
        "weight_bytes", "kv_bytes_per_token", "achievable_bandwidth", "overhead_s", "comm_s",
        "comm_s_per_token", "overhead_per_seq_s", "eager_launch_s", "imbalance_s_per_token",
        "imbalance_spread_seqs", "graph_max_seqs", "graph_max_tokens",
    )  # fmt: skip

    def __init__(self, terms: tuple[float, ...]) -> None:
        (
            self.flops_per_token, self.flops_per_seq, self.flops_per_attn_pair,
            self.achievable_flops, self.weight_bytes, self.kv_bytes_per_token,
            self.achievable_bandwidth, self.overhead_s, self.comm_s, self.comm_s_per_token,
            self.overhead_per_seq_s, self.eager_launch_s, self.imbalance_s_per_token,
            self.imbalance_spread_seqs, self.graph_max_seqs, self.graph_max_tokens,
        ) = terms  # fmt: skip

    def excess_tokens(self, out: SchedulerOutput) -> float:
        """Decodes x longest decode context - summed decode context of ``out``
        (0.0 when the spec has no imbalance term: nothing to price)."""
        if not self.imbalance_s_per_token:
            return 0.0
        return float(len(out.decodes) * out.decode_max_context - out.decode_context_tokens)

    def step_s(
        self,
        num_tokens: float,
        num_seqs: float,
        attn_pairs: float,
        kv_read_tokens: float,
        num_decodes: float,
        excess_tokens: float,
    ) -> float:
        """Seconds of one step with these totals (tokens, sequences, attention
        pairs, KV tokens read, decodes, and :meth:`excess_tokens`)."""
        compute_s = (
            self.flops_per_token * num_tokens
            + self.flops_per_seq * num_seqs
            + self.flops_per_attn_pair * attn_pairs
        ) / self.achievable_flops
        memory_s = (
            self.weight_bytes + self.kv_bytes_per_token * (kv_read_tokens + num_tokens)
        ) / self.achievable_bandwidth
        launch_s = 0.0  # GraphReplay.runs_eagerly, inlined in C
        if num_tokens > num_seqs:
            if num_tokens > self.graph_max_tokens:
                launch_s = self.eager_launch_s
        elif num_seqs > self.graph_max_seqs:
            launch_s = self.eager_launch_s
        imbalance_s = 0.0  # RooflineCostModel.imbalance_s, inlined
        if excess_tokens > 0 and self.imbalance_s_per_token:
            spread = (
                num_decodes
                if num_decodes > self.imbalance_spread_seqs
                else self.imbalance_spread_seqs
            )
            imbalance_s = self.imbalance_s_per_token * excess_tokens / spread
        memory_s = memory_s + imbalance_s
        comm_s = self.comm_s + self.comm_s_per_token * num_tokens
        host_s = self.overhead_s + self.overhead_per_seq_s * num_seqs
        roof_s = memory_s if memory_s > compute_s else compute_s
        return (launch_s if launch_s > roof_s else roof_s) + host_s + comm_s


def _step_ends(now_s: float, times_s: np.ndarray) -> np.ndarray:
    """End times of consecutive steps starting at ``now_s``, summed left to right
    as stepping one at a time sums them (bit-identical: ``np.add.accumulate`` is
    sequential, unlike ``now + cumsum(times)``)."""
    return np.add.accumulate(np.concatenate(([now_s], times_s)))[1:]


class CostModelBackend:
    """Prices each step with a cost model; plans uneventful decode runs as one
    output that ends before the next arrival is due.

    Args:
        cost_model: maps a step's batch shape to seconds.
        jump: plan multi-step decode runs (False: one step per output).
        stream: which run of a simulation this is (a cluster's replica index):
            picks the random numbers of a cost model's step jitter.

    Attributes:
        extrapolation: counts the executed steps priced outside the shapes a fitted
            cost model saw (when it has a ``sample_range``), else None.
        jitter: the cost model's measured step-time spread
            (:class:`~roseinfer.calibration.jitter.StepJitter`), which multiplies
            each executed step's time by its own factor; None: medians. Its
            ``graphs`` say which steps are eager (their largest graph-replayed
            decode batch and pass are kept as ``_graph_seqs``, ``_graph_tokens``).
        step_index: steps executed so far (the next step's jitter index).
    """

    def __init__(self, cost_model: CostModel, *, jump: bool = True, stream: int = 0) -> None:
        self.cost_model = cost_model
        self.jump = jump
        self.jitter = getattr(cost_model, "jitter", None)
        graphs = DECODE_GRAPHS if self.jitter is None else self.jitter.graphs
        self._graph_seqs = float(graphs.max_decode_seqs)
        self._graph_tokens = float(graphs.max_mixed_tokens)
        self.stream = stream
        self.step_index = 0
        self._run_times_s = np.empty(0)
        self._run_ends_s: list[float] = []  # the priced run's end times (compiled pricing)
        # NOTE: the interpreted core prices through the cost model (numpy for long
        # runs); the compiled one prices a roofline step by step in C
        self._roofline = (
            _Roofline(cost_model.pricing_terms())
            if COMPILED and type(cost_model) is RooflineCostModel
            else None
        )
        sample_range = getattr(cost_model, "sample_range", None)
        self.extrapolation = None if sample_range is None else sample_range.counter()

    def decode_run_length(
        self, out: SchedulerOutput, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        """Decode steps of ``out`` that end before ``next_arrival_s`` is seen (an
        arrival is noticed at the end of the step it falls in), at most ``max_steps``."""
        if not self.jump:
            return 1
        if self._roofline is not None:
            return self._roofline_run(out, now_s, next_arrival_s, max_steps)
        num_steps = max_steps
        if not math.isinf(next_arrival_s):
            # NOTE: price only the steps that can end before the next arrival: with
            # steps no shorter than the first, that is the gap over the first step's
            # time. A run cut shorter (a model whose steps get faster) is still a
            # valid run; the next output goes on from there.
            first_s = self.cost_model.step_time_s(batch_shape(out))
            if first_s > 0:
                num_steps = min(max_steps, int((next_arrival_s - now_s) / first_s) + 2)
        times = self.cost_model.decode_run_times_s(np.array(out.decode_contexts), num_steps)
        if self.jitter is not None:
            num_seqs = len(out.decodes)
            eager_run = num_seqs > self._graph_seqs
            if eager_run or not self.jitter.eager_only:
                eager = np.full(num_steps, eager_run)
                times = times * self.jitter.factors(self.step_index, eager, times, self.stream)
        self._run_times_s = times
        if math.isinf(next_arrival_s):
            return num_steps
        ends = _step_ends(now_s, times)
        return min(num_steps, int(np.searchsorted(ends, next_arrival_s, side="left")) + 1)

    def _roofline_run(
        self, out: SchedulerOutput, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        """:meth:`decode_run_length` with the roofline priced step by step: the same
        step count and end times, kept for :meth:`execute`."""
        roofline = self._roofline
        assert roofline is not None
        num_seqs, context = float(len(out.decodes)), float(out.decode_context_tokens)
        excess = roofline.excess_tokens(out)  # the same every step: all contexts grow by one
        num_steps = max_steps
        if next_arrival_s != _INF:
            first_s = roofline.step_s(num_seqs, num_seqs, context, context, num_seqs, excess)
            if first_s > 0 and (next_arrival_s - now_s) / first_s < max_steps:
                num_steps = min(max_steps, int((next_arrival_s - now_s) / first_s) + 2)
        ends: list[float] = []
        self._run_ends_s = ends
        end_s = now_s
        jitter = self.jitter  # a measured roofline's: eager steps only (decodes past the graphs)
        eager_run = num_seqs > self._graph_seqs
        if jitter is not None and not eager_run and jitter.eager_only:
            jitter = None
        first_step = self.step_index
        for j in range(num_steps):
            step_context = context + num_seqs * j  # every context grows by one per step
            step_s = roofline.step_s(
                num_seqs, num_seqs, step_context, step_context, num_seqs, excess
            )
            if jitter is not None:
                step_s = step_s * jitter.factor(first_step + j, eager_run, step_s, self.stream)
            end_s += step_s
            ends.append(end_s)
            if end_s >= next_arrival_s:
                return j + 1
        return num_steps

    def execute(self, out: SchedulerOutput, now_s: float) -> StepResult:
        """End times of the output's steps, from the cost model. A step that loads
        KV blocks from a tier (``out.kv_transfers``) also pays their transfer time:
        added to its compute, or overlapped (``max``); offloads cost no time (they
        are asynchronous; see :mod:`roseinfer.kv_tiers`). Loads come only with
        admissions, never with a multi-step decode run."""
        if self.extrapolation is not None:
            self.extrapolation.observe(out.totals(), out.num_steps)
        first_step = self.step_index
        self.step_index += out.num_steps
        if out.num_steps > 1:
            if self._roofline is not None:
                return StepResult(self._run_ends_s[: out.num_steps])
            return StepResult(_step_ends(now_s, self._run_times_s[: out.num_steps]).tolist())
        if self._roofline is not None:
            num_decodes = len(out.decodes)
            step_s = self._roofline.step_s(
                float(out.num_prefill_tokens + num_decodes),
                float(len(out.prefills) + num_decodes),
                float(out.prefill_attn_pairs + out.decode_context_tokens),
                float(out.prefill_context_tokens + out.decode_context_tokens),
                float(num_decodes),
                self._roofline.excess_tokens(out),
            )
        else:
            step_s = self.cost_model.step_time_s(batch_shape(out))
        if self.jitter is not None:
            num_seqs = len(out.prefills) + len(out.decodes)
            num_tokens = out.num_prefill_tokens + len(out.decodes)
            if num_tokens > num_seqs:  # GraphReplay.runs_eagerly, inlined
                eager = num_tokens > self._graph_tokens
            else:
                eager = num_seqs > self._graph_seqs
            if eager or not self.jitter.eager_only:
                step_s = step_s * self.jitter.factor(first_step, eager, step_s, self.stream)
        transfers = out.kv_transfers
        if transfers is not None:
            step_s = transfers.step_time_s(step_s)
        return StepResult([now_s + step_s])


class Simulator:
    """Replays requests through the shared scheduler with a cost-model clock.

    Args:
        config: scheduler limits and policy names.
        cost_model: maps a step's batch shape to seconds.
        registry: plugin registry (default: built-ins plus entry points).
        jump: plan uneventful decode runs as one multi-step output.
        keep_token_times: keep every token's time in the records (8 bytes a
            token); False keeps an ITL histogram instead (a run of millions of
            requests then fits in a few hundred MB).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        registry: Registry | None = None,
        *,
        jump: bool = True,
        keep_token_times: bool = True,
    ) -> None:
        self.config = config
        self.keep_token_times = keep_token_times
        self.cost_model = cost_model
        registry = registry if registry is not None else load_registry()
        self.policy = registry.make(config.policy, config.loop_order, config.options)
        self.jump = jump

    def run(
        self,
        requests: SequenceABC[Request],
        on_ended: Callable[[list[Sequence]], None] | None = None,
        on_step: StepObserver | None = None,
    ) -> SimResult:
        """Simulate ``requests`` (any order; sorted by arrival) to completion.

        Args:
            on_ended: also called with each batch of requests that ended (e.g. a
                progress bar).
            on_step: called after each applied output (e.g. a step-log writer).

        Raises:
            PolicyError: if a policy answer is invalid or the run stalls.
        """
        start = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_time_s)
        sched = Scheduler(self.config, self.policy, self.policy.label)
        records = RecordBuilder(keep_token_times=self.keep_token_times)

        def ended(seqs: list[Sequence]) -> None:
            records.extend(seqs, sched.step_log)
            if on_ended is not None:
                on_ended(seqs)

        backend = CostModelBackend(self.cost_model, jump=self.jump)
        drive(sched, reqs, backend, VirtualClock(), ended, on_step)
        sched.check_invariants()
        return SimResult(
            columns=records.drain_columns(),  # NOTE: the rows go as the columns are made
            scheduler=sched,
            policy=self.policy.label,
            wall_s=time.perf_counter() - start,
            num_steps=sched.step_log.num_steps,
            info={
                "cost_model": self.cost_model.describe(),
                "sim_core": core_info(),
                **_extrapolation(backend),
            },
            itl=records.itl,
        )


def _extrapolation(backend: CostModelBackend) -> dict[str, object]:
    """The run's steps outside the cost model's fitted range, as result keys
    (:class:`~roseinfer.calibration.step_model.ExtrapolationCounter`); {} without one."""
    return {} if backend.extrapolation is None else backend.extrapolation.facts()


def simulate(
    requests: SequenceABC[Request],
    config: SchedulerConfig,
    cost_model: CostModel,
    *,
    registry: Registry | None = None,
    jump: bool = True,
    keep_token_times: bool = True,
    on_ended: Callable[[list[Sequence]], None] | None = None,
    on_step: StepObserver | None = None,
) -> SimResult:
    """Run one simulation; see :class:`Simulator` (``on_ended``, ``on_step``: see its ``run``)."""
    sim = Simulator(config, cost_model, registry, jump=jump, keep_token_times=keep_token_times)
    return sim.run(requests, on_ended, on_step)
