"""The executor engine: the shared scheduler driving a real model.

One step is ``schedule -> ModelRunner.forward -> sample -> update``, timed
with the real clock after a device synchronize, so the step log (and hence
every request's token times) holds real seconds. The scheduler, its
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
from roseinfer.executor.model_runner import ModelRunner, SeqInput
from roseinfer.interface import Phase, PolicyError
from roseinfer.records import records_frame
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
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
    """Wall seconds of the phases of one step (for the overhead benchmark).

    Attributes:
        schedule_s: scheduler planning.
        prepare_s: building the runner inputs.
        forward_s: model forward incl. sampling and device sync.
        update_s: scheduler bookkeeping after the step.
        num_seqs: sequences in the step; phase: "prefill" or "decode".
    """

    schedule_s: float
    prepare_s: float
    forward_s: float
    update_s: float
    num_seqs: int
    phase: str


@dataclass(slots=True)
class RunResult:
    """What an executor run produced (same records schema as the simulator)."""

    records: pd.DataFrame
    scheduler: Scheduler
    policy: str
    wall_s: float
    timings: list[StepTiming] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Seconds from the first arrival to the last step end."""
        ends = self.scheduler.step_end_s
        if not ends or not len(self.records):
            return 0.0
        return ends[-1] - float(self.records["arrival_s"].min())


class Engine:
    """Scheduler + model runner, stepped by the caller (offline) or a worker thread.

    Args:
        runner: owns the model and the paged KV cache; its block count must equal
            ``config.num_kv_blocks`` and its block size ``config.block_size``.
        config: scheduler config.
        registry: plugin registry (default: built-ins plus entry points).
        seed: seeds the engine-wide sampling generator.
        record_timings: keep a :class:`StepTiming` per step.
        clock: seconds since an arbitrary origin (``time.perf_counter``).

    Raises:
        ValueError: if the runner's KV pool does not match the config, or
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
        registry = registry if registry is not None else load_registry()
        self.runner = runner
        self.policy = registry.make(config.policy, config.loop_order, config.options)
        self.scheduler = Scheduler(config, self.policy, self.policy.label)
        self.generator = torch.Generator(device=runner.device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self.record_timings = record_timings
        self.timings: list[StepTiming] = []
        self._clock = clock
        self.t0 = clock()

    def now(self) -> float:
        """Seconds since the engine started."""
        return self._clock() - self.t0

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
        return True

    def check_request(self, request: Request) -> None:
        """Check that the model can run ``request`` before it is scheduled.

        A bad request found inside a step would leave the scheduler holding
        half-admitted state; here it is refused with a clear message.

        Raises:
            ValueError: if it has no prompt token ids (a length-only trace needs
                ``roseinfer.workloads.with_token_ids``) or an id outside the vocab.
        """
        ids = request.prompt_token_ids
        if ids is None:
            raise ValueError(
                f"request {request.request_id!r} has no prompt token ids; the executor "
                "needs them (roseinfer.workloads.with_token_ids makes them up for a trace)"
            )
        vocab = self.runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request.request_id!r} has prompt token id {bad} outside the "
                f"model's vocabulary [0, {vocab})"
            )

    def step(self) -> tuple[SchedulerOutput, list[Seq]]:
        """Run one step. Returns the output and the requests that finished.

        An empty output means nothing could run now (no work, or waiting for
        an arrival).
        """
        t_sched = self.now()
        out = self.scheduler.schedule(t_sched)
        if out.is_empty:
            return out, []
        t_prep = self.now()
        inputs = self._inputs(out)
        t_fwd = self.now()
        token_ids = self._forward_and_sample(out, inputs)
        synchronize(self.runner.device)
        t_end = self.now()
        finished = self.scheduler.update(out, t_end, token_ids)
        if self.record_timings:
            self.timings.append(
                StepTiming(
                    schedule_s=t_prep - t_sched,
                    prepare_s=t_fwd - t_prep,
                    forward_s=t_end - t_fwd,
                    update_s=self.now() - t_end,
                    num_seqs=len(inputs),
                    phase="decode" if out.phase is Phase.DECODE else "prefill",
                )
            )
        for seq in finished:
            self._seq_generators.pop(seq.seq_id, None)
        return out, finished

    def _inputs(self, out: SchedulerOutput) -> list[SeqInput]:
        bm = self.scheduler.block_manager
        inputs: list[SeqInput] = []
        for item in out.prefills:
            ids = item.seq.token_ids()
            inputs.append(
                SeqInput(
                    ids[item.num_cached_tokens :], item.num_cached_tokens, bm.block_table(item.seq)
                )
            )
        for seq in out.decodes:
            last = seq.output_token_ids[-1]
            inputs.append(SeqInput([last], seq.num_tokens - 1, bm.block_table(seq)))
        return inputs

    def _forward_and_sample(self, out: SchedulerOutput, inputs: Sequence[SeqInput]) -> list[int]:
        seqs = [item.seq for item in out.prefills] + list(out.decodes)
        logits = self.runner.forward(inputs)
        params = [s.request.sampling for s in seqs]
        generators = [self._generator(s) for s in seqs]
        return self.runner.sample(logits, params, generators)

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
        """Replay ``requests`` open-loop: each is released at its arrival time on
        the real clock (the engine's t=0 is the start of the run), then run to the end.

        Arrivals are seen between steps: a request is submitted (with its trace
        arrival time) at the first step boundary after it arrived.

        Args:
            progress: called with the number of requests that ended in each step.

        Raises:
            ValueError: if a request cannot run on this model (:meth:`check_request`);
                checked for all requests before the first step.
            RuntimeError: if this engine already has requests (one run per engine).
            PolicyError: if the policy stalls the run or answers invalidly.
        """
        if self.scheduler.seqs:
            raise RuntimeError("Engine.run replays a whole workload once; make a new Engine")
        start = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_time_s)
        for request in reqs:
            self.check_request(request)
        self.t0 = self._clock()
        i = 0
        while i < len(reqs) or self.scheduler.has_unfinished():
            i = self._submit_arrived(reqs, i, progress)
            out, finished = self.step()
            if progress is not None and finished:
                progress(len(finished))
            if not out.is_empty:
                continue
            if i < len(reqs):  # idle (or the policy waits): sleep towards the next arrival
                time.sleep(max(0.0, min(reqs[i].arrival_time_s - self.now(), 0.05)))
            elif self.scheduler.has_unfinished():
                raise PolicyError(
                    f"policy {self.scheduler.policy_name!r} admitted nothing with "
                    f"{len(self.scheduler.waiting)} waiting and nothing running"
                )
        self.scheduler.check_invariants()
        return RunResult(
            records=records_frame(self.scheduler),
            scheduler=self.scheduler,
            policy=self.policy.label,
            wall_s=time.perf_counter() - start,
            timings=self.timings,
        )

    def _submit_arrived(
        self, reqs: Sequence[Request], i: int, progress: Callable[[int], None] | None
    ) -> int:
        """Submit ``reqs[i:]`` that have arrived by now; returns the next index."""
        now = self.now()
        while i < len(reqs) and reqs[i].arrival_time_s <= now:
            seq = self.scheduler.add_request(reqs[i], reqs[i].arrival_time_s)
            if seq.is_done and progress is not None:
                progress(1)  # rejected at once
            i += 1
        return i
