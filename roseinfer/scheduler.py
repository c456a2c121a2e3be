"""The shared scheduler: waiting queue, running set, admission, preemption.

One :meth:`Scheduler.schedule` call plans one forward pass (a *step*); the
backend runs it and reports back through :meth:`Scheduler.update`. An
*iteration* (the seeds' worker-loop round) is the phases the loop ordering
asks for: prefill-first runs an admission step then a decode step,
decode-first the reverse. The scheduler never imports torch and never reads a
clock: time is passed in, so the simulator and the executor differ only in the
backend and the clock.

A decode output may cover several consecutive decode steps
(``num_steps > 1``, as vLLM's multi-step scheduling) when nothing can change
in between: no request can be admitted, none finishes before the last step,
and every block the steps need is free. The simulator uses this to jump over
long decode runs; the executor always asks for one step. The result equals
scheduling the steps one by one (a test checks it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from roseinfer.block_manager import BlockManager
from roseinfer.config import SchedulerConfig
from roseinfer.interface import AdmissionPolicy, Budget, Phase, PolicyContext, PolicyError
from roseinfer.request import Request
from roseinfer.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class PrefillItem:
    """One request prefilled in a step.

    Attributes:
        seq: the request's state.
        num_cached_tokens: tokens already in the KV cache (prefix hit); the
            step computes positions ``[num_cached_tokens, num_cached_tokens + num_new_tokens)``.
        num_new_tokens: tokens computed this step (> 0).
    """

    seq: Sequence
    num_cached_tokens: int
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step (or ``num_steps`` identical-shape decode steps).

    Attributes:
        step_index: index of the (first) step in the run's step log.
        phase: PREFILL or DECODE; None for an empty output (nothing to run now).
        prefills: requests to prefill, in admission order.
        decodes: running requests that decode one token per step, in admission order.
        num_steps: consecutive decode steps this output covers (1 for prefill).
        preempted: requests preempted (by recompute) while planning this step.
    """

    step_index: int
    phase: Phase | None
    prefills: list[PrefillItem] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    num_steps: int = 1
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.prefills and not self.decodes

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed by the prefills of this step."""
        return sum(item.num_new_tokens for item in self.prefills)


class _WaitingView(SequenceABC[Sequence]):
    """Read-only view of the waiting queue handed to policies (no copy)."""

    __slots__ = ("_queue",)

    def __init__(self, queue: deque[Sequence]) -> None:
        self._queue = queue

    def __len__(self) -> int:
        return len(self._queue)

    def __getitem__(self, index):  # type: ignore[no-untyped-def, override]
        if isinstance(index, slice):
            return [self._queue[i] for i in range(*index.indices(len(self._queue)))]
        return self._queue[index]

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


class Scheduler:
    """Continuous-batching scheduler shared by the simulator and the executor.

    Args:
        config: limits and knobs.
        policy: the composed policy (see ``roseinfer.registry.make_policy``).
        policy_name: name used in :class:`PolicyError` messages.

    Every submitted request ends exactly once: finished, or rejected with a
    reason (too long for ``max_model_len``, more KV than the pool, aborted).
    """

    def __init__(
        self, config: SchedulerConfig, policy: AdmissionPolicy, policy_name: str = ""
    ) -> None:
        self.config = config
        self.policy = policy
        self.policy_name = policy_name or getattr(policy, "name", type(policy).__name__)
        if config.prefill_max_tokens is not None and not policy.uses_token_budget:
            raise ValueError(
                f"policy {self.policy_name!r} ignores the prefill token budget "
                "(--prefill-max-tokens); use --policy budget or pack, or drop the budget"
            )
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.seqs: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_end_s: list[float] = []
        self.step_is_decode: list[bool] = []
        self.num_preemptions = 0
        self.max_used_blocks = 0
        self._admission_round = 0
        self._phases: deque[Phase] = deque()
        self._by_id: dict[str, Sequence] = {}

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request, now_s: float) -> Sequence:
        """Submit a request (it waits for admission, or is rejected at once).

        Raises:
            ValueError: if a request with the same id was already submitted.
        """
        if request.request_id in self._by_id:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        seq = Sequence(len(self.seqs), request)
        self.seqs.append(seq)
        self._by_id[request.request_id] = seq
        reason = self._reject_reason(request)
        if reason:
            self._end(seq, SeqStatus.REJECTED, now_s, reject_reason=reason)
        else:
            self.waiting.append(seq)
        return seq

    def _reject_reason(self, request: Request) -> str:
        cfg = self.config
        if request.max_num_tokens > cfg.max_model_len:
            return (
                f"prompt {request.num_prompt_tokens} + output {request.max_output_tokens} tokens "
                f"> max_model_len {cfg.max_model_len}"
            )
        num_blocks = self.block_manager.blocks_for(request.max_num_tokens)
        if num_blocks > cfg.num_kv_blocks:
            return (
                f"needs {num_blocks} KV blocks, the pool has {cfg.num_kv_blocks} "
                "(raise --num-kv-blocks)"
            )
        return ""

    def abort(self, request_id: str, now_s: float) -> bool:
        """End a waiting or running request now (status rejected, reason "aborted").

        Returns:
            False if the request is unknown or already ended.
        """
        seq = self._by_id.get(request_id)
        if seq is None or seq.is_done:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._close_segment(seq)
            self.block_manager.free(seq)
        self._end(seq, SeqStatus.REJECTED, now_s, reject_reason="aborted", stop_reason="abort")
        return True

    def get(self, request_id: str) -> Sequence | None:
        """The state of a submitted request, or None."""
        return self._by_id.get(request_id)

    def has_unfinished(self) -> bool:
        """True while some request waits or runs."""
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- schedule
    def schedule(
        self, now_s: float, max_decode_steps: int | Callable[[list[Sequence]], int] = 1
    ) -> SchedulerOutput:
        """Plan the next step.

        Args:
            now_s: current time in seconds.
            max_decode_steps: upper bound on decode steps one output may cover,
                or a function of the decode batch returning it (the simulator
                passes one that stops at the next arrival); the scheduler lowers
                it so the result equals one-by-one steps.

        Returns:
            A :class:`SchedulerOutput`; empty when there is nothing to run (no
            request, or a policy that admits nothing while nothing runs).

        Raises:
            PolicyError: if a policy answer is invalid.
        """
        for _ in range(3):  # at most one whole iteration of (possibly empty) phases
            if not self._phases:
                if not self.has_unfinished():
                    break
                self._phases.extend(self._iteration_phases(now_s))
            phase = self._phases.popleft()
            if phase is Phase.PREFILL:
                out = self._schedule_prefill(now_s)
            else:
                out = self._schedule_decode(now_s, max_decode_steps)
            if not out.is_empty:
                return out
        return SchedulerOutput(len(self.step_end_s), None)

    def _free_seats(self) -> int:
        cfg = self.config
        return min(cfg.effective_prefill_max_seqs, cfg.max_num_seqs - len(self.running))

    def _iteration_phases(self, now_s: float) -> tuple[Phase, ...]:
        can_admit = bool(self.waiting) and self._free_seats() > 0
        if not self.running:
            return (Phase.PREFILL,)
        if not can_admit:
            return (Phase.DECODE,)
        phases = self.policy.order(self._context(now_s))
        if not phases or any(not isinstance(p, Phase) for p in phases):
            raise PolicyError(
                f"loop order of policy {self.policy_name!r} returned {phases!r}; "
                "expected a non-empty tuple of roseinfer.interface.Phase"
            )
        return tuple(phases)

    def _context(self, now_s: float) -> PolicyContext:
        bm = self.block_manager
        max_len = self.config.max_model_len

        def cost(seq: Sequence) -> int:
            return min(seq.num_tokens - bm.num_cached_tokens(seq), max_len)

        return PolicyContext(
            now_s=now_s,
            admission_round=self._admission_round,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            max_model_len=max_len,
            cost=cost,
        )

    # ----------------------------------------------------------------- prefill
    def _schedule_prefill(self, now_s: float) -> SchedulerOutput:
        out = SchedulerOutput(len(self.step_end_s), Phase.PREFILL)
        seats = self._free_seats()
        if not self.waiting or seats <= 0:
            return out
        self._admission_round += 1
        ctx = self._context(now_s)
        budget = Budget(self.config.prefill_max_tokens, seats, self.block_manager.num_free_blocks)
        selection = self.policy.admit(_WaitingView(self.waiting), budget, ctx)
        self._validate_selection(selection, budget, ctx)
        for seq in selection:
            if not self.block_manager.can_allocate(seq):
                break  # keep FIFO semantics: the rest wait for blocks
            out.prefills.append(self._admit(seq, now_s, out.step_index))
        self._remove_from_waiting({item.seq.seq_id for item in out.prefills})
        return out

    def _admit(self, seq: Sequence, now_s: float, step_index: int) -> PrefillItem:
        bm = self.block_manager
        num_cached = bm.allocate(seq)
        if seq.num_cached_prompt_tokens < 0:
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
            seq.admitted_s = now_s
            bm.record_prefix_query(seq, seq.num_cached_prompt_tokens)
        seq.status = SeqStatus.RUNNING
        seq.num_computed_tokens = num_cached
        seq.segments.append([step_index, -1])
        self.running.append(seq)
        return PrefillItem(seq, num_cached, seq.num_tokens - num_cached)

    def _validate_selection(
        self, selection: list[Sequence], budget: Budget, ctx: PolicyContext
    ) -> None:
        where = f"policy {self.policy_name!r}"
        if not isinstance(selection, list):
            raise PolicyError(f"{where} returned {type(selection).__name__}, expected a list")
        seen: set[int] = set()
        for seq in selection:
            if not isinstance(seq, Sequence) or self._by_id.get(seq.request_id) is not seq:
                raise PolicyError(f"{where} selected {seq!r}, which this scheduler does not hold")
            if seq.status is not SeqStatus.WAITING:
                raise PolicyError(f"{where} selected {seq!r}, which is not waiting")
            if seq.seq_id in seen:
                raise PolicyError(f"{where} selected {seq!r} twice")
            seen.add(seq.seq_id)
        if len(selection) > budget.max_seqs:
            raise PolicyError(
                f"{where} selected {len(selection)} requests; at most {budget.max_seqs} fit"
            )
        if len(selection) > 1 and budget.max_tokens is not None:
            total = sum(ctx.cost(seq) for seq in selection)
            if total > budget.max_tokens:
                raise PolicyError(
                    f"{where} selected {total} prompt tokens over a budget of "
                    f"{budget.max_tokens} (only a single request may exceed it)"
                )

    def _remove_from_waiting(self, seq_ids: set[int]) -> None:
        if not seq_ids:
            return
        kept: list[Sequence] = []
        remaining = len(seq_ids)
        while remaining:
            seq = self.waiting.popleft()
            if seq.seq_id in seq_ids:
                remaining -= 1
            else:
                kept.append(seq)
        self.waiting.extendleft(reversed(kept))

    # ------------------------------------------------------------------ decode
    def _schedule_decode(
        self, now_s: float, max_steps: int | Callable[[list[Sequence]], int]
    ) -> SchedulerOutput:
        out = SchedulerOutput(len(self.step_end_s), Phase.DECODE)
        if not self.running:
            return out
        num_steps = self._max_jump(max_steps)
        if num_steps > 1:
            for seq in self.running:
                self.block_manager.grow(seq, seq.num_tokens + num_steps - 1)
        else:
            self._reserve_one_slot_each(now_s, out)
        out.decodes = list(self.running)
        out.num_steps = num_steps
        return out

    def _max_jump(self, max_steps: int | Callable[[list[Sequence]], int]) -> int:
        """Decode steps that can run back to back with nothing changing."""
        if max_steps == 1 or (self.waiting and self._free_seats() > 0):
            return 1
        for seq in self.running:
            if not seq.request.sampling.ignore_eos:
                return 1
        steps = max_steps(self.running) if callable(max_steps) else max_steps
        for seq in self.running:
            steps = min(steps, seq.remaining_output_tokens)
        while steps > 1 and self._blocks_to_grow(steps) > self.block_manager.num_free_blocks:
            steps //= 2
        return max(steps, 1)

    def _blocks_to_grow(self, num_steps: int) -> int:
        bm = self.block_manager
        return sum(bm.num_blocks_to_grow(s, s.num_tokens + num_steps - 1) for s in self.running)

    def _reserve_one_slot_each(self, now_s: float, out: SchedulerOutput) -> None:
        """Give each running request a slot for its next token, preempting by
        recompute when the pool is dry (victim chosen by the policy)."""
        bm = self.block_manager
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not bm.can_grow(seq, seq.num_tokens):
                victim = self._pick_victim(now_s)
                if self.running.index(victim) < i:
                    i -= 1  # it already had its slot; the list shifts left
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.grow(seq, seq.num_tokens)
                i += 1

    def _pick_victim(self, now_s: float) -> Sequence:
        victim = self.policy.select_victim(list(self.running), self._context(now_s))
        if victim not in self.running:
            raise PolicyError(f"policy {self.policy_name!r} chose a victim that is not running")
        return victim

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._close_segment(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # recompute first, as vLLM does

    # ------------------------------------------------------------------ update
    def update(
        self,
        out: SchedulerOutput,
        end_times_s: float | SequenceABC[float],
        sampled_token_ids: SequenceABC[int] | None = None,
    ) -> list[Sequence]:
        """Apply the result of a step.

        Args:
            out: the output returned by :meth:`schedule`.
            end_times_s: end time (s) of the step, or of each of its ``num_steps`` steps.
            sampled_token_ids: one token id per prefill then per decode (executor;
                single-step outputs only), or None when only counts matter.

        Returns:
            The requests that finished in this step.
        """
        ends = [float(end_times_s)] if isinstance(end_times_s, (int, float)) else list(end_times_s)
        if len(ends) != out.num_steps:
            raise ValueError(f"expected {out.num_steps} end times, got {len(ends)}")
        is_decode = out.phase is Phase.DECODE
        self.step_end_s.extend(ends)
        self.step_is_decode.extend([is_decode] * len(ends))
        self.max_used_blocks = max(self.max_used_blocks, self.block_manager.num_used_blocks)
        seqs = [item.seq for item in out.prefills] if not is_decode else out.decodes
        if not is_decode:
            for seq in seqs:
                seq.num_computed_tokens = seq.num_tokens
        else:
            for seq in seqs:
                seq.num_computed_tokens = seq.num_tokens + out.num_steps - 1
        return self._append_tokens(seqs, out.num_steps, ends[-1], sampled_token_ids)

    def _append_tokens(
        self,
        seqs: list[Sequence],
        num_steps: int,
        end_s: float,
        token_ids: SequenceABC[int] | None,
    ) -> list[Sequence]:
        finished: list[Sequence] = []
        for i, seq in enumerate(seqs):
            seq.num_output_tokens += num_steps
            stop = False
            if token_ids is not None:
                token = int(token_ids[i])
                seq.output_token_ids.append(token)
                sampling = seq.request.sampling
                stop = not sampling.ignore_eos and token in sampling.stop_token_ids
            if stop or seq.remaining_output_tokens <= 0:
                finished.append(seq)
                self._finish(seq, end_s, "stop" if stop else "length")
        if finished:
            done = {s.seq_id for s in finished}
            self.running = [s for s in self.running if s.seq_id not in done]
        return finished

    def _finish(self, seq: Sequence, end_s: float, stop_reason: str) -> None:
        self._close_segment(seq)
        self.block_manager.free(seq)
        self._end(seq, SeqStatus.FINISHED, end_s, stop_reason=stop_reason)

    def _close_segment(self, seq: Sequence) -> None:
        if seq.segments and seq.segments[-1][1] < 0:
            seq.segments[-1][1] = len(self.step_end_s) - 1

    @staticmethod
    def _end(
        seq: Sequence,
        status: SeqStatus,
        now_s: float,
        *,
        reject_reason: str = "",
        stop_reason: str = "",
    ) -> None:
        if seq.is_done:
            raise RuntimeError(f"{seq} ended twice")
        seq.status = status
        seq.finish_s = now_s
        seq.reject_reason = reject_reason
        seq.stop_reason = stop_reason

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert KV accounting and queue consistency (tests, end of runs).

        Raises:
            AssertionError: naming the broken invariant.
        """
        self.block_manager.check_invariants()
        for seq in self.running:
            assert seq.status is SeqStatus.RUNNING, f"{seq} in running set"
        for seq in self.waiting:
            assert seq.status is SeqStatus.WAITING, f"{seq} in waiting queue"
        assert len(self.running) <= self.config.max_num_seqs, "running set over max_num_seqs"
        if not self.has_unfinished():
            assert self.block_manager.num_used_blocks == 0, "KV blocks leaked"
