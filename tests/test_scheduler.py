"""The shared scheduler: rejection, preemption, ordering, validation, abort."""

from __future__ import annotations

import pytest
from conftest import make_scheduler, records_of, req

from roseinfer.interface import AdmissionPolicy, Phase, PolicyError
from roseinfer.registry import Entry
from roseinfer.request import SamplingParams
from roseinfer.scheduler import Scheduler


def run_to_end(sched: Scheduler, step_s: float = 1.0, max_steps: int = 10_000) -> list:
    """Drive the scheduler with a fixed step time; return the outputs."""
    now, outs = 0.0, []
    for _ in range(max_steps):
        out = sched.schedule(now)
        if out.is_empty:
            break
        now += step_s
        sched.update(out, now)
        outs.append(out)
    sched.check_invariants()
    return outs


def test_too_long_request_is_rejected_with_a_reason(registry) -> None:
    sched = make_scheduler(registry, max_model_len=64)
    seq = sched.add_request(req(0, 60, 10), 0.0)
    assert seq.status.value == "rejected"
    assert "max_model_len 64" in seq.reject_reason


def test_request_larger_than_the_pool_is_rejected(registry) -> None:
    sched = make_scheduler(registry, num_kv_blocks=4, block_size=4)
    seq = sched.add_request(req(0, 20, 4), 0.0)
    assert "--num-kv-blocks" in seq.reject_reason


def test_duplicate_request_id_is_an_error(registry) -> None:
    sched = make_scheduler(registry)
    sched.add_request(req(0, 4), 0.0)
    with pytest.raises(ValueError, match="duplicate request id"):
        sched.add_request(req(0, 4), 0.0)


def test_every_request_finishes_with_exact_token_counts(registry) -> None:
    sched = make_scheduler(registry)
    for i in range(5):
        sched.add_request(req(i, 3 + i, 2 + i), 0.0)
    run_to_end(sched)
    df = records_of(sched)
    assert (df.status == "finished").all()
    assert df.num_output_tokens.tolist() == [2, 3, 4, 5, 6]
    assert all(len(t) == n for t, n in zip(df.token_times_s, df.num_output_tokens))


def test_prefill_first_then_decode(registry) -> None:
    sched = make_scheduler(registry)
    sched.add_request(req(0, 4, 8), 0.0)
    outs = run_to_end(sched)
    assert [o.phase for o in outs[:3]] == [Phase.PREFILL, Phase.DECODE, Phase.DECODE]


def test_decode_first_decodes_before_admitting(registry) -> None:
    sched = make_scheduler(registry, loop_order="decode-first")
    sched.add_request(req(0, 4, 8), 0.0)
    out = sched.schedule(0.0)
    sched.update(out, 1.0)
    sched.add_request(req(1, 4, 8), 1.0)
    phases = []
    for t in range(2, 5):
        out = sched.schedule(float(t))
        phases.append(out.phase)
        sched.update(out, float(t))
    assert phases == [Phase.DECODE, Phase.PREFILL, Phase.DECODE]


def test_preemption_by_recompute_when_the_pool_runs_dry(registry) -> None:
    # 6 blocks of 4 tokens; two requests of 8 prompt + 8 output need 4 blocks each
    sched = make_scheduler(registry, num_kv_blocks=6, block_size=4)
    sched.add_request(req(0, 8, 8), 0.0)
    sched.add_request(req(1, 8, 8), 0.0)
    outs = run_to_end(sched)
    preempted = [s.request_id for o in outs for s in o.preempted]
    assert preempted and preempted[0] == "r1"  # the most recently admitted
    df = records_of(sched)
    assert (df.status == "finished").all()
    assert df.set_index("request_id").loc["r1", "num_preemptions"] >= 1
    assert all(len(t) == 8 for t in df.token_times_s)


def test_every_output_knows_its_longest_decode_even_after_preemptions(registry) -> None:
    """The planner keeps each output's longest decode context as it schedules (the
    roofline's decode imbalance reads it every step); a preemption while planning
    takes a decode out again, and the longest must follow."""
    sched = make_scheduler(registry, num_kv_blocks=14, block_size=4)
    for i in range(8):
        sched.add_request(req(i, 4 + 5 * i, 6 + i), 0.0)
    outs = run_to_end(sched)
    assert any(o.preempted for o in outs) and sum(1 for o in outs if o.decodes) > 10
    for out in outs:
        assert out.decode_max_context == max(out.decode_contexts, default=0)
        assert out.totals().decode_max_context == out.decode_max_context


