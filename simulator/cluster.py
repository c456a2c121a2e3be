"""A cluster of simulated replicas behind a router.

Each replica is a full scheduler (its own KV pool and prefix cache) priced by
its own cost model, so replicas may differ in model, device and pool size.
The cluster is one discrete-event loop over three kinds of events, taken in
time order from a heap (O(log replicas) per event): a replica's step completes (its results are applied), a request
arrives (the router picks a replica and the request joins its queue), a
replica starts its next step. At equal times completions come first, then
arrivals, then starts, so a replica sees every request that arrived by the
time it plans, as :func:`roseinfer.driver.drive` does for one replica. A step
is planned at its start and applied at its end; a request routed meanwhile
waits for the end of that step. Uneventful decode runs stop at the step in
which the next cluster arrival falls (it may be routed there).

With prefill and decode replicas (``ReplicaSpec.role``) the cluster is
disaggregated (``roseinfer.simulator.disaggregation``): an arriving request is
routed to a prefill replica, which computes its prompt and first token; when
that step ends the router picks a decode replica for it, the KV moves there
(:class:`~roseinfer.simulator.disaggregation.KVTransfer`), and the request joins
that replica's queue when the KV has arrived, a fourth kind of event taken in
time order with the arrivals. A decode run then also stops at the next KV
arrival or the end of the next prefill step in flight.

The router reads each replica through a :class:`~roseinfer.routing.ReplicaView`
refreshed at most every ``router_staleness_s`` simulated seconds (0: at every
arrival); prefix-cache contents are always read live (see
``roseinfer.routing``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from roseinfer.block_manager import compute_block_hashes
from roseinfer.calibration.cost_model import CostModel
from roseinfer.calibration.specs import LinkSpec
from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepResult, apply_step, plan_step, start_replay
from roseinfer.interface import PolicyError
from roseinfer.metrics import LogHistogram, summarize
from roseinfer.records import RecordBuilder
from roseinfer.registry import Registry, load_registry
from roseinfer.request import Request
from roseinfer.routing import ROLES, ReplicaView, Router
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import SeqStatus, Sequence
from roseinfer.simulator.disaggregation import (
    Handoff,
    KVTransfer,
    decode_stage,
    handoff_gaps_s,
    merge_stages,
    prefill_stage,
    stage_report,
)
from roseinfer.simulator.engine import CostModelBackend

if TYPE_CHECKING:
    import pandas as pd
else:
    from roseinfer.metrics.lazy import pandas as pd


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica of a cluster.

    Attributes:
        name: label in summaries, e.g. ``llama-3.1-8b@h100-sxm``.
        config: its scheduler config (KV pool, limits, policy).
        cost_model: prices its steps.
        role: ``mixed`` (whole requests), ``prefill`` or ``decode``
            (disaggregated; ``roseinfer.routing.ROLES``). A decode replica
            runs the ``mixed`` loop order whatever the config says: a request
            handed to it computes one token (the KV of its first output) in
            the running batch, as DistServe's and vLLM's decode instances do.
        kv_bytes_per_token: bytes of KV one token takes, all GPUs of the
            replica together (prices KV handoffs; needed by prefill replicas).
        num_gpus: GPUs the replica spans (tensor x pipeline parallel size);
            a handoff moves each GPU's shard over its own link.

    Raises:
        ValueError: on an unknown role, a negative ``kv_bytes_per_token`` or
            fewer than one GPU.
    """

    name: str
    config: SchedulerConfig
    cost_model: CostModel
    role: str = "mixed"
    kv_bytes_per_token: float = 0.0
    num_gpus: int = 1

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"replica {self.name}: role must be one of {ROLES}, got {self.role!r}")
        if not self.kv_bytes_per_token >= 0 or self.num_gpus < 1:
            raise ValueError(f"replica {self.name}: kv_bytes_per_token >= 0 and num_gpus >= 1")


