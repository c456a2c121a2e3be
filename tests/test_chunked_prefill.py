"""Token-level steps: chunked prefill, mixed steps, their knobs and validation."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ToyCostModel, make_scheduler, records_of, req

from roseinfer.config import SCHEDULER_PRESETS, SchedulerConfig
from roseinfer.interface import AdmissionPolicy, Phase, PolicyError, PolicyOptions
from roseinfer.registry import Entry, Registry
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.simulator import simulate


def drive(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    """Step with 1 s steps until nothing runs; return the non-empty outputs."""
    outs, now = [], 0.0
    for _ in range(max_steps):
        out = sched.schedule(now)
        if out.is_empty:
            break
        now += 1.0
        sched.update(out, now)
        outs.append(out)
    sched.check_invariants()
    return outs


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request, start, tokens) per item, in step order."""
    return [(i.seq.request_id, i.num_computed_tokens, i.num_new_tokens) for i in out.scheduled]


def test_mixed_step_puts_decodes_first_and_chunks_the_long_prompt(registry) -> None:
    sched = make_scheduler(
        registry,
        loop_order="mixed",
        enable_chunked_prefill=True,
        max_num_batched_tokens=10,
        max_num_seqs=4,
        num_kv_blocks=64,
    )
    sched.add_request(req(0, 4, 6), 0.0)
    outs = drive_until(sched, 1)
    sched.add_request(req(1, 25, 2), 1.0)
    outs += drive_until(sched, 4, start=1.0)
    # r0 decodes first in every step while r1's 25-token prompt goes in chunks of 9
    assert [shape(o) for o in outs[1:4]] == [
        [("r0", 4, 1), ("r1", 0, 9)],
        [("r0", 5, 1), ("r1", 9, 9)],
        [("r0", 6, 1), ("r1", 18, 7)],
    ]
    assert [o.phase for o in outs[1:4]] == [Phase.MIXED] * 3
    assert [i.samples for i in outs[3].scheduled] == [True, True]  # r1's first token
    assert all(o.num_batched_tokens <= 10 for o in outs)


def drive_until(sched: Scheduler, num_steps: int, start: float = 0.0) -> list[SchedulerOutput]:
    outs, now = [], start
    for _ in range(num_steps):
        out = sched.schedule(now)
        now += 1.0
        sched.update(out, now)
        outs.append(out)
    return outs


def test_prefill_first_continues_chunks_in_prefill_steps(registry) -> None:
    sched = make_scheduler(
        registry, enable_chunked_prefill=True, max_num_batched_tokens=8, num_kv_blocks=64
    )
    sched.add_request(req(0, 20, 3), 0.0)
    outs = drive(sched)
    assert [shape(o) for o in outs[:3]] == [[("r0", 0, 8)], [("r0", 8, 8)], [("r0", 16, 4)]]
    assert [o.phase for o in outs] == [Phase.PREFILL] * 3 + [Phase.DECODE] * 2
    rec = records_of(sched).iloc[0]
    assert rec.first_token_s == 3.0 and list(rec.token_times_s) == [3.0, 4.0, 5.0]


def test_long_prefill_token_threshold_caps_each_chunk(registry) -> None:
    sched = make_scheduler(
        registry,
        loop_order="mixed",
        enable_chunked_prefill=True,
        long_prefill_token_threshold=5,
        num_kv_blocks=64,
    )
    sched.add_request(req(0, 12, 1), 0.0)
    sched.add_request(req(1, 3, 1), 0.0)
    out = sched.schedule(0.0)
    assert shape(out) == [("r0", 0, 5), ("r1", 0, 3)]


def test_max_num_partial_prefills_holds_back_a_second_partial(registry) -> None:
    sched = make_scheduler(
        registry,
        loop_order="mixed",
        enable_chunked_prefill=True,
        long_prefill_token_threshold=4,
        max_num_partial_prefills=1,
        num_kv_blocks=64,
    )
    for i in range(3):
        sched.add_request(req(i, 10, 1), 0.0)
    out = sched.schedule(0.0)
    assert shape(out) == [("r0", 0, 4)]  # r1 would be a second partial prefill


def test_a_prompt_that_fits_completes_in_one_step_beside_a_partial(registry) -> None:
    sched = make_scheduler(
        registry,
        loop_order="mixed",
        enable_chunked_prefill=True,
        max_num_batched_tokens=12,
        max_num_partial_prefills=1,
        num_kv_blocks=64,
    )
    sched.add_request(req(0, 3, 1), 0.0)
    sched.add_request(req(1, 20, 1), 0.0)
    sched.add_request(req(2, 2, 1), 0.0)
    out = sched.schedule(0.0)
    assert shape(out) == [("r0", 0, 3), ("r1", 0, 9)]  # FIFO: r2 waits behind r1