def test_stop_token_ends_a_request_early(registry) -> None:
    sched = make_scheduler(registry)
    sampling = SamplingParams(ignore_eos=False, stop_token_ids=(7,))
    sched.add_request(req(0, 4, 10, sampling=sampling), 0.0)
    out = sched.schedule(0.0)
    assert sched.update(out, 1.0, sampled_token_ids=[3]) == []
    out = sched.schedule(1.0)
    finished = sched.update(out, 2.0, sampled_token_ids=[7])
    assert [s.stop_reason for s in finished] == ["stop"]
    assert finished[0].output_token_ids == [3, 7]
    sched.check_invariants()


def test_abort_frees_blocks_and_ends_once(registry) -> None:
    sched = make_scheduler(registry)
    sched.add_request(req(0, 8, 10), 0.0)
    sched.add_request(req(1, 8, 10), 0.0)
    out = sched.schedule(0.0)
    sched.update(out, 1.0)
    assert sched.abort("r0", 1.0)
    assert not sched.abort("r0", 1.0)
    assert sched.abort("r1", 1.0)
    assert sched.block_manager.num_used_blocks == 0
    sched.check_invariants()
    df = records_of(sched)
    assert df.reject_reason.tolist() == ["aborted", "aborted"]


def _with_policy(registry, admit) -> Scheduler:
    cls = type(
        "Custom", (AdmissionPolicy,), {"name": "custom", "admit": admit, "uses_token_budget": True}
    )
    reg = type(registry)(dict(registry.policies), registry.loop_orders, registry.wrappers)
    reg.policies["custom"] = Entry(cls, "test-plugin")
    return make_scheduler(reg, policy="custom", prefill_max_tokens=8)


def test_admission_sees_the_schedulers_facts_in_its_context_and_budget(registry) -> None:
    """Every PolicyContext and Budget field holds what its name says (the
    scheduler builds them positionally, for speed)."""
    seen = []

    def admit(self, waiting, budget, ctx):
        seen.append((budget, ctx, [s.request.request_id for s in ctx.running]))
        return [waiting[0]]

    sched = _with_policy(registry, admit)  # prefill_max_tokens 8, 256 blocks of 4, 8 seats
    sched.add_request(req(0, 6, 4), 0.0)
    sched.update(sched.schedule(0.0), 1.0)
    sched.add_request(req(1, 5, 4), 1.0)
    sched.add_request(req(2, 5, 4), 1.0)
    sched.schedule(2.5)
    budget, ctx, running = seen[-1]
    assert (budget.max_tokens, budget.max_seqs, budget.max_batched_tokens) == (8, 7, None)
    assert budget.num_free_blocks == ctx.num_free_blocks == 256 - 2
    assert (ctx.now_s, ctx.admission_round, ctx.num_running, ctx.num_waiting) == (2.5, 2, 1, 2)
    assert (ctx.max_model_len, ctx.block_size, ctx.max_num_seqs, ctx.free_seats) == (
        sched.config.max_model_len, 4, 8, 7,
    )  # fmt: skip
    assert running == ["r0"]
    assert ctx.cost(sched.waiting[0]) == 5


@pytest.mark.parametrize(
    "admit, message",
    [
        (lambda self, w, b, c: [w[0], w[0]], "twice"),
        (lambda self, w, b, c: [w[0], w[1]], "over a budget of 8"),
        (lambda self, w, b, c: w[0], "expected a list"),
    ],
)
def test_invalid_policy_answers_raise_policy_error(registry, admit, message) -> None:
    sched = _with_policy(registry, admit)
    sched.add_request(req(0, 6), 0.0)
    sched.add_request(req(1, 6), 0.0)
    with pytest.raises(PolicyError, match=message) as err:
        sched.schedule(0.0)
    assert "custom" in str(err.value)


def test_selecting_a_request_not_waiting_is_an_error(registry) -> None:
    held = {}

    def admit(self, waiting, budget, ctx):
        if "first" not in held:
            held["first"] = waiting[0]
            return [waiting[0]]
        return [held["first"]]

    sched = _with_policy(registry, admit)
    sched.add_request(req(0, 6, 5), 0.0)
    out = sched.schedule(0.0)
    sched.update(out, 1.0)
    sched.add_request(req(1, 6, 5), 1.0)
    with pytest.raises(PolicyError, match="not waiting"):
        for _ in range(3):
            out = sched.schedule(1.0)
            sched.update(out, 2.0)


def test_a_budget_with_a_policy_that_ignores_it_is_an_error(registry) -> None:
    with pytest.raises(ValueError, match="ignores the prefill token budget"):
        make_scheduler(registry, policy="fifo", prefill_max_tokens=64)