class _Replica:
    """A scheduler, its backend and records, and its place on the event clock."""

    def __init__(
        self, index: int, spec: ReplicaSpec, registry: Registry, jump: bool, keep_token_times: bool
    ) -> None:
        # a decode replica's newcomers join its running batch (DistServe's and vLLM's
        # decode instances): their one uncomputed token is no phase of its own
        loop_order = "mixed" if spec.role == "decode" else spec.config.loop_order
        policy = registry.make(spec.config.policy, loop_order, spec.config.options)
        self.index, self.spec, self.policy_label = index, spec, policy.label
        self.scheduler = Scheduler(spec.config, policy, policy.label)
        self.backend = CostModelBackend(spec.cost_model, jump=jump, stream=index)
        self.records = RecordBuilder(keep_token_times=keep_token_times)
        self.version = 0  # bumps whenever its next event changes (the heap's stale entries)
        self.time_s = 0.0  # end of the step in flight, or when it last went idle
        self.start_s = 0.0  # start of the step in flight
        self.pending: tuple[SchedulerOutput, StepResult] | None = None
        self.stalled = False  # planned nothing with work queued: wait for a new request
        self.routed_tokens = 0  # prompt + output tokens of requests routed here
        self.ended_tokens = 0  # ... of which ended
        self.num_routed = 0
        self.busy_s = 0.0  # simulated seconds spent in steps
        self.prefilled: list[Sequence] = []  # prefill role: stages ended, to hand off

    def book(self, request: Request) -> None:
        """Count ``request`` as routed here (the router's load view) from now on."""
        self.routed_tokens += request.max_num_tokens
        self.num_routed += 1

    def add(self, request: Request, block_hashes: dict[int, list[int]]) -> None:
        """Queue ``request`` (booked already) at its arrival time, handing over the
        prompt block hashes the router computed (by block size) so they are not
        hashed twice."""
        seq = self.scheduler.add_request(request, request.arrival_time_s)
        hashes = block_hashes.get(self.spec.config.block_size)
        if hashes is not None and seq.block_hashes is None:
            seq.block_hashes = hashes
        if self.pending is None:
            self.time_s = max(self.time_s, request.arrival_time_s)
        self.stalled = False
        self._flush()

    def complete(self) -> None:
        """Apply the step in flight (it ends at ``time_s``)."""
        assert self.pending is not None
        out, result = self.pending
        self.pending = None
        apply_step(self.scheduler, out, self.start_s, result)
        self._flush()

    def start(self, next_arrival_s: float) -> None:
        """Plan and price the next step at ``time_s``."""
        now = self.time_s
        out, result = plan_step(self.scheduler, self.backend, now, next_arrival_s)
        if result is None:
            self.stalled = True
            self._flush()
            return
        self.pending = (out, result)
        self.start_s, self.time_s = now, float(result.end_times_s[-1])
        self.busy_s += self.time_s - now

    def _flush(self) -> None:
        ended = self.scheduler.pop_ended()
        if ended:
            if self.spec.role == "prefill":
                self.prefilled += [s for s in ended if s.status is SeqStatus.FINISHED]
            self.ended_tokens += sum(s.request.max_num_tokens for s in ended)
            self.records.extend(ended, self.scheduler.step_log)
            self.scheduler.release_steps()

    def next_event(self) -> tuple[float, int, int] | None:
        """(time, 0 for a completion or 1 for a start, index), or None when idle."""
        if self.pending is not None:
            return (self.time_s, 0, self.index)
        if self.stalled or not self.scheduler.has_unfinished():
            return None
        return (self.time_s, 1, self.index)

    def view(self, prefix_blocks: Callable[[Request], int]) -> ReplicaView:
        """The router's snapshot of this replica now."""
        sched, cfg = self.scheduler, self.spec.config
        return ReplicaView(
            index=self.index,
            name=self.spec.name,
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            outstanding_tokens=self.routed_tokens - self.ended_tokens,
            num_kv_blocks=cfg.num_kv_blocks,
            num_free_blocks=sched.block_manager.num_free_blocks,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            prefix_blocks=prefix_blocks,
            role=self.spec.role,
        )


