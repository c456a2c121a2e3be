"""The executor engine: the shared scheduler driving a real model.

One step is ``schedule -> ModelRunner.forward -> sample -> update``, timed
with the real clock after a device synchronize, so the step log (and hence
every request's token times) holds real seconds. A step may mix prefill chunks
(any start position, prefix hits included) with decodes in one forward; only
the requests that reach their last token sample one. The scheduler, its
``BlockManager`` and the policies are the same objects the simulator uses;
the block ids it hands out are indices into the runner's paged KV tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepObserver, StepResult, drive, step_once
from roseinfer.executor.gc_watch import GcPauses, GcWatch, frozen_heap
from roseinfer.executor.model_runner import ModelRunner, SeqInput
from roseinfer.executor.validation import check_request
from roseinfer.records import RecordBuilder
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import SeqStatus
from roseinfer.sequence import Sequence as Seq


def synchronize(device: torch.device) -> None:
    """Wait for queued device work so a clock read covers it (no-op on CPU)."""
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # e.g. torch.mps, torch.xpu
    if backend is not None and hasattr(backend, "synchronize"):
        backend.synchronize()


@dataclass(slots=True)
class StepTiming:
    """Wall seconds of one step's parts (the overhead benchmark, ``rose-run profile``).

    Attributes:
        host_s: host work from the step's start (the previous step's end, or the
            arrival that woke an idle engine) to this step's input preparation:
            applying the previous result, releasing arrivals, planning this step.
        prepare_s: building the runner inputs.
        forward_s: model forward, sampling and device sync.
        num_seqs: requests in the step; num_tokens: tokens it computed.
        phase: the scheduler phase ("prefill", "decode" or "mixed").
    """

    host_s: float
    prepare_s: float
    forward_s: float
    num_seqs: int
    num_tokens: int
    phase: str


@dataclass(slots=True)
class RunResult:
    """What an executor run produced (same records schema as the simulator)."""

    records: pd.DataFrame
    scheduler: Scheduler
    policy: str
    wall_s: float
    timings: list[StepTiming] = field(default_factory=list)
    gc: GcPauses = field(default_factory=GcPauses)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last step end."""
        ends = self.scheduler.step_log.end_s
        if not len(ends) or not len(self.records):
            return 0.0
        return float(ends[-1]) - float(self.records["arrival_s"].min())


