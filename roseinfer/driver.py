"""The one step cycle and drive loop both backends replay a workload with.

``step_once`` plans one scheduler output, has the backend execute it, applies
the result and reports the step (to a step log, say); ``drive`` releases each
request at its arrival time and calls ``step_once`` until every request ended,
handing ended requests to a callback (which turns them into records). The
simulator and the executor differ only in the :class:`Backend` (a cost model
or a model runner) and the :class:`Clock` (virtual time that jumps, or the
wall clock).

Arrivals are seen at step boundaries, the same way in both backends: a step
starts where the previous one ended (or, when the engine was idle, at the
arrival that woke it), and a request is released into the scheduler at the
first boundary at or after its arrival. So an arrival that falls inside a step
(or inside the host work that follows its forward) is seen when that step
ends, as in a serving engine that checks its queue between forward passes,
and the host work between two forwards belongs to the step it prepares.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

from roseinfer.interface import PolicyError
from roseinfer.registry import current_warning_sink
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence as Seq

_LOG = logging.getLogger("roseinfer.policy")
_WARNED: set[tuple[int, str]] = set()


def policy_warning(message: str) -> None:
    """Report ``message`` once per process: through the CLI's warning sink when
    one is set (``roseinfer.registry.set_warning_sink``: ``prog: warning: ...``),
    else as ``warning: {message}`` through the ``roseinfer.policy`` logger (so an
    application's logging config applies). A sweep or capacity search that
    replays many runs says it once."""
    sink = current_warning_sink()
    key = (id(sink), message)
    if key in _WARNED:
        return
    _WARNED.add(key)
    if sink is not None:
        sink(message)
    else:
        _LOG.warning("warning: %s", message)


def start_replay(
    scheduler: Scheduler,
    requests: Sequence[Request],
    warn: Callable[[str], None] | None = None,
) -> list[str]:
    """Show the policy the whole workload before a replay: ``prepare`` (e.g. fit
    a length predictor), then report what the policy needs and the workload
    lacks (:meth:`roseinfer.interface.AdmissionPolicy.input_warnings`: lpm
    without prefix caching, edf without deadlines, a defaulted length
    predictor, ...), one line each through ``warn`` (default
    :func:`policy_warning`, once per process).

    Returns:
        The warning lines (empty: nothing missing).

    Raises:
        PolicyError: if the policy raises (names the plugin).
    """
    scheduler.policy.prepare(requests)
    lines = list(scheduler.policy.input_warnings(requests, scheduler.config))
    for line in lines:
        (warn or policy_warning)(line)
    return lines


class StepResult:
    """What executing one scheduler output gave (read-only by convention; the
    compiled core makes the attributes read-only).

    Attributes:
        end_times_s: end time (s, on the run's clock) of each of the output's
            ``num_steps`` steps.
        sampled_token_ids: one token id per sampling item (``out.sampling``), or
            None when the backend only counts tokens (the simulator).
        forward_s: seconds of device work in the (single) step: inputs, forward,
            sampling, synchronize; None when the backend does not split it out.
    """

    __slots__ = ("end_times_s", "sampled_token_ids", "forward_s")

    def __init__(
        self,
        end_times_s: Sequence[float],
        sampled_token_ids: Sequence[int] | None = None,
        forward_s: float | None = None,
    ) -> None:
        self.end_times_s = end_times_s
        self.sampled_token_ids = sampled_token_ids
        self.forward_s = forward_s

    def __repr__(self) -> str:
        return (
            f"StepResult(end_times_s={self.end_times_s!r}, sampled_token_ids="
            f"{self.sampled_token_ids!r}, forward_s={self.forward_s!r})"
        )


StepObserver = Callable[[SchedulerOutput, float, StepResult], None]
"""``observer(out, start_s, result)``: called once per applied scheduler output
with its start time (s) and result, e.g. to write a step log."""


class Backend(Protocol):
    """Executes scheduler outputs: a cost model (simulator) or a model (executor)."""

    def decode_run_length(
        self, out: SchedulerOutput, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        """How many of the ``max_steps`` (> 1) uneventful decode steps the planned
        decode output ``out`` should cover (1..max_steps). A backend that runs one
        step at a time returns 1."""
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


def plan_step(
    scheduler: Scheduler, backend: Backend, now_s: float, next_arrival_s: float = math.inf
) -> tuple[SchedulerOutput, StepResult | None]:
    """Plan one scheduler output at ``now_s`` and execute it (not yet applied).

    A pure decode step that can run uneventfully (:meth:`Scheduler.max_decode_run`)
    is extended to the steps the backend asks for (``decode_run_length``, which
    stops at ``next_arrival_s`` or when the policy asks to be consulted again,
    :meth:`Scheduler.quiet_until`) and the KV pool holds.

    Returns:
        The output and its result; the result is None when the output is empty
        (nothing can run now).

    Raises:
        PolicyError: if a policy answer is invalid.
    """
    out = scheduler.schedule(now_s)
    if out.is_empty:
        return out, None
    max_steps = scheduler.max_decode_run(out)
    if max_steps > 1:
        until_s = min(next_arrival_s, scheduler.quiet_until(now_s))
        if until_s > now_s:
            num_steps = backend.decode_run_length(out, now_s, until_s, max_steps)
            scheduler.extend_decode_run(out, num_steps)
    return out, backend.execute(out, now_s)


def apply_step(
    scheduler: Scheduler,
    out: SchedulerOutput,
    start_s: float,
    result: StepResult,
    on_step: StepObserver | None = None,
) -> None:
    """Apply an executed output's result (tokens, finishes) and report the step."""
    scheduler.update(out, result.end_times_s, result.sampled_token_ids)
    if on_step is not None:
        on_step(out, start_s, result)


def step_once(
    scheduler: Scheduler,
    backend: Backend,
    now_s: float,
    next_arrival_s: float = math.inf,
    on_step: StepObserver | None = None,
) -> tuple[SchedulerOutput, StepResult | None]:
    """The step cycle every loop runs: plan, execute, apply (:func:`plan_step`,
    :func:`apply_step`). A cluster replica plans at the step's start and applies
    at its end, with other replicas' events in between.

    Returns:
        The output and its result (None when nothing can run now).

    Raises:
        PolicyError: if a policy answer is invalid.
    """
    out, result = plan_step(scheduler, backend, now_s, next_arrival_s)
    if result is not None:
        apply_step(scheduler, out, now_s, result, on_step)
    return out, result


def drive(
    scheduler: Scheduler,
    requests: Sequence[Request],
    backend: Backend,
    clock: Clock,
    on_ended: Callable[[list[Seq]], None],
    on_step: StepObserver | None = None,
    warn: Callable[[str], None] | None = None,
) -> None:
    """Replay ``requests`` (sorted by arrival) to the end of the last one.

    Args:
        scheduler: a fresh scheduler.
        requests: the workload, sorted by ``arrival_time_s``.
        backend: executes each step.
        clock: the run's clock, at t=0 when the run starts; the loop waits on it
            for idle gaps.
        on_ended: called with the requests that ended (finished, rejected), in
            the order they ended, after each step and after each arrival batch.
        on_step: called after each applied output (see :data:`StepObserver`).
        warn: where the policy's missing-input warnings go (:func:`start_replay`;
            default :func:`policy_warning`).

    Raises:
        PolicyError: if requests wait, nothing runs and the policy admits
            nothing (the run would never end), or a policy answer is invalid.
    """
    start_replay(scheduler, requests, warn)  # e.g. fit a length predictor; warn once
    i, num_requests = 0, len(requests)
    # The run starts at t=0 on the clock (the executor's clock starts just before):
    # a real run and its simulation then share every step boundary.
    now = 0.0
    while True:
        while i < num_requests and requests[i].arrival_time_s <= now:
            scheduler.add_request(requests[i], requests[i].arrival_time_s)
            i += 1
        next_arrival = requests[i].arrival_time_s if i < num_requests else math.inf
        _out, result = step_once(scheduler, backend, now, next_arrival, on_step)
        _flush(scheduler, on_ended)
        if result is None:
            if i >= num_requests:
                if scheduler.has_unfinished():
                    raise PolicyError(scheduler.stall_message())
                return
            now = next_arrival  # idle until the next arrival
        else:
            now = float(result.end_times_s[-1])
        clock.advance_to(now)


def _flush(scheduler: Scheduler, on_ended: Callable[[list[Seq]], None]) -> None:
    ended = scheduler.pop_ended()
    if ended:
        on_ended(ended)
        scheduler.release_steps()