@dataclass(slots=True)
class ClusterResult:
    """What a simulated cluster run produced.

    Attributes:
        records: one row per request (``roseinfer.metrics.schema``) plus
            ``replica`` (the index of the replica that served it), in arrival order.
        replicas: the specs, in index order.
        schedulers: each replica's scheduler after the run.
        router: the router's name.
        policy: the replicas' composed policy labels, joined by ``,`` when they differ.
        wall_s: wall-clock seconds the simulation took.
        num_steps: engine steps simulated, all replicas together.
        itl: without kept token times, the inter-token gaps of the whole cluster
            as a histogram (``summarize(records, itl=result.itl)``), and
            ``replica_itl`` each replica's.
        busy_s: simulated seconds each replica spent in steps.
        stage_records: disaggregated runs only: each replica's own rows (a
            request's prefill and decode stages apart, column ``stage``), of
            which ``records`` joins each request's two rows into one.
        disaggregation: disaggregated runs only: per-stage queueing and KV
            transfer figures (``roseinfer.simulator.disaggregation.stage_report``).
        handoffs: disaggregated runs only: every KV handoff, in the order made.
    """

    records: pd.DataFrame
    replicas: list[ReplicaSpec]
    schedulers: list[Scheduler]
    router: str
    policy: str
    wall_s: float
    num_steps: int
    info: dict[str, object] = field(default_factory=dict)
    itl: LogHistogram | None = None
    replica_itl: list[LogHistogram | None] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)
    stage_records: pd.DataFrame | None = None
    disaggregation: dict[str, float | str | int] | None = None
    handoffs: list[Handoff] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Simulated seconds from the first arrival to the last step end (any replica)."""
        ends = [float(s.step_log.end_s[-1]) for s in self.schedulers if s.step_log.num_steps]
        if not ends:
            return 0.0
        first = float(self.records["arrival_s"].min()) if len(self.records) else 0.0
        return max(ends) - first

    def replica_summaries(self, goodput: dict[str, float] | None = None) -> pd.DataFrame:
        """One summary row per replica (``summarize`` keys plus ``replica``, ``name``,
        ``role`` and ``utilization``, the fraction of the duration it spent in
        steps), each over the cluster's duration so throughputs add up. A
        disaggregated replica's row summarizes the stage it served (a prefill
        replica's TTFT, a decode replica's TPOT)."""
        rows = []
        own = self.records if self.stage_records is None else self.stage_records
        duration = self.duration_s
        for i, spec in enumerate(self.replicas):
            mine = own[own["replica"] == i]
            itl = self.replica_itl[i] if self.replica_itl else None
            summary = summarize(mine, duration_s=duration, goodput=goodput, itl=itl)
            busy = self.busy_s[i] / duration if self.busy_s and duration > 0 else float("nan")
            rows.append({"replica": i, "name": spec.name, "role": spec.role,
                         "utilization": busy, **summary})  # fmt: skip
        return pd.DataFrame(rows)


class ClusterSimulator:
    """Replays requests through N replicas behind a router.

    Args:
        replicas: one spec per replica (>= 1).
        router: the routing policy instance.
        registry: plugin registry (default: built-ins plus entry points).
        jump: plan uneventful decode runs as one multi-step output.
        router_staleness_s: the router's replica views are refreshed when at
            least this many simulated seconds passed since the last refresh
            (0 = fresh at every arrival).
        keep_token_times: keep every token's time in the records; False keeps an
            ITL histogram per replica instead (memory flat in trace length).
        decode_router: disaggregated: routes the decode stage (default: a second
            instance of ``router``'s class with its options).
        kv_transfer_link: disaggregated: the link KV handoffs cross.

    Raises:
        ValueError: on no replicas, a negative staleness, or a disaggregated
            cluster without prefill or decode replicas, with mixed ones, or
            without ``kv_transfer_link`` or the prefill replicas' KV size.
    """

    def __init__(
        self,
        replicas: SequenceABC[ReplicaSpec],
        router: Router,
        registry: Registry | None = None,
        *,
        jump: bool = True,
        router_staleness_s: float = 0.0,
        keep_token_times: bool = True,
        decode_router: Router | None = None,
        kv_transfer_link: LinkSpec | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("a cluster needs at least one replica")
        if router_staleness_s < 0:
            raise ValueError(f"--router-staleness-s must be >= 0, got {router_staleness_s}")
        self.specs = list(replicas)
        self.router = router
        self.registry = registry if registry is not None else load_registry()
        self.jump = jump
        self.router_staleness_s = router_staleness_s
        self.keep_token_times = keep_token_times
        self.disaggregated = _check_roles(self.specs, kv_transfer_link)
        self.decode_router = decode_router or type(router)(router.seed, router.options)
        self.kv_transfer_link = kv_transfer_link

    def run(self, requests: SequenceABC[Request]) -> ClusterResult:
        """Simulate ``requests`` (any order) to completion.

        Raises:
            PolicyError: if a policy answer is invalid or a replica stalls.
            RouterError: if the router answers something invalid.
        """
        start = time.perf_counter()
        reqs = sorted(requests, key=lambda r: r.arrival_time_s)
        keep = self.keep_token_times
        reps = [_Replica(i, s, self.registry, self.jump, keep) for i, s in enumerate(self.specs)]
        transfer = None
        if self.disaggregated:
            assert self.kv_transfer_link is not None
            transfer = KVTransfer(self.kv_transfer_link, len(reps))
        for rep in reps:  # fit length predictors, warn once of missing inputs
            start_replay(rep.scheduler, reqs)
        loop = _EventLoop(reps, self.router, self.router_staleness_s, self.decode_router, transfer)
        loop.run(reqs)
        frames = []
        for rep in reps:
            rep.scheduler.check_invariants()
            frame = rep.records.drain()  # NOTE: the rows go as the frame is made
            frame["replica"] = rep.index
            if self.disaggregated:
                frame["stage"] = rep.spec.role
            frames.append(frame)
        records = pd.concat(frames, ignore_index=True)
        itl = _merged([rep.records.itl for rep in reps])
        stages, report = None, None
        if transfer is not None:
            stages, report = records, stage_report(records, loop.handoffs, transfer.link)
            records = merge_stages(records, loop.handoffs)
            if itl is not None:  # the gaps across handoffs are no replica's
                itl = _merged([itl])
                assert itl is not None
                itl.add(handoff_gaps_s(stages))
        records = records.sort_values("arrival_s", kind="stable").reset_index(drop=True)
        labels = list(dict.fromkeys(rep.policy_label for rep in reps))
        return ClusterResult(
            records=records,
            replicas=self.specs,
            schedulers=[rep.scheduler for rep in reps],
            router=self.router.name,
            policy=",".join(labels),
            wall_s=time.perf_counter() - start,
            num_steps=sum(rep.scheduler.step_log.num_steps for rep in reps),
            info={"routed": [rep.num_routed for rep in reps]},
            itl=itl,
            replica_itl=[rep.records.itl for rep in reps],
            busy_s=[rep.busy_s for rep in reps],
            stage_records=stages,
            disaggregation=report,
            handoffs=loop.handoffs,
        )


def _check_roles(specs: list[ReplicaSpec], link: LinkSpec | None) -> bool:
    """True for a disaggregated cluster (prefill and decode replicas).

    Raises:
        ValueError: on a mix of roles that cannot serve every request, or a
            disaggregated cluster without a link or without the KV size.
    """
    roles = {s.role for s in specs}
    if roles == {"mixed"}:
        return False
    if roles != {"prefill", "decode"}:
        raise ValueError(
            f"a disaggregated cluster needs prefill and decode replicas and no mixed ones; "
            f"got roles {sorted(roles)}"
        )
    if link is None:
        raise ValueError("a disaggregated cluster needs the link its KV handoffs cross")
    if any(s.role == "prefill" and not s.kv_bytes_per_token > 0 for s in specs):
        raise ValueError("a prefill replica needs kv_bytes_per_token > 0 to price its handoffs")
    return True


class _EventLoop:
    """The cluster's event loop (see the module docstring for the order of events)."""

    def __init__(
        self,
        replicas: list[_Replica],
        router: Router,
        staleness_s: float,
        decode_router: Router,
        transfer: KVTransfer | None,
    ) -> None:
        self.replicas, self.router, self.staleness_s = replicas, router, staleness_s
        self.decode_router, self.transfer = decode_router, transfer
        self.prefill_replicas = [r for r in replicas if r.spec.role == "prefill"]
        self.handoffs: list[Handoff] = []
        self._moving: list[tuple[float, int, Request, int, dict[int, list[int]]]] = []  # heap
        self._originals: dict[str, Request] = {}  # disaggregated: requests in their prefill
        self._views: list[ReplicaView] = []
        self._views_s = -math.inf
        self._ended_at_view: list[int] = []
        self._hashes: dict[int, list[int]] = {}  # block size -> hashes of the request routed

    def run(self, reqs: list[Request]) -> None:
        heap: list[tuple[float, int, int, int]] = []  # (time, kind, index, version)

        def push(rep: _Replica) -> None:
            rep.version += 1  # the replica's older heap entries are now stale
            event = rep.next_event()
            if event is not None:
                heapq.heappush(heap, (*event, rep.version))

        for rep in self.replicas:
            push(rep)
        i, n = 0, len(reqs)
        moving = self._moving
        while True:
            while heap and heap[0][3] != self.replicas[heap[0][2]].version:
                heapq.heappop(heap)
            next_arrival = reqs[i].arrival_time_s if i < n else math.inf
            next_ready = moving[0][0] if moving else math.inf
            next_in = min(next_arrival, next_ready)
            if not heap and next_in == math.inf:
                break
            # completions first, then arrivals and KV arrivals, then starts
            if not heap or next_in < heap[0][0] or (next_in == heap[0][0] and heap[0][1] == 1):
                if next_ready <= next_arrival:
                    _, _, request, index, hashes = heapq.heappop(moving)
                    rep = self.replicas[index]
                    rep.add(request, hashes)
                else:
                    rep = self._arrive(reqs[i])
                    i += 1
                push(rep)
                continue
            _, kind, index, _ = heapq.heappop(heap)
            rep = self.replicas[index]
            if kind == 0:
                rep.complete()
                if rep.prefilled:
                    for target in self._hand_off(rep):
                        push(target)
            else:
                rep.start(min(next_in, self._next_prefill_end()))
            push(rep)
        for rep in self.replicas:
            if rep.scheduler.has_unfinished():
                raise PolicyError(f"replica {rep.index}: {rep.scheduler.stall_message()}")

    def _arrive(self, request: Request) -> _Replica:
        """Route an arriving request (its prefill stage when disaggregated) and queue it."""
        now = request.arrival_time_s
        if self.transfer is None:
            chosen = self._route(request, now, "mixed", self.router)
        else:
            self._originals[request.request_id] = request
            request = prefill_stage(request)
            chosen = self._route(request, now, "prefill", self.router)
        chosen.book(request)
        chosen.add(request, self._hashes)
        return chosen

    def _hand_off(self, rep: _Replica) -> list[_Replica]:
        """Send the requests ``rep`` just prefilled on to decode replicas: route each,
        book its KV transfer, and queue its arrival there. Returns the replicas
        booked (their views changed)."""
        assert self.transfer is not None
        booked = []
        for seq in rep.prefilled:
            original = self._originals.pop(seq.request.request_id)
            if original.max_output_tokens < 2:
                continue  # the prefill stage sampled its only token
            now = float(seq.finish_s)  # type: ignore[arg-type]
            staged = decode_stage(original, now)
            dst = self._route(staged, now, "decode", self.decode_router)
            view = self._views[dst.index]
            cached = view.cached_prefix_blocks(staged) * view.block_size
            num_tokens = max(0, original.num_prompt_tokens - cached)
            num_bytes = num_tokens * rep.spec.kv_bytes_per_token
            gpus = min(rep.spec.num_gpus, dst.spec.num_gpus)
            start, ready = self.transfer.schedule(rep.index, dst.index, now, num_bytes, gpus)
            self.handoffs.append(
                Handoff(original.request_id, rep.index, dst.index, now, start, ready,
                        num_tokens, num_bytes)
            )  # fmt: skip
            staged = decode_stage(original, ready)
            dst.book(staged)
            heapq.heappush(
                self._moving, (ready, len(self.handoffs), staged, dst.index, self._hashes)
            )
            booked.append(dst)
        rep.prefilled.clear()
        return booked

    def _next_prefill_end(self) -> float:
        """No handoff comes before this: the earliest end of a prefill step in
        flight, or start of one about to be planned (an idle prefill replica
        waits for an arrival, which bounds decode runs already)."""
        events = [r.next_event() for r in self.prefill_replicas]
        return min((e[0] for e in events if e is not None), default=math.inf)

    def _route(self, request: Request, now: float, stage: str, router: Router) -> _Replica:
        if not self._views or now - self._views_s >= self.staleness_s:
            self._views = [rep.view(self._prefix_query(rep)) for rep in self.replicas]
            self._ended_at_view = [rep.ended_tokens for rep in self.replicas]
            self._views_s = now
        else:  # stale load, but the router counts what it sent at once
            self._views = [
                replace(v, outstanding_tokens=rep.routed_tokens - ended)
                for v, rep, ended in zip(self._views, self.replicas, self._ended_at_view)
            ]
        self._hashes = {}
        return self.replicas[router.route(request, self._views, now, stage)]

    def _prefix_query(self, rep: _Replica) -> Callable[[Request], int]:
        bm = rep.scheduler.block_manager

        def query(request: Request) -> int:
            hashes = self._hashes.get(bm.block_size)
            if hashes is None:
                hashes = compute_block_hashes(request, bm.block_size)
                self._hashes[bm.block_size] = hashes
            return bm.num_cached_prefix_blocks(hashes)

        return query


def simulate_cluster(
    requests: SequenceABC[Request],
    replicas: SequenceABC[ReplicaSpec],
    router: Router,
    *,
    registry: Registry | None = None,
    jump: bool = True,
    router_staleness_s: float = 0.0,
    keep_token_times: bool = True,
    decode_router: Router | None = None,
    kv_transfer_link: LinkSpec | None = None,
) -> ClusterResult:
    """Run one cluster simulation; see :class:`ClusterSimulator`."""
    sim = ClusterSimulator(
        replicas, router, registry, jump=jump, router_staleness_s=router_staleness_s,
        keep_token_times=keep_token_times, decode_router=decode_router,
        kv_transfer_link=kv_transfer_link,
    )  # fmt: skip
    return sim.run(requests)


def _merged(histograms: list[LogHistogram | None]) -> LogHistogram | None:
    """One histogram of every replica's gaps (None when token times were kept)."""
    if any(h is None for h in histograms):
        return None
    merged = LogHistogram()
    for h in histograms:
        assert h is not None
        merged.merge(h)
    return merged
