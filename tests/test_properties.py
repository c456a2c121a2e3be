"""Hypothesis properties over every registered policy, loop order and wrapper.

Universal invariants (DESIGN.md), for every policy: every answer is a subset of
the waiting queue with no duplicates, within the seat limit and the token
budget (unless one request goes alone); progress (a non-empty queue with a free
seat gets an admission); conservation (every request ends exactly once, with
its exact output length); no KV block leaks; no step computes more than
``max_num_batched_tokens``; every prompt token is computed exactly once per
admission (recompute after a preemption counted apart). Declared guarantees,
for the policies that declare them: arrival order (``preserves_arrival_order``),
a queue prefix (``admits_queue_prefix``), force-FIFO's starvation bound, and
the names in a policy's ``guarantees``: ``ranked-prefix`` (every selection is
the best-ranked prefix of the queue under its ``rank``), ``strict-priority``
(no admitted request is less urgent than one left waiting), ``aging-bound``
(``lpm``: a request older than the aging bound is passed only by older ones),
``vtc-bound`` (VTC's service-difference bound between backlogged tenants);
``hrrn`` is passed only by strictly shorter later arrivals. Every policy
admits a request at most once per stay (once, plus once per preemption).

Policies include the README's third-party example (``ShortestFirst``), which
declares no order: it must pass the universal invariants, and only those.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from conftest import make_scheduler, records_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.interface import AdmissionPolicy, Phase, PolicyOptions, PolicyWrapper
from roseinfer.registry import Entry, Registry, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler


def readme_plugin() -> type[AdmissionPolicy]:
    """The ``ShortestFirst`` plugin of README.md's "Writing a plugin", as written."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"```python\n(# my_policies\.py\n.*?)```", readme, re.S)
    assert code, "README.md lost its plugin example"
    namespace: dict = {}
    exec(code.group(1), namespace)  # noqa: S102 - our own README
    return namespace["ShortestFirst"]


class RandomPhases(AdmissionPolicy):
    """A loop order answering random phase tuples (1-5 long, repeats allowed)."""

    name = "random-phases"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options)
        self.rng = random.Random(int((options or PolicyOptions()).get("seed", "0")))

    def order(self, ctx):  # type: ignore[no-untyped-def]
        return tuple(self.rng.choice(list(Phase)) for _ in range(self.rng.randint(1, 5)))


def make_registry() -> Registry:
    reg = load_registry()
    reg.policies["shortest-first"] = Entry(readme_plugin(), "README example")
    reg.loop_orders["random-phases"] = Entry(RandomPhases, "test")
    return reg


REGISTRY = make_registry()
POLICIES = sorted(REGISTRY.policies)
ORDERS = sorted(REGISTRY.loop_orders)
PREDICTORS = sorted(REGISTRY.predictors)
MAX_MODEL_LEN = 64


@dataclass
class Call:
    waiting: list[int]
    max_tokens: int | None
    max_seqs: int
    selection: list[int]
    tokens: dict[int, int]  # chunk asked for, else the cost
    round_index: int
    now_s: float = 0.0
    ranked: list[int] | None = None  # waiting ids by the base policy's rank, if it has one
    arrival: dict[int, float] | None = None
    priority: dict[int, int] | None = None


class Spy(PolicyWrapper):
    """Wraps the run's admission policy and records every call."""

    name = "spy"

    def __init__(self, inner: AdmissionPolicy) -> None:
        super().__init__(inner, inner.options)
        self.calls: list[Call] = []

    def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
        base = self.inner
        while isinstance(base, PolicyWrapper):
            base = base.inner
        ranked = None
        if type(base).ranks():
            ranked = [s.seq_id for s in sorted(waiting, key=lambda s: base.rank(s, ctx))]
        answer = self.inner.admit(waiting, budget, ctx)
        pairs = [c if isinstance(c, tuple) else (c, ctx.cost(c)) for c in answer]
        self.calls.append(
            Call(
                waiting=[s.seq_id for s in waiting],
                max_tokens=budget.max_tokens,
                max_seqs=budget.max_seqs,
                selection=[s.seq_id for s, _ in pairs],
                tokens={s.seq_id: n for s, n in pairs},
                round_index=ctx.admission_round,
                now_s=ctx.now_s,
                ranked=ranked,
                arrival={s.seq_id: s.request.arrival_time_s for s in waiting},
                priority={s.seq_id: s.request.priority for s in waiting},
            )
        )
        return answer


