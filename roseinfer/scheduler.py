"""The shared scheduler: waiting queue, running set, admission, chunking, preemption.

One :meth:`Scheduler.schedule` call plans one forward pass (a *step*) as tokens
per request (vLLM v1's ``num_scheduled_tokens``): each :class:`ScheduledSeq`
computes ``num_new_tokens`` tokens of its request from ``num_computed_tokens``
on, and samples a token when that reaches the request's end. A whole-prompt
prefill, a prefill chunk and a decode are the same item; a step may mix them.
The backend runs the step and reports back through :meth:`Scheduler.update`.

An *iteration* (the seeds' worker-loop round) is the phases the loop ordering
asks for: prefill-first runs a prefill step then a decode step, decode-first
the reverse, mixed one step holding both (see :class:`~roseinfer.interface.Phase`).
The scheduler never imports torch and never reads a clock: time is passed in,
so the simulator and the executor differ only in the backend and the clock.

A decode output may cover several consecutive decode steps (``num_steps > 1``,
as vLLM's multi-step scheduling) when nothing can change in between:
:meth:`Scheduler.max_decode_run` says how many, and
:meth:`Scheduler.extend_decode_run` extends it. The result equals scheduling
the steps one by one (a hypothesis test checks records, preemptions and
hit rates).

Requests leave the scheduler when they end (finished, rejected, aborted):
:meth:`Scheduler.pop_ended` hands them to the caller, which turns them into
records, so memory does not grow with the length of a trace.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence as SequenceABC
from typing import NamedTuple

from roseinfer.block_manager import BLOCK_HASHERS, BlockManager
from roseinfer.config import SchedulerConfig
from roseinfer.contract import ReadOnlyView, checked_admission, checked_named
from roseinfer.interface import (
    AdmissionPolicy,
    Budget,
    Phase,
    PolicyContext,
    PolicyError,
    StepItem,
    StepReport,
)
from roseinfer.kv_tiers import KVTransfers
from roseinfer.records import StepLog
from roseinfer.request import Request
from roseinfer.sequence import SeqStatus, Sequence

RELEASE_MIN_HELD = 1 << 20
"""Steps the step log holds before :meth:`Scheduler.release_steps` drops old ones."""


class StepTotals(NamedTuple):
    """Counts and sums of one step: all a cost model needs to price it.

    Attributes:
        num_seqs: requests in the step (prefilling + decoding).
        num_tokens: tokens computed (new prefill tokens + one per decode).
        num_prefills: prefill items (whole prompts or chunks).
        prefill_attn_pairs: causal (query, key) pairs of the prefill items: a
            chunk of ``n`` new tokens ending at context ``c`` has
            ``n * c - n * (n - 1) / 2``.
        prefill_context_tokens: summed context of the prefill items after the step.
        decode_context_tokens: summed context of the decodes, the decoded token included.
        decode_max_context: the longest decode context (0 without decodes): a
            decode batch's attention ends with its longest sequence.
    """

    num_seqs: int
    num_tokens: int
    num_prefills: int
    prefill_attn_pairs: int
    prefill_context_tokens: int
    decode_context_tokens: int
    decode_max_context: int = 0


class ScheduledSeq:
    """One request's share of a step (read-only by convention: not frozen, since
    one is built per request per step and a frozen init costs 4x).

    Attributes:
        seq: the request's state.
        num_computed_tokens: tokens whose KV exists before the step (prefix-cache
            hit, earlier chunks, or all but the last token for a decode); the step
            computes positions ``[num_computed_tokens, num_computed_tokens + num_new_tokens)``.
        num_new_tokens: tokens computed this step (> 0).
        samples: True when the step reaches the end of the request's tokens and so
            samples its next token (a completed prefill, or a decode).
        is_decode: True for a decode (one token, after the request's first output).
    """

    __slots__ = ("seq", "num_computed_tokens", "num_new_tokens", "samples", "is_decode")

    def __init__(
        self, seq: Sequence, num_computed_tokens: int, num_new_tokens: int, samples: bool,
        is_decode: bool,
    ) -> None:  # fmt: skip
        self.seq = seq
        self.num_computed_tokens = num_computed_tokens
        self.num_new_tokens = num_new_tokens
        self.samples = samples
        self.is_decode = is_decode

    @property
    def num_context_tokens(self) -> int:
        """Context length after the step (computed + new tokens)."""
        return self.num_computed_tokens + self.num_new_tokens

    def __repr__(self) -> str:
        return (
            f"ScheduledSeq({self.seq!r}, computed={self.num_computed_tokens}, "
            f"new={self.num_new_tokens}, samples={self.samples}, decode={self.is_decode})"
        )


class SchedulerOutput:
    """The plan of one step (or ``num_steps`` identical-shape decode steps).

    Decodes are held as the requests themselves (every one computes its last
    token and samples the next), prefills as explicit items; :attr:`scheduled`
    gives both as :class:`ScheduledSeq` items. The totals a cost model reads
    (:meth:`totals`) are counted while planning, so no backend walks the batch
    again to price it.

    Attributes:
        step_index: index of the (first) step in the run's step log.
        phase: the phase planned; None for an empty output (nothing to run now).
        decodes: the decoding requests, in running-set order.
        decode_contexts: each decode's context after the (first) step (tokens),
            as planned (the requests' own counts move on when the step is applied).
        prefills: the prefill items (whole prompts or chunks), in scheduling order.
        num_steps: consecutive decode steps this output covers (1 unless a
            multi-step decode run).
        preempted: requests preempted (by recompute) while planning this step.
        decode_context_tokens: summed context of the decodes after the (first)
            step (tokens).
        decode_max_context: the longest of ``decode_contexts`` (0 without decodes).
        num_prefill_tokens: tokens computed by the prefill items.
        prefill_attn_pairs: causal (query, key) pairs of the prefill items.
        prefill_context_tokens: summed context of the prefill items after the step.
        kv_transfers: KV tier copies to make before the (first) forward and the
            load time to price (:class:`~roseinfer.kv_tiers.KVTransfers`); None
            without tiers or when no block moved.
    """

    __slots__ = (
        "step_index", "phase", "decodes", "decode_contexts", "prefills", "num_steps",
        "preempted", "decode_context_tokens", "_items", "kv_transfers", "num_prefill_tokens",
        "prefill_attn_pairs", "prefill_context_tokens", "decode_max_context",
    )  # fmt: skip

    def __init__(self, step_index: int, phase: Phase | None) -> None:
        self.step_index = step_index
        self.phase = phase
        self.decodes: list[Sequence] = []
        self.decode_contexts: list[int] = []
        self.prefills: list[ScheduledSeq] = []
        self.num_steps = 1
        self.preempted: list[Sequence] = []
        self.decode_context_tokens = 0
        self.decode_max_context = 0
        self._items: list[ScheduledSeq] | None = None
        self.kv_transfers: KVTransfers | None = None
        self.num_prefill_tokens = 0
        self.prefill_attn_pairs = 0
        self.prefill_context_tokens = 0

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not (self.decodes or self.prefills)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        """Every request in the (first) step: decodes first, then prefill chunks in
        the order they were scheduled (decode items made on first use)."""
        if self._items is None:
            decodes = [ScheduledSeq(s, c - 1, 1, True, True)
                       for s, c in zip(self.decodes, self.decode_contexts)]  # fmt: skip
            self._items = decodes + self.prefills
        return self._items

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens each request computes in the (first) step, by request id (vLLM v1's map)."""
        return {item.seq.request_id: item.num_new_tokens for item in self.scheduled}

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed by the (first) step."""
        return len(self.decodes) + self.num_prefill_tokens

    @property
    def sampling(self) -> list[ScheduledSeq]:
        """The items that sample a token, in order (one sampled id each from the executor)."""
        return [item for item in self.scheduled if item.samples]

    def totals(self) -> StepTotals:
        """What the (first) step computes, as every cost model reads it."""
        num_prefills, num_decodes = len(self.prefills), len(self.decodes)
        return StepTotals(
            num_prefills + num_decodes, self.num_prefill_tokens + num_decodes, num_prefills,
            self.prefill_attn_pairs, self.prefill_context_tokens, self.decode_context_tokens,
            self.decode_max_context,
        )  # fmt: skip

    def add_prefill(self, item: ScheduledSeq) -> None:
        """Append a prefill item and count it in the step's totals."""
        self.prefills.append(item)
        self._count_prefill(item, 1)
        self._items = None

    def _count_prefill(self, item: ScheduledSeq, sign: int) -> None:
        n = item.num_new_tokens
        c = item.num_computed_tokens + n
        self.num_prefill_tokens += sign * n
        self.prefill_attn_pairs += sign * (n * c - n * (n - 1) // 2)
        self.prefill_context_tokens += sign * c

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of the planned step (its sampling failed, or it was
        preempted while planning)."""
        if seq in self.decodes:
            i = self.decodes.index(seq)
            del self.decodes[i]
            self.decode_context_tokens -= self.decode_contexts.pop(i)
            self.decode_max_context = max(self.decode_contexts, default=0)
        else:
            kept = []
            for item in self.prefills:
                if item.seq is seq:
                    self._count_prefill(item, -1)
                else:
                    kept.append(item)
            self.prefills = kept
        self._items = None


class _StepTokens:
    """Token room left while planning one step (``math.inf`` = no limit)."""

    __slots__ = ("batched", "prefill")

    def __init__(self, batched: float, prefill: float) -> None:
        self.batched = batched
        self.prefill = prefill

    def take(self, num_tokens: int, prefill: bool) -> None:
        self.batched -= num_tokens
        if prefill:
            self.prefill -= num_tokens  # may go below 0: an oversize request alone

    def give_back(self, num_tokens: int, prefill: bool) -> None:
        self.batched += num_tokens
        if prefill:
            self.prefill += num_tokens

    def prefill_room(self) -> float:
        return min(self.batched, self.prefill)


# NOTE: module constants, read on every step (an enum member lookup costs an
# attribute lookup on its class; these are C globals in the compiled core)
_PREFILL, _DECODE = Phase.PREFILL, Phase.DECODE
_PREFILL_ONLY, _DECODE_ONLY = (_PREFILL,), (_DECODE,)
_WAITING, _RUNNING, _FINISHED = SeqStatus.WAITING, SeqStatus.RUNNING, SeqStatus.FINISHED


def _admission_order(seq: Sequence) -> int:
    return seq.admission_index


def _limit(value: float) -> int | None:
    return None if math.isinf(value) else int(value)


def _report(out: SchedulerOutput, end_s: float) -> StepReport:
    """What each request of ``out`` computed, for ``observe_step``."""
    k = out.num_steps
    decodes = [StepItem(s, s.request.tenant, k, True) for s in out.decodes]
    prefills = [
        StepItem(p.seq, p.seq.request.tenant, p.num_new_tokens, False) for p in out.prefills
    ]
    return StepReport(end_s, k, tuple(decodes + prefills))


class Scheduler:
    """Continuous-batching scheduler shared by the simulator and the executor.

    Args:
        config: limits and knobs.
        policy: the composed policy (see ``roseinfer.registry.Registry.make``).
        policy_name: name used in :class:`PolicyError` messages.

    Raises:
        ValueError: if ``config.prefill_max_tokens`` is set for a policy that
            ignores it.

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
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            BLOCK_HASHERS[config.prefix_caching_hash_algo],
            config.kv_tiers,
        )
        self.step_log = StepLog()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.prefilling: list[Sequence] = []  # running, (re)prefill unfinished, admission order
        self.decoding: list[Sequence] = []  # running, prefill complete, admission order
        self.num_submitted = 0
        self.num_preemptions = 0
        self.num_outputs = 0  # outputs applied (a multi-step decode run counts once)
        self.max_used_blocks = 0
        self._admission_round = 0
        self._phases: deque[Phase] = deque()
        fixed = getattr(policy, "fixed_order", None)
        self._fixed_order = None if fixed is None else self._checked_phases(fixed, "declares")
        self._live: dict[str, Sequence] = {}
        self._ended: list[Sequence] = []
        self._acts = bool(policy.may_preempt or policy.may_drop)  # see _policy_actions
        self._observes = bool(policy.observes_steps)
        self._num_admissions = 0  # stays begun: orders the decoding list by admission
        self._num_may_stop = 0  # running requests that may stop early (not ignore_eos)
        # the config's limits read on every step (a config is frozen)
        self._block_size = config.block_size
        self._max_num_seqs = config.max_num_seqs
        self._seat_cap = config.effective_prefill_max_seqs
        self._step_batched: float = config.max_num_batched_tokens or math.inf
        self._step_prefill: float = config.prefill_max_tokens or math.inf

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request, now_s: float) -> Sequence:
        """Submit a request (it waits for admission, or is rejected at once).

        Raises:
            ValueError: if a request with the same id is still waiting or running.
        """
        if request.request_id in self._live:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        seq = Sequence(self.num_submitted, request)
        self.num_submitted += 1
        reason = self._reject_reason(request)
        if reason:
            self._end(seq, SeqStatus.REJECTED, now_s, reject_reason=reason)
        else:
            self._live[request.request_id] = seq
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
        seq = self._live.get(request_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self._leave_running(seq)
        self._end(seq, SeqStatus.REJECTED, now_s, reject_reason="aborted", stop_reason="abort")
        return True

    def get(self, request_id: str) -> Sequence | None:
        """The state of a waiting or running request, or None."""
        return self._live.get(request_id)

    def has_unfinished(self) -> bool:
        """True while some request waits or runs."""
        return bool(self.waiting or self.running)

    def pop_ended(self) -> list[Sequence]:
        """Requests that ended since the last call (finished, rejected or aborted),
        in the order they ended; the scheduler keeps no reference to them."""
        ended, self._ended = self._ended, []
        return ended

    def release_steps(self, min_held: int | None = None) -> None:
        """Drop the step log's steps that no waiting or running request refers to,
        once it holds more than ``min_held`` steps (default
        :data:`RELEASE_MIN_HELD`; memory flat in run length). Call it after the
        requests from :meth:`pop_ended` were recorded: their token times come
        from the steps."""
        log = self.step_log
        held = RELEASE_MIN_HELD if min_held is None else min_held
        if log.num_steps - log.first_kept_step <= held or self._ended:
            return
        oldest = log.num_steps
        for seq in self._live.values():
            for first, last in seq.stays:
                step = first if first is not None else last
                if step is not None:
                    oldest = min(oldest, step)
                    break
        log.release(oldest)

    # ---------------------------------------------------------------- schedule
    def schedule(self, now_s: float) -> SchedulerOutput:
        """Plan the next step (a pure decode step may then be extended to a run of
        steps: :meth:`max_decode_run`, :meth:`extend_decode_run`).

        Args:
            now_s: current time in seconds.

        Returns:
            A :class:`SchedulerOutput`; empty when there is nothing to run (no
            request, or a policy that admits nothing while nothing runs).

        Raises:
            PolicyError: if a policy answer is invalid.
        """
        out = self._schedule(now_s)
        if self.block_manager.kv_tiers is not None and not out.is_empty:
            # copies decided while planning an empty output wait for the next step
            out.kv_transfers = self.block_manager.pop_transfers()
        return out

    def _schedule(self, now_s: float) -> SchedulerOutput:
        # by the policy itself, then by phases that had nothing to run
        preempted = self._policy_actions(now_s) if self._acts and self.waiting else []
        # the rest of the current iteration, then (once) a whole new one
        phases, refilled = self._phases, False
        while phases or not refilled:
            if not phases:
                phases.extend(self._iteration_phases(now_s))
                refilled = True
                continue
            out = self._plan(phases.popleft(), now_s)
            if out.decodes or out.prefills:  # not out.is_empty, read as typed fields
                out.preempted[:0] = preempted
                return out
            preempted += out.preempted
        # A whole iteration ran nothing (e.g. a prefill-only order with no room to
        # admit, or decode phases whose only decode was preempted): run the work
        # that is left, so running requests never idle.
        if self.decoding:
            fallback: Phase | None = _DECODE
        else:
            fallback = _PREFILL if self._has_prefill_work() else None
        if fallback is not None:
            out = self._plan(fallback, now_s)
            out.preempted[:0] = preempted
            return out
        out = SchedulerOutput(self.step_log.num_steps, None)
        out.preempted = preempted
        return out

    def _iteration_phases(self, now_s: float) -> tuple[Phase, ...]:
        has_decodes = bool(self.decoding)
        if not self._has_prefill_work():
            return _DECODE_ONLY if has_decodes else ()
        if not has_decodes:
            return _PREFILL_ONLY
        if self._fixed_order is not None:
            return self._fixed_order
        return self._checked_phases(self.policy.order(self._context(now_s)), "returned")

    def _checked_phases(self, phases: object, verb: str) -> tuple[Phase, ...]:
        """``phases`` as a tuple, or PolicyError naming the policy when it is not
        a non-empty sequence of :class:`Phase` (``verb``: "returned" for an
        ``order()`` answer, "declares" for ``fixed_order``)."""
        if (
            not isinstance(phases, (tuple, list))
            or not phases
            or any(not isinstance(p, Phase) for p in phases)
        ):
            raise PolicyError(
                f"loop order of policy {self.policy_name!r} {verb} {phases!r}; "
                "expected a non-empty tuple of roseinfer.interface.Phase"
            )
        return tuple(phases)

    def _free_seats(self) -> int:
        return min(self._seat_cap, self._max_num_seqs - len(self.running))

    def _has_prefill_work(self) -> bool:
        return bool(self.prefilling) or (bool(self.waiting) and self._free_seats() > 0)

    def _cost(self, seq: Sequence) -> int:
        """Prompt tokens ``seq`` would compute if admitted now (``PolicyContext.cost``)."""
        num_cached = self.block_manager.num_cached_tokens(seq)
        return min(seq.num_tokens - self._ready_tokens(seq, num_cached), self.config.max_model_len)

    def _context(self, now_s: float) -> PolicyContext:
        # NOTE: positional, in PolicyContext's field order (now_s, admission_round,
        # num_running, num_waiting, max_model_len, cost, running, num_free_blocks,
        # block_size, max_num_seqs, free_seats): 1.2 us a context instead of 1.9 us
        # by keyword, once per admission round (tests/test_scheduler.py checks the fields)
        config = self.config
        return PolicyContext(
            now_s, self._admission_round, len(self.running), len(self.waiting),
            config.max_model_len, self._cost, ReadOnlyView(self.running),
            self.block_manager.num_free_blocks, config.block_size, config.max_num_seqs,
            max(self._free_seats(), 0),
        )  # fmt: skip

    # ------------------------------------------------- policy-named preemption
    def _policy_actions(self, now_s: float) -> list[Sequence]:
        """Drop and preempt what the policy names (``may_drop``/``may_preempt``).

        Returns:
            The requests preempted (they wait again at the head of the queue).

        Raises:
            PolicyError: if a named request is not waiting (drop) or not running
                (preempt), or is named twice.
        """
        where = f"policy {self.policy_name!r}"
        if self.policy.may_drop:
            answer = self.policy.drop(ReadOnlyView(self.waiting), self._context(now_s))
            for seq in checked_named(answer, live=self._live, where=where, what="drop"):
                self.waiting.remove(seq)
                self._end(seq, SeqStatus.REJECTED, now_s, reject_reason=f"dropped by {where}")
        if not self.policy.may_preempt or not self.waiting or not self.running:
            return []
        answer = self.policy.preempt(ReadOnlyView(self.waiting), self._context(now_s))
        victims = checked_named(answer, live=self._live, where=where, what="preempt")
        for seq in reversed(victims):  # the first named ends at the head of the queue
            self._preempt(seq)
        return victims

    def _plan(self, phase: Phase, now_s: float) -> SchedulerOutput:
        out = SchedulerOutput(self.step_log.num_steps, phase)
        room = _StepTokens(self._step_batched, self._step_prefill)
        if phase is not _PREFILL:
            self._schedule_decodes(out, room, now_s)
        if phase is not _DECODE:
            self._schedule_partial_prefills(out, room, now_s)
            if not out.preempted:  # as vLLM v1: no admission in a step that preempted
                self._schedule_admissions(out, room, now_s)
        return out

    # ------------------------------------------------------------ running set
    def _schedule_decodes(self, out: SchedulerOutput, room: _StepTokens, now_s: float) -> None:
        """One token for every decoding request, preempting by recompute when
        the pool is dry (victim chosen by the policy)."""
        decodes, contexts = out.decodes, out.decode_contexts
        context = longest = 0
        for seq in list(self.decoding):
            # a victim preempted earlier in this loop is WAITING now: skip it
            if seq.status is not _RUNNING:
                continue
            num_tokens = seq.num_prompt_tokens + seq.num_output_tokens
            if seq.kv_slots < num_tokens and not self._reserve(seq, num_tokens, out, room, now_s):
                continue
            decodes.append(seq)
            contexts.append(num_tokens)
            context += num_tokens
            if num_tokens > longest:
                longest = num_tokens
        out.decode_context_tokens += context
        # NOTE: a preemption inside _reserve may have taken out a decode counted in
        # `longest` (out.remove): then the longest is recounted from what is left
        out.decode_max_context = max(contexts, default=0) if out.preempted else longest
        room.take(len(decodes), False)

    def _schedule_partial_prefills(
        self, out: SchedulerOutput, room: _StepTokens, now_s: float
    ) -> None:
        """The next chunk of every running request whose prefill is unfinished."""
        for seq in list(self.prefilling):
            if seq.status is not _RUNNING:  # preempted earlier in this loop
                continue
            chunk = self._chunk_size(seq.num_uncomputed_tokens, room.prefill_room())
            if chunk <= 0:
                break
            start = seq.num_computed_tokens
            if not self._reserve(seq, start + chunk, out, room, now_s):
                break
            out.add_prefill(self._item(seq, start, chunk))
            room.take(chunk, True)

    def _chunk_size(self, num_uncomputed: int, room: float) -> int:
        """Tokens of a prefill to compute now: all of them, or (chunked prefill)
        what fits ``room`` and the per-request threshold; 0 if it must wait."""
        if not self.config.enable_chunked_prefill:
            return num_uncomputed if num_uncomputed <= room else 0
        threshold = self.config.long_prefill_token_threshold or math.inf
        return int(min(num_uncomputed, room, threshold))

    def _item(self, seq: Sequence, start: int, num_new: int) -> ScheduledSeq:
        """A prefill item (whole prompt or chunk) of a request in prefill."""
        return ScheduledSeq(seq, start, num_new, start + num_new == seq.num_tokens, False)

    def _reserve(
        self,
        seq: Sequence,
        num_tokens: int,
        out: SchedulerOutput,
        room: _StepTokens,
        now_s: float,
    ) -> bool:
        """Grow ``seq``'s blocks to ``num_tokens`` tokens, preempting until they fit.

        Returns:
            False if ``seq`` itself was preempted.
        """
        bm = self.block_manager
        while not bm.can_grow(seq, num_tokens):
            victim = self._pick_victim(now_s)
            self._unschedule(out, victim, room)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        bm.grow(seq, num_tokens)
        return True

    def _unschedule(self, out: SchedulerOutput, victim: Sequence, room: _StepTokens) -> None:
        if victim in out.decodes:
            out.remove(victim)
            room.give_back(1, False)
            return
        for item in out.prefills:
            if item.seq is victim:
                out.remove(victim)
                room.give_back(item.num_new_tokens, True)
                return

    def _pick_victim(self, now_s: float) -> Sequence:
        victim = self.policy.select_victim(list(self.running), self._context(now_s))
        if victim not in self.running:
            raise PolicyError(f"policy {self.policy_name!r} chose a victim that is not running")
        return victim

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if seq.in_prefill:
            self.prefilling.remove(seq)
            seq.in_prefill = False
        else:
            self.decoding.remove(seq)
        if not seq.request.sampling.ignore_eos:
            self._num_may_stop -= 1
        self._close_stay(seq)
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._leave_running(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # recompute first, as vLLM does

    # ------------------------------------------------------------- admission
    def _schedule_admissions(self, out: SchedulerOutput, room: _StepTokens, now_s: float) -> None:
        seats = self._free_seats()
        if not self.waiting or seats <= 0 or room.prefill_room() <= 0:
            return
        self._admission_round += 1
        ctx = self._context(now_s)
        budget = Budget(  # positional: max_tokens, max_seqs, num_free_blocks, max_batched_tokens
            _limit(room.prefill) if self.config.prefill_max_tokens else None,
            seats,
            self.block_manager.num_free_blocks,
            _limit(room.batched),
        )
        selection = self.policy.admit(ReadOnlyView(self.waiting), budget, ctx)
        admitted: set[int] = set()
        choices = checked_admission(
            selection,
            budget,
            ctx,
            live=self._live,
            chunked_prefill=self.config.enable_chunked_prefill,
            where=f"policy {self.policy_name!r}",
        )
        for seq, num_tokens in choices:
            item = self._admit(seq, num_tokens, out, room, now_s)
            if item is None:
                break  # keep FIFO semantics: the rest wait (blocks, room, partial cap)
            out.add_prefill(item)
            admitted.add(seq.seq_id)
        self._remove_from_waiting(admitted)

    def _admit(
        self,
        seq: Sequence,
        num_tokens: int | None,
        out: SchedulerOutput,
        room: _StepTokens,
        now_s: float,
    ) -> ScheduledSeq | None:
        """Admit ``seq`` with a chunk (``num_tokens``, or sized here); None if it
        cannot start this step."""
        bm = self.block_manager
        num_hit = bm.num_cached_tokens(seq)
        num_cached = self._ready_tokens(seq, num_hit)
        num_uncomputed = seq.num_tokens - num_cached
        chunk = num_tokens or self._chunk_size(num_uncomputed, room.batched)
        if chunk <= 0 or chunk > room.batched:
            return None
        if chunk < num_uncomputed and not self._may_start_partial(out):
            return None
        # vLLM's scheduler_reserve_full_isl: blocks for the whole sequence must be free,
        # though only the chunk is allocated now
        full = self.config.scheduler_reserve_full_isl
        if not bm.can_allocate(seq, seq.num_tokens if full else num_cached + chunk):
            return None
        bm.allocate(seq, num_cached + chunk)
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(num_hit, seq.num_prompt_tokens)
            seq.admitted_s = now_s
            bm.record_prefix_query(seq, seq.num_cached_prompt_tokens)
        seq.status = _RUNNING
        seq.num_computed_tokens = num_cached
        seq.stays.append([None, None])
        seq.in_prefill = True
        seq.admission_index = self._num_admissions
        self._num_admissions += 1
        self.running.append(seq)
        self.prefilling.append(seq)
        if not seq.request.sampling.ignore_eos:
            self._num_may_stop += 1
        room.take(chunk, True)
        return self._item(seq, num_cached, chunk)

    @staticmethod
    def _ready_tokens(seq: Sequence, num_cached: int) -> int:
        """Tokens of ``seq`` whose KV it need not compute at admission: its
        prefix-cache hit (``num_cached``), or (first admission only) the KV that
        arrived with it from a prefill replica (``Request.num_transferred_tokens``,
        capped so the last token is computed and samples)."""
        transferred = seq.request.num_transferred_tokens
        if transferred and not seq.num_preemptions:
            return max(num_cached, min(transferred, seq.num_tokens - 1))
        return num_cached

    def _may_start_partial(self, out: SchedulerOutput) -> bool:
        cap = self.config.max_num_partial_prefills
        if cap is None:
            return True
        completing = 0
        for item in out.prefills:
            completing += item.samples
        return len(self.prefilling) - completing < cap

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

    # ------------------------------------------------------ multi-step decode
    def _decode_run_possible(self) -> bool:
        """True when the next steps can only be decodes of the same requests: none
        prefills, none can be admitted, and every request runs to its exact length
        (no early stop). A policy that preempts or drops bounds the run in time
        (:meth:`quiet_until`)."""
        return not (
            self.prefilling
            or not self.decoding
            or (self.waiting and self._free_seats() > 0)
            or self._num_may_stop
        )

    def quiet_until(self, now_s: float) -> float:
        """Until when (s) the policy need not be asked to preempt or drop while the
        running requests only decode (``AdmissionPolicy.quiet_until``; inf when it
        neither preempts nor drops, or nothing waits)."""
        if not (self._acts and self.waiting):
            return math.inf
        return float(self.policy.quiet_until(ReadOnlyView(self.waiting), self._context(now_s)))

    def max_decode_run(self, out: SchedulerOutput) -> int:
        """How many consecutive decode steps the planned output ``out`` may cover
        with nothing changing: it decodes every running request (a decode step
        that preempted nobody), none can be admitted, and none stops before the
        last step (exact output lengths). The KV pool may cut the run shorter
        (:meth:`extend_decode_run`).

        Returns:
            >= 1 (1 when ``out`` cannot be extended).
        """
        if (
            out.phase is not _DECODE
            or out.preempted
            or len(out.decodes) != len(self.running)
            or not self._decode_run_possible()
        ):
            return 1
        num_steps = -1
        for seq in out.decodes:
            left = seq.max_output_tokens - seq.num_output_tokens
            if num_steps < 0 or left < num_steps:
                num_steps = left
        return num_steps

    def extend_decode_run(self, out: SchedulerOutput, num_steps: int) -> None:
        """Let the pure decode output ``out`` cover ``num_steps`` steps, or fewer:
        as many as the free blocks hold (halving until they do).

        Raises:
            ValueError: if ``num_steps`` exceeds :meth:`max_decode_run`.
        """
        if num_steps > self.max_decode_run(out):
            raise ValueError(f"num_steps {num_steps} exceeds max_decode_run()")
        decodes, contexts = out.decodes, out.decode_contexts
        bm, block_size = self.block_manager, self._block_size
        free = bm.num_free_blocks
        while num_steps > 1:
            extra, need = num_steps - 1, 0
            for i in range(len(decodes)):
                seq, num_tokens = decodes[i], contexts[i]
                if seq.kv_slots < num_tokens + extra:
                    need += -(-(num_tokens + extra) // block_size) - seq.kv_slots // block_size
            if need <= free:
                break
            num_steps //= 2
        if num_steps <= 1:
            return
        extra = num_steps - 1
        for i in range(len(decodes)):
            seq, num_tokens = decodes[i], contexts[i]
            if seq.kv_slots < num_tokens + extra:
                bm.grow(seq, num_tokens + extra)
        out.num_steps = num_steps
        if bm.kv_tiers is not None:  # growing may have moved cached blocks down
            moved = bm.pop_transfers()
            if out.kv_transfers is None:
                out.kv_transfers = moved
            else:
                out.kv_transfers.extend(moved)

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
            sampled_token_ids: one token id per item of ``out.sampling`` (executor;
                single-step outputs only), or None when only counts matter.

        Returns:
            The requests that finished in this step.

        Raises:
            ValueError: on a wrong number of end times or token ids.
        """
        ends = [float(end_times_s)] if isinstance(end_times_s, (int, float)) else end_times_s
        k = out.num_steps
        if len(ends) != k:
            raise ValueError(f"expected {k} end times, got {len(ends)}")
        self.step_log.append(ends, carries_decodes=out.phase is not _PREFILL)
        self.num_outputs += 1
        bm = self.block_manager
        self.max_used_blocks = max(self.max_used_blocks, bm.num_blocks - bm._num_free())
        tokens = iter(sampled_token_ids) if sampled_token_ids is not None else None
        end_s = float(ends[-1])
        finished: list[Sequence] = []
        for seq in out.decodes:
            seq.num_computed_tokens += k  # each step computes the last sampled token
            if tokens is None:  # counts only (the simulator): finish on length
                num_output = seq.num_output_tokens = seq.num_output_tokens + k
                if num_output >= seq.max_output_tokens:
                    self._finish_running(seq, end_s)
                    finished.append(seq)
            elif self._sampled(seq, next(tokens), out, end_s):
                finished.append(seq)
        for item in out.prefills:  # prefills only in single steps
            seq = item.seq
            seq.num_computed_tokens = item.num_context_tokens
            if not item.samples:
                continue
            self._start_decoding(seq)  # its prefill is complete: it samples its first token
            if self._sampled(seq, None if tokens is None else next(tokens), out, end_s):
                finished.append(seq)
        if finished:
            done = {s.seq_id for s in finished}
            self.running = [s for s in self.running if s.seq_id not in done]
            self.decoding = [s for s in self.decoding if s.seq_id not in done]
        if self._observes:
            self.policy.observe_step(_report(out, end_s))
        return finished

    def _start_decoding(self, seq: Sequence) -> None:
        """Move ``seq`` from the prefilling list to the decoding one (admission order)."""
        seq.in_prefill = False
        self.prefilling.remove(seq)
        decoding = self.decoding
        if not decoding or decoding[-1].admission_index < seq.admission_index:
            decoding.append(seq)
        else:
            bisect.insort(decoding, seq, key=_admission_order)

    def _sampled(
        self, seq: Sequence, token: int | None, out: SchedulerOutput, end_s: float
    ) -> bool:
        """Add a sampled token (its id when the backend gives one; one token per step
        of ``out``); returns True if the request finished."""
        stay = seq.stays[-1]
        if stay[0] is None:
            stay[0] = out.step_index
        seq.num_output_tokens += out.num_steps
        stop = False
        if token is not None:
            token = int(token)
            seq.output_token_ids.append(token)
            sampling = seq.request.sampling
            stop = not sampling.ignore_eos and token in sampling.stop_token_ids
        if not stop and seq.max_output_tokens > seq.num_output_tokens:
            return False
        self._finish_running(seq, end_s, stop_reason="stop" if stop else "length")
        return True

    def _finish_running(self, seq: Sequence, end_s: float, stop_reason: str = "length") -> None:
        """End a running request (the caller takes it out of ``running`` and ``decoding``)."""
        if not seq.request.sampling.ignore_eos:
            self._num_may_stop -= 1
        self._close_stay(seq)
        self.block_manager.free(seq)
        self._end(seq, _FINISHED, end_s, stop_reason=stop_reason)

    def _close_stay(self, seq: Sequence) -> None:
        if seq.stays and seq.stays[-1][1] is None:
            seq.stays[-1][1] = self.step_log.num_steps - 1

    def _end(
        self,
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
        self._live.pop(seq.request_id, None)
        self._ended.append(seq)

    # ------------------------------------------------------------------ checks
    def stall_message(self) -> str:
        """Why a run cannot go on when nothing is schedulable but requests wait."""
        return (
            f"policy {self.policy_name!r} admitted nothing with {len(self.waiting)} requests "
            "waiting and nothing running; the run would never finish"
        )

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
        assert len(self._live) == len(self.running) + len(self.waiting), "live map out of sync"
        assert self.prefilling == [s for s in self.running if s.in_prefill], "prefilling list"
        assert self.decoding == [s for s in self.running if not s.in_prefill], "decoding list"
        may_stop = sum(1 for s in self.running if not s.request.sampling.ignore_eos)
        assert may_stop == self._num_may_stop, "early-stopping count out of sync"
        if not self.has_unfinished():
            assert self.block_manager.num_used_blocks == 0, "KV blocks leaked"
