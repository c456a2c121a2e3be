"""Discrete-event simulation: the shared scheduler with a cost-model clock.

Events are arrivals and step completions. Each step's duration comes from the
:class:`~roseinfer.simulator.cost_model.CostModel`; the clock jumps to its end.
Runs of pure decode steps where nothing can change (no admission possible, no
request finishing, no arrival) are planned as one multi-step output and timed
with the vectorized ``decode_run_times_s``, which is what keeps a whole
production trace in a few seconds. ``jump=False`` plans every step alone; both
give the same records (tested).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from roseinfer.config import SchedulerConfig
from roseinfer.interface import Phase, PolicyError
from roseinfer.records import records_frame
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence
from roseinfer.simulator.cost_model import BatchShape, CostModel

_NO_LIMIT = 1 << 30


@dataclass(slots=True)
class SimResult:
    """What a simulated run produced.

    Attributes:
        records: one row per request (``roseinfer.metrics.schema``).
        scheduler: the scheduler after the run (step log, block manager, stats).
        policy: the composed policy label, e.g. ``pack+force-fifo+decode-first``.
        wall_s: wall-clock seconds the simulation took.
        num_steps: engine steps simulated.
        info: extra facts for the result file (cost model, workload notes).
    """

    records: pd.DataFrame
    scheduler: Scheduler
    policy: str
    wall_s: float
    num_steps: int
    info: dict[str, object] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Simulated seconds from the first arrival to the last step end."""
        ends = self.scheduler.step_end_s
        if not ends:
            return 0.0
        first = float(self.records["arrival_s"].min()) if len(self.records) else 0.0
        return ends[-1] - first


def batch_shape(out: SchedulerOutput) -> BatchShape:
    """The cost model's view of a one-step output."""
    empty = np.zeros(0, dtype=np.int64)
    if out.phase is Phase.PREFILL:
        new = np.fromiter((p.num_new_tokens for p in out.prefills), np.int64, len(out.prefills))
        cached = np.fromiter(
            (p.num_cached_tokens for p in out.prefills), np.int64, len(out.prefills)
        )
        return BatchShape(new, cached + new, empty)
    ctx = np.fromiter((s.num_tokens for s in out.decodes), np.int64, len(out.decodes))
    return BatchShape(empty, empty, ctx)


class Simulator:
    """Replays requests through the shared scheduler with a cost-model clock.

    Args:
        config: scheduler limits and policy names.
        cost_model: maps a step's batch shape to seconds.
        registry: plugin registry (default: built-ins plus entry points).
        jump: plan uneventful decode runs as one multi-step output.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        cost_model: CostModel,
        registry: Registry | None = None,
        *,
        jump: bool = True,
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        registry = registry if registry is not None else load_registry()
        self.policy = registry.make(config.policy, config.loop_order, config.options)
        self.jump = jump

    def run(self, requests: SequenceABC[Request]) -> SimResult:
        """Simulate ``requests`` (any order; sorted by arrival) to completion.

        Raises:
            PolicyError: if a policy answer is invalid or the run stalls.
        """
        start = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_time_s)
        sched = Scheduler(self.config, self.policy, self.policy.label)
        now, i = 0.0, 0
        run_times: list[np.ndarray] = []
        while True:
            while i < len(reqs) and reqs[i].arrival_time_s <= now:
                sched.add_request(reqs[i], reqs[i].arrival_time_s)
                i += 1
            next_arrival = reqs[i].arrival_time_s if i < len(reqs) else math.inf
            limit = self._jump_limit(now, next_arrival, run_times) if self.jump else 1
            out = sched.schedule(now, limit)
            if out.is_empty:
                if sched.has_unfinished() and i >= len(reqs):
                    raise PolicyError(_stall_message(sched))
                if i >= len(reqs):
                    break
                now = max(now, next_arrival)
                continue
            ends = self._step_ends(now, out, run_times)
            sched.update(out, ends)
            now = ends[-1]
        sched.check_invariants()
        return SimResult(
            records=records_frame(sched),
            scheduler=sched,
            policy=self.policy.label,
            wall_s=time.perf_counter() - start,
            num_steps=len(sched.step_end_s),
            info={"cost_model": self.cost_model.describe()},
        )

    def _jump_limit(self, now: float, next_arrival: float, run_times: list[np.ndarray]):  # type: ignore[no-untyped-def]
        """A callback giving the decode steps that end before the next arrival is
        seen: the arrival is noticed at the end of the step it falls in."""

        def limit(running: list[Sequence]) -> int:
            max_steps = min(s.remaining_output_tokens for s in running)
            if max_steps <= 1:
                return 1
            ctx = np.fromiter((s.num_tokens for s in running), np.int64, len(running))
            durations = self.cost_model.decode_run_times_s(ctx, max_steps)
            run_times[:] = [durations]
            if math.isinf(next_arrival):
                return max_steps
            ends = now + np.cumsum(durations)
            return min(max_steps, int(np.searchsorted(ends, next_arrival, side="left")) + 1)

        return limit

    def _step_ends(
        self, now: float, out: SchedulerOutput, run_times: list[np.ndarray]
    ) -> list[float]:
        if out.num_steps > 1:
            durations = run_times[0][: out.num_steps]
            return (now + np.cumsum(durations)).tolist()
        return [now + self.cost_model.step_time_s(batch_shape(out))]


def _stall_message(sched: Scheduler) -> str:
    return (
        f"policy {sched.policy_name!r} admitted nothing with {len(sched.waiting)} requests "
        "waiting and nothing running; the run would never finish"
    )


def simulate(
    requests: SequenceABC[Request],
    config: SchedulerConfig,
    cost_model: CostModel,
    *,
    registry: Registry | None = None,
    jump: bool = True,
) -> SimResult:
    """Run one simulation; see :class:`Simulator`."""
    return Simulator(config, cost_model, registry, jump=jump).run(requests)