class Engine:
    """Scheduler + model runner, stepped by the caller (online) or the drive loop.

    The engine is both the executor's :class:`~roseinfer.driver.Backend` (it runs
    a scheduler output on the model) and its :class:`~roseinfer.driver.Clock`
    (the wall clock since the run started, synchronized with the device before
    every read that ends a step).

    Args:
        runner: owns the model and the paged KV cache; its block count must equal
            ``config.num_kv_blocks`` and its block size ``config.block_size``.
        config: scheduler config.
        registry: plugin registry (default: built-ins plus entry points).
        seed: seeds the engine-wide sampling generator.
        record_timings: keep a :class:`StepTiming` per step.
        clock: seconds since an arbitrary origin (``time.perf_counter``).
        on_step: called after every applied step with its output, start time
            and result (e.g. a step-log writer; ``roseinfer.executor.steplog``).

    With KV tiers (``config.kv_tiers``: one host tier, of the runner's
    ``num_tier_blocks``), each step first makes the block copies its output
    carries (``out.kv_transfers``: offloads and loads, in the order the block
    manager decided them), so cached blocks that left the device come back
    bit for bit.

    Raises:
        ValueError: if the runner's KV pool does not match the config, the config
            has KV tiers other than one host tier of the runner's size, or
            ``config.max_model_len`` exceeds the model's context.
    """

    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig,
        registry: Registry | None = None,
        *,
        seed: int = 0,
        record_timings: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        on_step: StepObserver | None = None,
    ) -> None:
        if runner.num_kv_blocks != config.num_kv_blocks or runner.block_size != config.block_size:
            raise ValueError(
                f"runner KV pool ({runner.num_kv_blocks} x {runner.block_size}) differs from "
                f"the scheduler config ({config.num_kv_blocks} x {config.block_size})"
            )
        max_context = runner.shape.max_context_tokens
        if max_context is not None and config.max_model_len > max_context:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the {max_context} tokens the "
                "model can attend over; lower max_model_len"
            )
        tiers = config.kv_tiers
        if tiers is not None and (
            len(tiers.tiers) != 1 or runner.num_tier_blocks != tiers.tiers[0].num_blocks
        ):
            raise ValueError(
                f"the executor holds one host KV tier ({runner.num_tier_blocks} blocks); the "
                f"config asks for {tiers.describe()}: give one tier of that size"
            )
        registry = registry if registry is not None else load_registry()
        self.runner = runner
        self.policy = registry.make(config.policy, config.loop_order, config.options)
        self.scheduler = Scheduler(config, self.policy, self.policy.label)
        self.scheduler.block_manager.record_transfer_ops = tiers is not None
        self.records = RecordBuilder(keep_token_ids=True)
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self.failed: dict[str, Exception] = {}  # sampling failures not yet popped
        self.record_timings = record_timings
        self.timings: list[StepTiming] = []
        self._clock = clock
        self.t0 = clock()
        self.on_step = on_step

    # --------------------------------------------------------------- clock
    def now(self) -> float:
        """Seconds since the engine (or its run) started."""
        return self.now_s()

    def now_s(self) -> float:
        """Seconds since the engine (or its run) started (the Clock protocol)."""
        return self._clock() - self.t0

    def advance_to(self, time_s: float) -> None:
        """Sleep until ``time_s`` (s on the engine clock), e.g. the next arrival."""
        wait_s = time_s - self.now_s()
        if wait_s > 0:
            time.sleep(wait_s)

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> Seq:
        """Submit a request at the current time (may be rejected at once).

        Raises:
            ValueError: see :meth:`check_request`, or a duplicate request id.
        """
        self.check_request(request)
        return self.scheduler.add_request(request, self.now())

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request now (frees its KV blocks).

        Returns:
            False if the request is unknown or already ended.
        """
        seq = self.scheduler.get(request_id)
        if seq is None or not self.scheduler.abort(request_id, self.now()):
            return False
        self._seq_generators.pop(seq.seq_id, None)
        self.flush_records()
        return True

    def check_request(self, request: Request) -> None:
        """Check that the model can run ``request`` before it is scheduled.

        A bad request found inside a step would leave the scheduler holding
        half-admitted state; here it is refused with a clear message.

        Raises:
            ValueError: if it has no prompt token ids (a length-only trace needs
                ``roseinfer.workloads.fit.with_token_ids``) and fits ``max_model_len``
                (a longer one needs none: the scheduler rejects it), or carries transferred
                KV (``num_transferred_tokens``; disaggregation is simulated only).
            InvalidRequestError: (a ValueError) naming the bad field: a non-string
                id, a non-integer or < 1 output length, a token id that is not an
                integer in the vocabulary, or sampling parameters sampling cannot
                take (see :func:`roseinfer.executor.validation.check_sampling`).
        """
        if request.prompt_token_ids is None:
            if request.max_num_tokens > self.scheduler.config.max_model_len:
                return  # the scheduler rejects it on arrival; no model input is read
            raise ValueError(
                f"request {request.request_id!r} has no prompt token ids; the executor "
                "needs them (roseinfer.workloads.fit.with_token_ids makes them up for a trace)"
            )
        if request.num_transferred_tokens:
            raise ValueError(
                f"request {request.request_id!r} carries {request.num_transferred_tokens} "
                "tokens of transferred KV; the executor serves whole requests (prefill/"
                "decode disaggregation is simulated: rose-sim --num-prefill-replicas)"
            )
        check_request(request, self.runner.vocab_size)

    # ------------------------------------------------------------- stepping
    def decode_run_length(
        self, out: SchedulerOutput, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        """The executor runs one forward per output (the Backend protocol)."""
        return 1

    def execute(self, out: SchedulerOutput, now_s: float) -> StepResult:
        """Run one scheduler output on the model: inputs, forward, sampling.

        Args:
            out: the planned step.
            now_s: the step's start (s): where planning began.

        Returns:
            The step's end time (after a device synchronize), one sampled token
            per item of ``out.sampling``, and the seconds from input preparation
            to the end (``forward_s``). A request whose sampling raises is ended
            (aborted, reason "sampling failed: ...") and removed from ``out``
            first; the others go on (:meth:`pop_failed` names it).
        """
        t_prep = self.now_s()
        if out.kv_transfers is not None:  # offloads and loads, in order, before the forward
            self.runner.apply_kv_transfers(out.kv_transfers.ops)
        inputs = self._inputs(out)
        t_fwd = self.now_s()
        token_ids = self._forward_and_sample(out, inputs)
        synchronize(self.runner.device)
        t_end = self.now_s()
        if self.record_timings:
            self.timings.append(
                StepTiming(
                    host_s=max(0.0, t_prep - now_s),
                    prepare_s=t_fwd - t_prep,
                    forward_s=t_end - t_fwd,
                    num_seqs=len(inputs),
                    num_tokens=out.num_batched_tokens,
                    phase=out.phase.value if out.phase is not None else "",
                )
            )
        return StepResult([t_end], token_ids, forward_s=t_end - t_prep)

    def step(
        self, before_records: Callable[[SchedulerOutput], None] | None = None
    ) -> tuple[SchedulerOutput, list[Seq]]:
        """Plan and run one step now (online use). Returns the output and the
        requests that ended in it; ended requests go to :attr:`records`.

        An empty output means nothing could run now (no work, or waiting for
        an arrival).

        Args:
            before_records: called with the applied output before the ended
                requests are recorded (a front end that ends requests on stop
                strings, :class:`~roseinfer.executor.streaming.StreamingEngine`).
        """
        out, result = step_once(self.scheduler, self, self.now_s(), on_step=self.on_step)
        if before_records is not None:
            before_records(out)
        ended = self.flush_records()
        if result is None:
            return out, []
        return out, [s for s in ended if s.status is SeqStatus.FINISHED]

    def flush_records(self) -> list[Seq]:
        """Move requests that ended (finished, rejected, aborted) into :attr:`records`
        and return them."""
        ended = self.scheduler.pop_ended()
        self.records.extend(ended, self.scheduler.step_log)
        for seq in ended:
            self._seq_generators.pop(seq.seq_id, None)
        return ended

    def _inputs(self, out: SchedulerOutput) -> list[SeqInput]:
        bm = self.scheduler.block_manager
        return [
            SeqInput(
                item.seq.token_ids(item.num_computed_tokens, item.num_context_tokens),
                item.num_computed_tokens,
                bm.block_ids(item.seq),  # read before the scheduler allocates again
            )
            for item in out.scheduled
        ]

    def _forward_and_sample(self, out: SchedulerOutput, inputs: Sequence[SeqInput]) -> list[int]:
        logits = self.runner.forward(inputs)
        rows = [i for i, item in enumerate(out.scheduled) if item.samples]
        if not rows:
            return []
        if len(rows) < len(inputs):
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens = self._sample(logits, [out.scheduled[i].seq for i in rows])
        if None in tokens:
            self._drop_failed(out)
        return [t for t in tokens if t is not None]

    def _sample(self, logits: torch.Tensor, seqs: list[Seq]) -> list[int | None]:
        """One token per row of ``logits`` ``[len(seqs), vocab]``.

        If sampling the batch raises, each row is sampled alone: a row that
        still raises gets None and its request is noted in :attr:`failed` (the
        others go on; their unseeded draws then differ from a batch draw).
        """
        try:
            params = [s.request.sampling for s in seqs]
            return list(self.runner.sample(logits, params, [self._generator(s) for s in seqs]))
        except Exception:  # noqa: BLE001 - isolated row by row below
            pass
        tokens: list[int | None] = []
        for i, seq in enumerate(seqs):
            try:
                row = logits[i : i + 1]
                tokens.append(
                    self.runner.sample(row, [seq.request.sampling], [self._generator(seq)])[0]
                )
            except Exception as err:  # noqa: BLE001 - ends this request only
                tokens.append(None)
                self.failed[seq.request_id] = err
        return tokens

    def _drop_failed(self, out: SchedulerOutput) -> None:
        """End the requests whose sampling failed (blocks freed, status rejected,
        reason "sampling failed: ...") and take them out of ``out`` before the
        scheduler applies it."""
        failed = [item for item in out.scheduled if item.seq.request_id in self.failed]
        for item in failed:
            seq = item.seq
            out.remove(seq)
            self.scheduler.abort(seq.request_id, self.now_s())
            seq.reject_reason = f"sampling failed: {self.failed[seq.request_id]!r}"
            self._seq_generators.pop(seq.seq_id, None)

    def pop_failed(self) -> dict[str, Exception]:
        """Requests whose sampling failed since the last call (id -> the error);
        they ended already (see :meth:`execute`)."""
        failed, self.failed = self.failed, {}
        return failed

    def _generator(self, seq: Seq) -> torch.Generator:
        seed = seq.request.sampling.seed
        if seed is None:
            return self.generator
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
            self._seq_generators[seq.seq_id] = gen
        return gen

    # ------------------------------------------------------------- offline
    def run(
        self,
        requests: Sequence[Request],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> RunResult:
        """Replay ``requests`` open-loop with the shared drive loop: each is
        released at its arrival time on the real clock (the engine's t=0 is the
        start of the run) and seen at the first step boundary after it.

        The heap that exists before the run is frozen for its duration
        (:func:`~roseinfer.executor.gc_watch.frozen_heap`), so a full collection
        does not walk the model and libraries in the middle of a step, and the
        collections the run still makes are counted in ``RunResult.gc``.

        Args:
            progress: called with the number of requests that ended in each step.

        Raises:
            ValueError: if a request cannot run on this model (:meth:`check_request`);
                checked for all requests before the first step.
            RuntimeError: if this engine already has requests (one run per engine).
            PolicyError: if the policy stalls the run or answers invalidly.
        """
        if self.scheduler.num_submitted:
            raise RuntimeError("Engine.run replays a whole workload once; make a new Engine")
        reqs = sorted(requests, key=lambda r: r.arrival_time_s)
        for request in reqs:
            self.check_request(request)
        with frozen_heap(), GcWatch() as watch:
            start = time.perf_counter()
            self.t0 = self._clock()
            self._drive(reqs, progress)
        return RunResult(
            records=self.records.frame(),
            scheduler=self.scheduler,
            policy=self.policy.label,
            wall_s=time.perf_counter() - start,
            timings=self.timings,
            gc=watch.pauses(),
        )

    def _drive(self, reqs: list[Request], progress: Callable[[int], None] | None) -> None:
        """The drive loop over ``reqs`` (sorted by arrival), recording ended requests."""

        def ended(seqs: list[Seq]) -> None:
            self.records.extend(seqs, self.scheduler.step_log)
            for seq in seqs:
                self._seq_generators.pop(seq.seq_id, None)
            if progress is not None:
                progress(len(seqs))

        drive(self.scheduler, reqs, self, self, ended, self.on_step)
        self.scheduler.check_invariants()