def test_without_chunking_a_prompt_waits_for_a_step_with_room(registry) -> None:
    sched = make_scheduler(
        registry, loop_order="mixed", max_num_batched_tokens=64, max_model_len=64
    )
    sched.add_request(req(0, 40, 3), 0.0)
    sched.add_request(req(1, 30, 3), 0.0)
    out = sched.schedule(0.0)
    assert shape(out) == [("r0", 0, 40)]  # r1 does not fit the 24 tokens left
    sched.update(out, 1.0)
    assert shape(sched.schedule(1.0)) == [("r0", 40, 1), ("r1", 0, 30)]


def test_prefill_priority_runs_prefills_back_to_back_then_decodes(registry) -> None:
    sched = make_scheduler(registry, loop_order="prefill-priority", max_num_seqs=2)
    sched.add_request(req(0, 4, 3), 0.0)
    out = sched.schedule(0.0)
    sched.update(out, 1.0)
    sched.add_request(req(1, 4, 3), 1.0)
    sched.add_request(req(2, 4, 3), 1.0)
    phases = [o.phase for o in drive(sched)]
    # r1 is admitted before r0 decodes again; r2 waits for a seat, so decodes follow
    assert phases[:3] == [Phase.PREFILL, Phase.DECODE, Phase.DECODE]


class FourPhases(AdmissionPolicy):
    """A loop order with four phases per iteration."""

    name = "four-phases"

    def order(self, ctx):  # type: ignore[no-untyped-def]
        return (Phase.DECODE, Phase.DECODE, Phase.DECODE, Phase.PREFILL)


def test_regression_a_four_phase_order_never_idles_running_requests(registry) -> None:
    """Before: schedule() tried 3 phases, so a 4th (PREFILL, with nothing to admit)
    returned an empty step while requests ran, and runs ended in a false stall."""
    reg = Registry(dict(registry.policies), dict(registry.loop_orders), registry.wrappers)
    reg.loop_orders["four-phases"] = Entry(FourPhases, "test")
    sched = make_scheduler(reg, loop_order="four-phases", max_num_seqs=1)
    sched.add_request(req(0, 4, 9), 0.0)
    sched.add_request(req(1, 4, 9), 0.0)
    outs = drive(sched)
    df = records_of(sched)
    assert (df.status == "finished").all() and (df.num_output_tokens == 9).all()
    assert len(outs) == 18  # every step runs something: 2 prefills + 16 decodes


class DecodeHeavy(AdmissionPolicy):
    """A loop order of decode phases only (the prefill runs on the fallback)."""

    name = "decode-heavy"

    def order(self, ctx):  # type: ignore[no-untyped-def]
        return (Phase.DECODE, Phase.DECODE)


def test_regression_decode_phases_that_preempt_their_decode_leave_no_stall(registry) -> None:
    """Before (found by the VTC property test): an iteration of decode phases whose
    only decode preempted itself for blocks ran nothing, and the fallback decoded
    only, so a request mid-prefill sat there and the run ended in a false stall."""
    reg = Registry(dict(registry.policies), dict(registry.loop_orders), registry.wrappers)
    reg.loop_orders["decode-heavy"] = Entry(DecodeHeavy, "test")
    sched = make_scheduler(
        reg, loop_order="decode-heavy", block_size=2, num_kv_blocks=8, max_num_seqs=3,
        enable_chunked_prefill=True, long_prefill_token_threshold=1, max_model_len=64,
    )  # fmt: skip
    for i, (prompt, output) in enumerate([(9, 1), (8, 2), (1, 1)]):
        sched.add_request(req(i, prompt, output), 0.0)
    drive(sched)
    df = records_of(sched)
    assert (df.status == "finished").all() and not sched.has_unfinished()


def _policy_registry(registry, admit) -> Registry:  # type: ignore[no-untyped-def]
    cls = type("Chunky", (AdmissionPolicy,), {"name": "chunky", "admit": admit})
    reg = Registry(dict(registry.policies), registry.loop_orders, registry.wrappers)
    reg.policies["chunky"] = Entry(cls, "test-plugin")
    return reg


