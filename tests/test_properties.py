"""Hypothesis properties over every registered policy, loop order and wrapper.

Invariants (DESIGN.md): every answer is a subset of the waiting queue with no
duplicates; FIFO-family answers are a prefix of the queue and pack's are in
arrival order; the token budget holds unless one request goes alone;
progress (a non-empty queue with a free seat gets an admission); force-FIFO
admits the head within N admission rounds; conservation (every request ends
exactly once, with its exact output length) and no KV block leaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from conftest import make_scheduler, records_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.interface import AdmissionPolicy, PolicyOptions, PolicyWrapper
from roseinfer.registry import load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler

REGISTRY = load_registry()
POLICIES = sorted(REGISTRY.policies)
ORDERS = sorted(REGISTRY.loop_orders)
FIFO_FAMILY = {"fifo", "budget"}


@dataclass
class Call:
    waiting: list[int]
    max_tokens: int | None
    max_seqs: int
    selection: list[int]
    costs: dict[int, int]
    round_index: int


class Spy(PolicyWrapper):
    """Wraps the run's admission policy and records every call."""

    name = "spy"

    def __init__(self, inner: AdmissionPolicy) -> None:
        super().__init__(inner, inner.options)
        self.calls: list[Call] = []

    def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
        selection = self.inner.admit(waiting, budget, ctx)
        window = list(waiting)
        self.calls.append(
            Call(
                waiting=[s.seq_id for s in window],
                max_tokens=budget.max_tokens,
                max_seqs=budget.max_seqs,
                selection=[s.seq_id for s in selection],
                costs={s.seq_id: ctx.cost(s) for s in window},
                round_index=ctx.admission_round,
            )
        )
        return selection


@st.composite
def workloads(draw) -> list[Request]:  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 24))
    shared = draw(st.lists(st.integers(0, 9), min_size=0, max_size=24))
    reqs, t = [], 0.0
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0]))
        own = draw(st.lists(st.integers(10, 99), min_size=1, max_size=40))
        ids = tuple(shared[: draw(st.integers(0, len(shared)))] + own)
        reqs.append(Request(f"r{i}", t, len(ids), draw(st.integers(1, 12)), prompt_token_ids=ids))
    return reqs


@st.composite
def configs(draw) -> dict:  # type: ignore[no-untyped-def]
    policy = draw(st.sampled_from(POLICIES))
    uses_budget = REGISTRY.policy(policy).uses_token_budget
    return {
        "policy": policy,
        "loop_order": draw(st.sampled_from(ORDERS)),
        "block_size": draw(st.sampled_from([1, 2, 4, 8])),
        "num_kv_blocks": draw(st.integers(8, 80)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "prefill_max_seqs": draw(st.one_of(st.none(), st.integers(1, 8))),
        "prefill_max_tokens": draw(st.one_of(st.none(), st.integers(1, 64)))
        if uses_budget
        else None,
        "enable_prefix_caching": draw(st.booleans()),
        "max_model_len": 64,
        "options": PolicyOptions(
            lookahead=draw(st.integers(1, 8)),
            force_fifo_every=draw(st.sampled_from([0, 0, 1, 2, 3])),
        ),
    }


def run(sched: Scheduler, reqs: list[Request], max_steps: int = 5000) -> None:
    """Drive with 1 s steps, releasing arrivals on time; check invariants each step."""
    now, i = 0.0, 0
    for _ in range(max_steps):
        while i < len(reqs) and reqs[i].arrival_time_s <= now:
            sched.add_request(reqs[i], now)
            i += 1
        out = sched.schedule(now)
        if out.is_empty:
            assert not sched.has_unfinished(), "stalled with work left"
            if i == len(reqs):
                return
            now = reqs[i].arrival_time_s
            continue
        now += 1.0
        sched.update(out, now)
        sched.block_manager.check_invariants()
    raise AssertionError("no progress within the step limit")


def spied(cfg: dict) -> tuple[Scheduler, Spy]:
    sched = make_scheduler(REGISTRY, **cfg)
    spy = Spy(sched.policy.admission)  # type: ignore[attr-defined]
    sched.policy.admission = spy  # type: ignore[attr-defined]
    return sched, spy


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_conservation_and_no_leaks(reqs: list[Request], cfg: dict) -> None:
    sched, _ = spied(cfg)
    run(sched, reqs)
    sched.check_invariants()
    df = records_of(sched)
    assert len(df) == len(reqs)
    assert df.request_id.is_unique
    finished = df[df.status == "finished"]
    want = {r.request_id: r.max_output_tokens for r in reqs}
    assert all(finished.num_output_tokens == finished.request_id.map(want))
    rejected = df[df.status == "rejected"]
    assert (rejected.reject_reason != "").all()
    assert sched.block_manager.num_used_blocks == 0
    assert (finished.first_token_s >= finished.arrival_s).all()
    assert (finished.finish_s >= finished.first_token_s).all()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_every_answer_is_valid_ordered_and_makes_progress(reqs: list[Request], cfg: dict) -> None:
    sched, spy = spied(cfg)
    run(sched, reqs)
    forced_every = cfg["options"].force_fifo_every
    for call in spy.calls:
        sel = call.selection
        assert len(set(sel)) == len(sel) and set(sel) <= set(call.waiting)
        assert sel, "non-empty queue with a free seat admitted nothing"
        assert len(sel) <= call.max_seqs
        positions = [call.waiting.index(s) for s in sel]
        assert positions == sorted(positions), "selection not in arrival order"
        forced = forced_every and call.round_index % forced_every == 0
        if cfg["policy"] in FIFO_FAMILY or forced:
            assert positions == list(range(len(sel))), "FIFO answer is not a queue prefix"
        if call.max_tokens is not None and len(sel) > 1:
            assert sum(call.costs[s] for s in sel) <= call.max_tokens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs(), every=st.integers(1, 4))
def test_force_fifo_bounds_starvation(reqs: list[Request], cfg: dict, every: int) -> None:
    cfg = {**cfg, "num_kv_blocks": 10_000, "policy": "pack", "prefill_max_tokens": 16}
    cfg["options"] = PolicyOptions(lookahead=cfg["options"].lookahead, force_fifo_every=every)
    sched, spy = spied(cfg)
    run(sched, reqs)
    admitted_round: dict[int, int] = {}
    for call in spy.calls:
        for s in call.selection:
            admitted_round.setdefault(s, call.round_index)
    for call in spy.calls:
        head = call.waiting[0]
        if admitted_round.get(head, call.round_index) >= call.round_index:
            assert admitted_round[head] - call.round_index < every, (
                f"head {head} waited {admitted_round[head] - call.round_index} rounds"
            )