@st.composite
def workloads(draw) -> list[Request]:  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 24))
    shared = draw(st.lists(st.integers(0, 9), min_size=0, max_size=24))
    reqs, t = [], 0.0
    for i in range(n):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 3.0]))
        own = draw(st.lists(st.integers(10, 99), min_size=1, max_size=40))
        ids = tuple(shared[: draw(st.integers(0, len(shared)))] + own)
        reqs.append(
            Request(
                f"r{i}",
                t,
                len(ids),
                draw(st.integers(1, 12)),
                prompt_token_ids=ids,
                tenant=draw(st.sampled_from([None, "a", "b"])),
                priority=draw(st.integers(0, 2)),
                deadline_s=draw(st.sampled_from([None, 0.5, 2.0, 8.0])),
            )
        )
    return reqs


@st.composite
def configs(draw) -> dict:  # type: ignore[no-untyped-def]
    policy = draw(st.sampled_from(POLICIES))
    cls = REGISTRY.policy(policy)
    max_num_seqs = draw(st.integers(1, 8))
    chunked = draw(st.booleans())
    batched = draw(st.one_of(st.none(), st.integers(max_num_seqs, 48)))
    if not chunked and batched is not None:
        batched = max(batched, MAX_MODEL_LEN)
    threshold = draw(st.one_of(st.none(), st.integers(1, 16))) if chunked else None
    if chunked and batched is None and threshold is None:
        threshold = draw(st.integers(1, 16))
    return {
        "policy": policy,
        "loop_order": draw(st.sampled_from(ORDERS)),
        "block_size": draw(st.sampled_from([1, 2, 4, 8])),
        "num_kv_blocks": draw(st.integers(8, 80)),
        "max_num_seqs": max_num_seqs,
        "prefill_max_seqs": draw(st.one_of(st.none(), st.integers(1, 8))),
        "prefill_max_tokens": draw(st.one_of(st.none(), st.integers(1, 64)))
        if cls.uses_token_budget
        else None,
        "max_num_batched_tokens": batched,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
        "max_num_partial_prefills": draw(st.one_of(st.none(), st.integers(1, 3)))
        if chunked
        else None,
        "enable_prefix_caching": draw(st.booleans()),
        "max_model_len": MAX_MODEL_LEN,
        "options": PolicyOptions(
            lookahead=draw(st.integers(1, 8)),
            force_fifo_every=draw(st.sampled_from([0, 0, 1, 2, 3])),
            chunk_head=chunked and cls.declares("chunk_head") and draw(st.booleans()),
            extra={
                "seed": str(draw(st.integers(0, 99))),
                "length_predictor": draw(st.sampled_from(PREDICTORS)),
                "drop_late": draw(st.booleans()),
                "lpm_aging_s": draw(st.sampled_from([0.5, 2.0, 5.0])),
            },
        ),
    }


class PrefillLedger:
    """Checks that a (re)prefill computes each uncached token exactly once."""

    def __init__(self) -> None:
        self.expected: dict[int, int] = {}  # seq_id -> tokens its prefill must compute
        self.computed: dict[int, int] = {}

    def step(self, out) -> None:  # type: ignore[no-untyped-def]
        for seq in out.preempted:  # recompute is counted apart: start over
            self.expected.pop(seq.seq_id, None)
            self.computed.pop(seq.seq_id, None)
        for item in out.prefills:
            sid = item.seq.seq_id
            if sid not in self.expected:  # first chunk of this stay
                self.expected[sid] = item.seq.num_tokens - item.num_computed_tokens
                self.computed[sid] = 0
            assert (
                item.num_computed_tokens
                == item.seq.num_tokens - self.expected[sid] + (self.computed[sid])
            ), "a chunk does not start where the last one ended"
            self.computed[sid] += item.num_new_tokens
            if item.samples:
                assert self.computed.pop(sid) == self.expected.pop(sid), "prefill miscounted"


