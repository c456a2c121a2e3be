"""Hypothesis properties, per registered policy: the universal invariants and
every guarantee the policy declares, checked from its declaration.

Universal invariants (DESIGN.md), for every policy: every answer is a subset of
the waiting queue with no duplicates, within the seat limit and the token
budget (unless one request goes alone); progress (a non-empty queue with a free
seat gets an admission); conservation (every request ends exactly once, with
its exact output length); no KV block leaks; no step computes more than
``max_num_batched_tokens``; every prompt token is computed exactly once per
admission (recompute after a preemption counted apart); a request is admitted
at most once per stay (once, plus once per preemption).

Declared guarantees: arrival order (``preserves_arrival_order``), a queue
prefix (``admits_queue_prefix``), and each name in a policy's ``guarantees``,
which must be in :data:`roseinfer.interface.GUARANTEES` (an unknown name is an
error at registration). Each name has one check in :data:`CHECKS` (``vtc-bound``
has its own backlogged-tenants test); every test takes the policy from the
declarations, never a hard-coded name, and runs per policy with its own
hypothesis settings (:data:`EXAMPLES`), so a policy is never sampled away.
Force-FIFO's starvation bound is the ``force-fifo`` wrapper's.

Policies include the README's third-party example (``ShortestFirst``), which
declares no order: it must pass the universal invariants, and only those.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.driver import start_replay
from roseinfer.interface import (
    GUARANTEES,
    AdmissionPolicy,
    Phase,
    PolicyOptions,
    PolicyWrapper,
    check_guarantees,
)
from roseinfer.records import RecordBuilder
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


EXAMPLES: dict[str, int] = {
    "default": 120, "srpt": 250, "priority": 200, "pack": 150, "budget": 150, "edf": 150,
}  # fmt: skip
"""Hypothesis examples per policy (each example runs one workload and checks every
invariant and every declared guarantee); the preempting policies get more."""

VTC_EXAMPLES = 100


def examples(policy: str) -> int:
    return EXAMPLES.get(policy, EXAMPLES["default"])


def per_policy(policy: str, body: Callable[..., None], n: int | None = None, **strategies: Any):
    """Run ``body(**drawn)`` under hypothesis for one policy, with its own settings."""
    runner = settings(
        max_examples=n or examples(policy),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )(given(**strategies)(body))
    runner()


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
    predicted: dict[int, float] | None = None  # the base policy's predicted output, if any


@dataclass
class PreemptCall:
    """One ``preempt`` answer, with what the waiting and the victims looked like then."""

    waiting: list[dict[str, float]]  # per waiting request: remaining, cost, priority
    victims: list[dict[str, float]]  # per victim: remaining, num_tokens, priority


def _base(policy: AdmissionPolicy) -> AdmissionPolicy:
    while isinstance(policy, PolicyWrapper):
        policy = policy.inner
    return policy


class Spy(PolicyWrapper):
    """Wraps the run's admission policy and records every admit and preempt call."""

    name = "spy"

    def __init__(self, inner: AdmissionPolicy) -> None:
        super().__init__(inner, inner.options)
        self.calls: list[Call] = []
        self.preempts: list[PreemptCall] = []

    def admit(self, waiting, budget, ctx):  # type: ignore[no-untyped-def]
        base = _base(self.inner)
        ranked = None
        if type(base).ranks():
            ranked = [s.seq_id for s in sorted(waiting, key=lambda s: base.rank(s, ctx))]
        predicted = None
        if hasattr(base, "predicted"):
            predicted = {s.seq_id: base.predicted(s) for s in waiting}  # type: ignore[attr-defined]
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
                predicted=predicted,
            )
        )
        return answer

    def preempt(self, waiting, ctx):  # type: ignore[no-untyped-def]
        base = _base(self.inner)
        remaining = getattr(base, "remaining", lambda s: float(s.remaining_output_tokens))

        def facts(seq, waiting: bool) -> dict[str, float]:  # type: ignore[no-untyped-def]
            return {
                "remaining": remaining(seq),
                "cost": float(ctx.cost(seq)) if waiting else 0.0,
                "num_tokens": float(seq.num_tokens),
                "priority": float(seq.request.priority),
            }

        before = [facts(s, True) for s in waiting]
        victims = self.inner.preempt(waiting, ctx)
        if victims:
            self.preempts.append(PreemptCall(before, [facts(v, False) for v in victims]))
        return victims


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
def configs(draw, policy: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    policy = policy or draw(st.sampled_from(POLICIES))
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
            seed=str(draw(st.integers(0, 99))),
            length_predictor=draw(st.sampled_from(PREDICTORS)),
            drop_late=draw(st.booleans()),
            lpm_aging_s=draw(st.sampled_from([0.5, 2.0, 5.0])),
            srpt_preempt_factor=draw(st.sampled_from([1.0, 1.5, 2.0])),
            srpt_recompute_weight=draw(st.sampled_from([0.0, 0.05, 1.0])),
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
    start_replay(sched, reqs, warn=lambda message: None)  # as drive(): fit a predictor
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


# ------------------------------------------------------ declared guarantees
def check_ranked_prefix(call: Call, cfg: dict) -> None:
    assert call.ranked is not None and call.selection == call.ranked[: len(call.selection)], (
        "ranked-prefix: not the best-ranked prefix"
    )


def check_strict_priority(call: Call, cfg: dict) -> None:
    sel, prio = call.selection, call.priority or {}
    left = [s for s in call.waiting if s not in sel]
    if sel and left:
        assert max(prio[s] for s in sel) <= min(prio[s] for s in left), "strict-priority"


def check_aging_bound(call: Call, cfg: dict) -> None:
    aging_s = float(cfg["options"].get("lpm_aging_s", 5.0))
    arrival = call.arrival or {}
    for b in (s for s in call.waiting if s not in call.selection):
        if call.now_s - arrival[b] >= aging_s:
            assert all(arrival[a] <= arrival[b] for a in call.selection), "aging-bound"


def check_later_only_if_shorter(call: Call, cfg: dict) -> None:
    arrival, predicted = call.arrival or {}, call.predicted
    assert predicted is not None, "later-only-if-shorter needs a policy that predicts lengths"
    for b in (s for s in call.waiting if s not in call.selection):
        for a in call.selection:
            if arrival[a] > arrival[b]:
                assert predicted[a] < predicted[b], f"later-only-if-shorter: {a} passed {b}"


def check_preempt_strictly_longer(call: PreemptCall, cfg: dict) -> None:
    shortest = min(w["remaining"] for w in call.waiting)
    for v in call.victims:
        assert v["remaining"] > shortest, "preempt-strictly-longer: a victim no longer"


def check_preempt_pays_recompute(call: PreemptCall, cfg: dict) -> None:
    factor = float(cfg["options"].get("srpt_preempt_factor", 2.0))
    weight = float(cfg["options"].get("srpt_recompute_weight", 1.0))
    for v in call.victims:
        assert any(
            v["remaining"] > factor * (w["remaining"] + weight * (w["cost"] + v["num_tokens"]))
            for w in call.waiting
        ), "preempt-pays-recompute: a preemption that does not pay for its recompute"


def check_preempt_strictly_lower_priority(call: PreemptCall, cfg: dict) -> None:
    urgent = min(w["priority"] for w in call.waiting)
    for v in call.victims:
        assert v["priority"] > urgent, "preempt-strictly-lower-priority: victim as urgent"


ADMIT_CHECKS: dict[str, Callable[[Call, dict], None]] = {
    "ranked-prefix": check_ranked_prefix,
    "strict-priority": check_strict_priority,
    "aging-bound": check_aging_bound,
    "later-only-if-shorter": check_later_only_if_shorter,
}
"""Guarantees checked on every non-forced admission round."""

PREEMPT_CHECKS: dict[str, Callable[[PreemptCall, dict], None]] = {
    "preempt-strictly-longer": check_preempt_strictly_longer,
    "preempt-pays-recompute": check_preempt_pays_recompute,
    "preempt-strictly-lower-priority": check_preempt_strictly_lower_priority,
}
"""Guarantees checked on every non-empty ``preempt`` answer."""

CHECKS = {**ADMIT_CHECKS, **PREEMPT_CHECKS, "vtc-bound": None}  # vtc-bound: its own test


def test_every_guarantee_name_has_a_check_and_every_policy_declares_known_names() -> None:
    assert set(CHECKS) == set(GUARANTEES)
    for name in POLICIES:
        check_guarantees(REGISTRY.policy(name))


def test_an_unknown_guarantee_is_an_error_at_registration() -> None:
    import pluggy

    from roseinfer import hookimpl, hookspecs

    class Typo(AdmissionPolicy):
        name = "typo"
        guarantees = ("ranked-prefx",)

    class Plugin:
        @hookimpl
        def register_admission_policies(self):  # type: ignore[no-untyped-def]
            return [Typo]

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(Plugin(), name="typo-plugin")
    with pytest.raises(ValueError, match="unknown guarantee 'ranked-prefx'; known: aging-bound"):
        load_registry(pm)

    class NotATuple(AdmissionPolicy):
        name = "str-guarantee"
        guarantees = "ranked-prefix"  # type: ignore[assignment]

    with pytest.raises(ValueError, match="must be a tuple of names"):
        check_guarantees(NotATuple)


def check_run(reqs: list[Request], cfg: dict) -> None:
    """One run of ``cfg['policy']`` on ``reqs``: the universal invariants, then
    every guarantee the policy declares."""
    sched, spy = spied(cfg)
    admissions: dict[int, int] = {}
    orig = sched._admit  # count real admissions, whatever the policy answered

    def counting(seq, *args):  # type: ignore[no-untyped-def]
        item = orig(seq, *args)
        if item is not None:
            admissions[seq.seq_id] = admissions.get(seq.seq_id, 0) + 1
        return item

    sched._admit = counting  # type: ignore[method-assign]
    run(sched, reqs)
    sched.check_invariants()
    ended = list(sched.pop_ended())
    builder = RecordBuilder(keep_token_ids=True)
    builder.extend(ended, sched.step_log)
    df = builder.frame()
    status = dict(zip(df.request_id, df.status, strict=True))
    for seq in ended:  # a request is admitted at most once per stay
        # a finished request's last stay ends it; a rejected one (e.g. dropped by edf
        # --drop-late after a preemption) may end while waiting after its last stay
        extra = (1,) if status[seq.request_id] == "finished" else (0, 1)
        assert admissions.get(seq.seq_id, 0) == len(seq.stays), f"{seq}: admissions"
        assert len(seq.stays) - seq.num_preemptions in extra or not seq.stays, (
            f"{seq}: {len(seq.stays)} stays, {seq.num_preemptions} preemptions"
        )
    assert len(df) == len(reqs) and df.request_id.is_unique, "a request was lost or doubled"
    finished = df[df.status == "finished"]
    want = {r.request_id: r.max_output_tokens for r in reqs}
    assert all(finished.num_output_tokens == finished.request_id.map(want))
    rejected = df[df.status == "rejected"]
    assert (rejected.reject_reason != "").all()
    assert sched.block_manager.num_used_blocks == 0
    assert (finished.first_token_s >= finished.arrival_s).all()
    assert (finished.finish_s >= finished.first_token_s).all()

    cls = REGISTRY.policy(cfg["policy"])
    forced_every = cfg["options"].get("force_fifo_every", 0)
    admit_checks = [ADMIT_CHECKS[g] for g in cls.guarantees if g in ADMIT_CHECKS]
    for call in spy.calls:
        sel = call.selection
        assert len(set(sel)) == len(sel) and set(sel) <= set(call.waiting)
        assert sel, "non-empty queue with a free seat admitted nothing"
        assert len(sel) <= call.max_seqs
        if call.max_tokens is not None and len(sel) > 1:
            assert sum(call.tokens[s] for s in sel) <= call.max_tokens
        positions = [call.waiting.index(s) for s in sel]
        forced = bool(forced_every) and call.round_index % forced_every == 0
        if cls.preserves_arrival_order or cls.admits_queue_prefix or forced:
            assert positions == sorted(positions), "selection not in arrival order"
        if cls.admits_queue_prefix or forced:
            assert positions == list(range(len(sel))), "FIFO answer is not a queue prefix"
        if not forced:
            for check in admit_checks:
                check(call, cfg)
    preempt_checks = [PREEMPT_CHECKS[g] for g in cls.guarantees if g in PREEMPT_CHECKS]
    for pcall in spy.preempts:
        for pcheck in preempt_checks:
            pcheck(pcall, cfg)


@pytest.mark.parametrize("policy", POLICIES)
def test_invariants_and_declared_guarantees(policy: str) -> None:
    per_policy(policy, check_run, reqs=workloads(), cfg=configs(policy))


def test_preempting_policies_are_exercised() -> None:
    """The preempt checks are not vacuous: srpt and priority do preempt in the suite's
    setting (a long running request, a short or urgent one arriving on one seat)."""
    for policy, options, short in (
        ("srpt", {"length_predictor": "oracle", "srpt_recompute_weight": 0.0}, {}),
        ("priority", {}, {"priority": 0}),
    ):
        cfg = {"policy": policy, "max_num_seqs": 1, "max_model_len": MAX_MODEL_LEN,
               "options": PolicyOptions(options)}  # fmt: skip
        reqs = [Request("long", 0.0, 4, 40, priority=1), Request("short", 2.0, 2, 1, **short)]
        sched, spy = spied(cfg)
        run(sched, reqs)
        assert spy.preempts, policy


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


@st.composite
def backlogged_tenants(draw) -> list[Request]:  # type: ignore[no-untyped-def]
    reqs = []
    for i in range(draw(st.integers(8, 40))):
        tenant = draw(st.sampled_from(["a", "b"]))
        reqs.append(
            Request(f"r{i}", 0.0, draw(st.integers(1, 24)), draw(st.integers(1, 12)), tenant=tenant)
        )
    return reqs


VTC_BOUND = [p for p in POLICIES if "vtc-bound" in REGISTRY.policy(p).guarantees]


@pytest.mark.parametrize("policy", VTC_BOUND)
def test_vtc_service_difference_bound(policy: str) -> None:
    """Sheng et al. (OSDI 2024), Theorem 4.3, for every policy that declares
    ``vtc-bound``: while two tenants are both backlogged, their weighted service
    differs by at most 2 * (w_p * L_in + w_q * M), with the policy's own weights."""

    def body(reqs: list[Request], cfg: dict, w_p: float, w_q: float) -> None:
        options = PolicyOptions(vtc_input_weight=w_p, vtc_output_weight=w_q)
        cfg = {**cfg, "prefill_max_tokens": None, "options": options}
        sched = make_scheduler(REGISTRY, **cfg)
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
                weight = w_q if item.is_decode else w_p
                service[item.seq.request.tenant] += weight * item.num_new_tokens
            waiting = {s.request.tenant for s in sched.waiting}
            if waiting == {"a", "b"}:
                assert abs(service["a"] - service["b"]) <= bound, (service, bound)
        assert not sched.has_unfinished()

    per_policy(
        policy,
        body,
        VTC_EXAMPLES,
        reqs=backlogged_tenants(),
        cfg=configs(policy),
        w_p=st.sampled_from([1.0, 0.5]),
        w_q=st.sampled_from([2.0, 1.0]),
    )


def test_vtc_bound_is_declared_and_checked() -> None:
    assert VTC_BOUND == ["vtc"]