@pytest.mark.parametrize(
    "answer, message",
    [
        (lambda w: [(w[0], 0)], "chunk of 0 tokens; expected 1..10"),
        (lambda w: [(w[0], 11)], "chunk of 11 tokens; expected 1..10"),
        (lambda w: [(w[0], 2.5)], "chunk of 2.5; expected an int"),
        (lambda w: [(w[0], 7), (w[1], 7)], "asked for 14 chunk tokens; the step has 12 left"),
    ],
)
def test_invalid_chunks_raise_policy_error_naming_the_plugin(registry, answer, message) -> None:
    reg = _policy_registry(registry, lambda self, w, b, c: answer(w))
    sched = make_scheduler(
        reg,
        policy="chunky",
        loop_order="mixed",
        enable_chunked_prefill=True,
        max_num_batched_tokens=12,
    )
    sched.add_request(req(0, 10, 2), 0.0)
    sched.add_request(req(1, 10, 2), 0.0)
    with pytest.raises(PolicyError, match=message) as err:
        sched.schedule(0.0)
    assert "chunky" in str(err.value)


def test_a_chunk_without_chunked_prefill_is_a_policy_error(registry) -> None:
    reg = _policy_registry(registry, lambda self, w, b, c: [(w[0], 3)])
    sched = make_scheduler(reg, policy="chunky")
    sched.add_request(req(0, 10, 2), 0.0)
    with pytest.raises(PolicyError, match="chunked prefill is off"):
        sched.schedule(0.0)


def test_a_policy_chunk_is_computed_then_continued(registry) -> None:
    reg = _policy_registry(registry, lambda self, w, b, c: [(w[0], 3)])
    sched = make_scheduler(
        reg, policy="chunky", enable_chunked_prefill=True, max_num_batched_tokens=8
    )
    sched.add_request(req(0, 10, 2), 0.0)
    outs = drive(sched)
    assert [shape(o) for o in outs[:3]] == [[("r0", 0, 3)], [("r0", 3, 7)], [("r0", 10, 1)]]


@pytest.mark.parametrize("policy", ["budget", "pack"])
def test_chunk_head_fills_the_budget_instead_of_going_alone(registry, policy) -> None:
    sched = make_scheduler(
        registry,
        policy=policy,
        prefill_max_tokens=6,
        enable_chunked_prefill=True,
        options=PolicyOptions(chunk_head=True),
    )
    sched.add_request(req(0, 20, 2), 0.0)
    outs = drive(sched)
    chunks = [shape(o) for o in outs if o.phase is Phase.PREFILL]
    assert chunks == [[("r0", 0, 6)], [("r0", 6, 6)], [("r0", 12, 6)], [("r0", 18, 2)]]
    plain = make_scheduler(registry, policy=policy, prefill_max_tokens=6)
    plain.add_request(req(0, 20, 2), 0.0)
    assert shape(plain.schedule(0.0)) == [("r0", 0, 20)]  # the seeds' rule: alone, whole


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "must be >= max_num_seqs"),
        ({"max_num_batched_tokens": 512, "max_model_len": 1024}, "add --enable-chunked-prefill"),
        ({"long_prefill_token_threshold": 8}, "only applies with --enable-chunked-prefill"),
        ({"max_num_partial_prefills": 2}, "only applies with --enable-chunked-prefill"),
        ({"options": PolicyOptions(chunk_head=True)}, "--chunk-head admits a prompt chunk"),
        ({"enable_chunked_prefill": True}, "needs a per-step limit"),
    ],
)
def test_contradictory_knobs_are_refused(knobs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(num_kv_blocks=64, **knobs)


def test_presets_name_their_engine_defaults() -> None:
    assert SCHEDULER_PRESETS["vllm-v1"]["loop_order"] == "mixed"
    assert SCHEDULER_PRESETS["vllm-v1"]["max_num_batched_tokens"] == 2048
    assert SCHEDULER_PRESETS["sglang"]["max_num_batched_tokens"] == 8192
    assert SCHEDULER_PRESETS["seeds"]["enable_chunked_prefill"] is False
    for knobs in SCHEDULER_PRESETS.values():
        SchedulerConfig(num_kv_blocks=64, max_model_len=1024, **knobs)  # each is valid


@pytest.mark.parametrize("order", ["mixed", "prefill-first", "decode-first", "prefill-priority"])
def test_multi_step_decode_runs_equal_single_steps_with_chunking(order) -> None:
    reqs = [req(i, 5 + 13 * (i % 4), 3 + i % 7, arrival=0.004 * i) for i in range(40)]
    config = SchedulerConfig(
        num_kv_blocks=200,
        block_size=4,
        max_num_seqs=6,
        loop_order=order,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    jumped = simulate(reqs, config, ToyCostModel(), jump=True)
    single = simulate(reqs, config, ToyCostModel(), jump=False)
    assert jumped.num_steps == single.num_steps
    a, b = jumped.records, single.records
    for col in ("num_output_tokens", "num_cached_prompt_tokens", "num_preemptions", "status"):
        assert list(a[col]) == list(b[col])
    for x, y in zip(a.token_times_s, b.token_times_s):  # summed in another order: 1 ulp
        np.testing.assert_allclose(x, y, rtol=1e-12)