def run(sched: Scheduler, reqs: list[Request], max_steps: int = 5000) -> None:
    """Drive with 1 s steps, releasing arrivals on time; check invariants each step."""
    cap = sched.config.max_num_batched_tokens
    ledger = PrefillLedger()
    now, i = 0.0, 0
    for _ in range(max_steps):
        while i < len(reqs) and reqs[i].arrival_time_s <= now:
            sched.add_request(reqs[i], now)
            i += 1
        out = sched.schedule(now)
        ledger.step(out)
        if out.is_empty:
            assert not sched.has_unfinished(), "stalled with work left"
            if i == len(reqs):
                return
            now = reqs[i].arrival_time_s
            continue
        assert cap is None or out.num_batched_tokens <= cap, "step over max_num_batched_tokens"
        now += 1.0
        sched.update(out, now)
        sched.block_manager.check_invariants()
    raise AssertionError("no progress within the step limit")


def spied(cfg: dict) -> tuple[Scheduler, Spy]:
    sched = make_scheduler(REGISTRY, **cfg)
    spy = Spy(sched.policy.admission)  # type: ignore[attr-defined]
    sched.policy.admission = spy  # type: ignore[attr-defined]
    return sched, spy


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_conservation_budgets_and_no_leaks(reqs: list[Request], cfg: dict) -> None:
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


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_every_answer_is_valid_makes_progress_and_keeps_declared_order(
    reqs: list[Request], cfg: dict
) -> None:
    sched, spy = spied(cfg)
    run(sched, reqs)
    policy = REGISTRY.policy(cfg["policy"])
    forced_every = cfg["options"].get("force_fifo_every", 0)
    for call in spy.calls:
        sel = call.selection
        assert len(set(sel)) == len(sel) and set(sel) <= set(call.waiting)
        assert sel, "non-empty queue with a free seat admitted nothing"
        assert len(sel) <= call.max_seqs
        if call.max_tokens is not None and len(sel) > 1:
            assert sum(call.tokens[s] for s in sel) <= call.max_tokens
        positions = [call.waiting.index(s) for s in sel]
        forced = forced_every and call.round_index % forced_every == 0
        if policy.preserves_arrival_order or policy.admits_queue_prefix or forced:
            assert positions == sorted(positions), "selection not in arrival order"
        if policy.admits_queue_prefix or forced:
            assert positions == list(range(len(sel))), "FIFO answer is not a queue prefix"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs(), every=st.integers(1, 4))
def test_force_fifo_bounds_starvation(reqs: list[Request], cfg: dict, every: int) -> None:
    cfg = {**cfg, "num_kv_blocks": 10_000, "policy": "pack", "prefill_max_tokens": 16}
    cfg["options"] = cfg["options"].replace(force_fifo_every=every, chunk_head=False)
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


def test_the_readme_plugin_declares_no_order_and_is_exercised() -> None:
    cls = REGISTRY.policy("shortest-first")
    assert not cls.preserves_arrival_order and not cls.admits_queue_prefix
    assert "random-phases" in ORDERS and "mixed" in ORDERS


