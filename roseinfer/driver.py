"""The one drive loop both backends replay a workload with.

``drive`` releases each request at its arrival time, asks the scheduler for a
step, has the backend execute it, applies the result and hands every ended
request to a callback (which turns it into a record). The simulator and the
executor differ only in the :class:`Backend` (a cost model or a model runner)
and the :class:`Clock` (virtual time that jumps, or the wall clock). An
arrival that falls inside a step is seen at the end of that step, as in a
serving engine that checks its queue between forward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from roseinfer.interface import PolicyError
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence as Seq


@dataclass(frozen=True, slots=True)
class StepResult:
    """What executing one scheduler output gave.

    Attributes:
        end_times_s: end time (s, on the run's clock) of each of the output's
            ``num_steps`` steps.
        sampled_token_ids: one token id per sampling item (``out.sampling``), or
            None when the backend only counts tokens (the simulator).
    """

    end_times_s: Sequence[float]
    sampled_token_ids: Sequence[int] | None = None


class Backend(Protocol):
    """Executes scheduler outputs: a cost model (simulator) or a model (executor)."""

    def decode_run_length(
        self, scheduler: Scheduler, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        """How many of the ``max_steps`` (> 1) uneventful decode steps the scheduler
        allows to plan as one output (1..max_steps). A backend that runs one step
        at a time returns 1."""
        ...

    def execute(self, out: SchedulerOutput, now_s: float) -> StepResult:
        """Run ``out`` starting at ``now_s`` (s) and report its end times (and tokens)."""
        ...


class Clock(Protocol):
    """The run's clock in seconds from its start."""

    def now_s(self) -> float:
        """Current time (s)."""
        ...

    def advance_to(self, time_s: float) -> None:
        """Let time pass until ``time_s`` (s); no-op if it has already passed."""
        ...


class VirtualClock:
    """Simulated time: ``advance_to`` jumps there at once."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now_s(self) -> float:
        """Current simulated time (s)."""
        return self._now_s

    def advance_to(self, time_s: float) -> None:
        """Jump forward to ``time_s`` (never backwards)."""
        self._now_s = max(self._now_s, time_s)


def drive(
    scheduler: Scheduler,
    requests: Sequence[Request],
    backend: Backend,
    clock: Clock,
    on_ended: Callable[[list[Seq]], None],
) -> None:
    """Replay ``requests`` (sorted by arrival) to the end of the last one.

    Args:
        scheduler: a fresh scheduler.
        requests: the workload, sorted by ``arrival_time_s``.
        backend: executes each step.
        clock: the run's clock; arrivals are released when it reaches them.
        on_ended: called with the requests that ended (finished, rejected), in
            the order they ended, after each step and after each arrival batch.

    Raises:
        PolicyError: if requests wait, nothing runs and the policy admits
            nothing (the run would never end), or a policy answer is invalid.
    """
    scheduler.policy.prepare(requests)  # e.g. fit a length predictor
    i, num_requests = 0, len(requests)
    while True:
        now = clock.now_s()
        while i < num_requests and requests[i].arrival_time_s <= now:
            scheduler.add_request(requests[i], requests[i].arrival_time_s)
            i += 1
        next_arrival = requests[i].arrival_time_s if i < num_requests else math.inf
        num_steps = scheduler.max_uneventful_decode_steps()
        if num_steps > 1:
            num_steps = backend.decode_run_length(scheduler, now, next_arrival, num_steps)
        out = scheduler.schedule(now, num_steps)
        if out.is_empty:
            _flush(scheduler, on_ended)
            if i >= num_requests:
                if scheduler.has_unfinished():
                    raise PolicyError(scheduler.stall_message())
                return
            clock.advance_to(next_arrival)
            continue
        result = backend.execute(out, now)
        scheduler.update(out, result.end_times_s, result.sampled_token_ids)
        clock.advance_to(result.end_times_s[-1])
        _flush(scheduler, on_ended)


def _flush(scheduler: Scheduler, on_ended: Callable[[list[Seq]], None]) -> None:
    ended = scheduler.pop_ended()
    if ended:
        on_ended(ended)
        scheduler.release_steps()