def declares(policy: str, guarantee: str) -> bool:
    return guarantee in REGISTRY.policy(policy).guarantees


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_declared_rank_order_priority_and_aging(reqs: list[Request], cfg: dict) -> None:
    sched, spy = spied(cfg)
    run(sched, reqs)
    policy, every = cfg["policy"], cfg["options"].get("force_fifo_every", 0)
    aging_s = float(cfg["options"].get("lpm_aging_s", 5.0))
    for call in spy.calls:
        if every and call.round_index % every == 0:
            continue  # a force-FIFO round
        sel, arrival = call.selection, call.arrival or {}
        left = [s for s in call.waiting if s not in sel]
        if declares(policy, "ranked-prefix"):
            assert call.ranked is not None and sel == call.ranked[: len(sel)], "not the best-ranked"
        if declares(policy, "strict-priority") and sel and left:
            prio = call.priority or {}
            assert max(prio[s] for s in sel) <= min(prio[s] for s in left), "priority inverted"
        if declares(policy, "aging-bound"):
            for b in left:
                if call.now_s - arrival[b] >= aging_s:
                    assert all(arrival[a] <= arrival[b] for a in sel), "aged request passed"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_hrrn_is_passed_only_by_shorter_later_arrivals(reqs: list[Request], cfg: dict) -> None:
    cfg = {**cfg, "policy": "hrrn", "prefill_max_tokens": None, "options": PolicyOptions()}
    sched, spy = spied(cfg)
    run(sched, reqs)
    outputs = {i: r.max_output_tokens for i, r in enumerate(reqs)}  # oracle = true length
    for call in spy.calls:
        arrival = call.arrival or {}
        for b in (s for s in call.waiting if s not in call.selection):
            for a in call.selection:
                if arrival[a] > arrival[b]:
                    assert outputs[a] < outputs[b], f"{a} (later, not shorter) passed {b}"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workloads(), cfg=configs())
def test_no_request_is_admitted_twice_per_stay(reqs: list[Request], cfg: dict) -> None:
    sched, _ = spied(cfg)
    admissions: dict[int, int] = {}
    stays: dict[int, int] = {}
    orig = sched._admit  # count real admissions, whatever the policy answered

    def counting(seq, *args):  # type: ignore[no-untyped-def]
        item = orig(seq, *args)
        if item is not None:
            admissions[seq.seq_id] = admissions.get(seq.seq_id, 0) + 1
        return item

    sched._admit = counting  # type: ignore[method-assign]
    run(sched, reqs)
    for seq in sched.pop_ended():
        stays[seq.seq_id] = len(seq.stays)
        assert (
            admissions.get(seq.seq_id, 0)
            == len(seq.stays)
            == (seq.num_preemptions + 1 if seq.stays else 0)
        ), f"{seq}: {admissions.get(seq.seq_id)} admissions, {seq.num_preemptions} preemptions"
    assert len(stays) == len(reqs), "a request was lost"


@st.composite
def backlogged_tenants(draw) -> list[Request]:  # type: ignore[no-untyped-def]
    reqs = []
    for i in range(draw(st.integers(8, 40))):
        tenant = draw(st.sampled_from(["a", "b"]))
        reqs.append(
            Request(f"r{i}", 0.0, draw(st.integers(1, 24)), draw(st.integers(1, 12)), tenant=tenant)
        )
    return reqs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=backlogged_tenants(), cfg=configs())
def test_vtc_service_difference_bound(reqs: list[Request], cfg: dict) -> None:
    """Sheng et al. (OSDI 2024), Theorem 4.3: while two tenants are both backlogged,
    their weighted service differs by at most 2 * (w_p * L_in + w_q * M)."""
    cfg = {**cfg, "policy": "vtc", "prefill_max_tokens": None, "options": PolicyOptions()}
    sched = make_scheduler(REGISTRY, **cfg)
    w_p, w_q = 1.0, 2.0
    bound = 2 * (
        w_p * max(r.num_prompt_tokens for r in reqs)
        + w_q * cfg["num_kv_blocks"] * cfg["block_size"]
    )
    for r in reqs:
        sched.add_request(r, 0.0)
    service = {"a": 0.0, "b": 0.0}
    now = 0.0
    for _ in range(5000):
        out = sched.schedule(now)
        if out.is_empty:
            break
        now += 1.0
        sched.update(out, now)
        for item in out.scheduled:
            service[item.seq.request.tenant] += (
                w_q if item.is_decode else w_p
            ) * item.num_new_tokens
        waiting = {s.request.tenant for s in sched.waiting}
        if waiting == {"a", "b"}:
            assert abs(service["a"] - service["b"]) <= bound, (service, bound)
    assert not sched.has_unfinished()
