"""The discrete-event simulator: jumps equal single steps, seed effects show."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ToyCostModel

from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyError, PolicyOptions
from roseinfer.request import Request
from roseinfer.simulator import make_cost_model, simulate


def mixed_requests(n: int = 300, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(0.05, n)
    return [
        Request(f"r{i}", float(t), int(rng.integers(1, 900)), int(rng.integers(1, 200)))
        for i, t in enumerate(np.cumsum(gaps) - gaps[0])
    ]


@pytest.mark.parametrize(
    "policy, budget, order, every",
    [
        ("fifo", None, "prefill-first", 0),
        ("budget", 512, "decode-first", 0),
        ("pack", 512, "prefill-first", 4),
        ("fifo", None, "mixed", 0),
        ("budget", 512, "prefill-priority", 0),
    ],
)
def test_jumps_give_the_same_records_as_single_steps(policy, budget, order, every) -> None:
    reqs = mixed_requests()
    config = SchedulerConfig(
        num_kv_blocks=600,
        block_size=16,
        max_num_seqs=32,
        prefill_max_tokens=budget,
        max_model_len=4096,
        policy=policy,
        loop_order=order,
        options=PolicyOptions(force_fifo_every=every),
    )
    cost = make_cost_model("llama-3.1-8b", "h100-sxm")
    fast = simulate(reqs, config, cost, jump=True)
    slow = simulate(reqs, config, cost, jump=False)
    assert fast.num_steps == slow.num_steps
    assert fast.scheduler.num_preemptions == slow.scheduler.num_preemptions
    a, b = fast.records, slow.records
    for col in ("admitted_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(a[col], b[col], rtol=1e-9)
    assert (a.num_preemptions == b.num_preemptions).all()


def test_every_request_ends_and_kv_drains() -> None:
    reqs = mixed_requests(200)
    config = SchedulerConfig(num_kv_blocks=300, block_size=16, max_num_seqs=64, max_model_len=1024)
    result = simulate(reqs, config, ToyCostModel())
    df = result.records
    assert len(df) == 200
    assert set(df.status) <= {"finished", "rejected"}
    assert result.scheduler.block_manager.num_used_blocks == 0
    assert (df[df.status == "rejected"].reject_reason.str.contains("max_model_len")).all()


def test_a_policy_that_never_admits_is_reported_not_hung(registry) -> None:
    from roseinfer.interface import AdmissionPolicy
    from roseinfer.registry import Entry, Registry

    class Never(AdmissionPolicy):
        name = "never"

        def admit(self, waiting, budget, ctx):
            return []

    reg = Registry(dict(registry.policies), registry.loop_orders, registry.wrappers)
    reg.policies["never"] = Entry(Never, "test")
    config = SchedulerConfig(num_kv_blocks=100, policy="never")
    with pytest.raises(PolicyError, match="never"):
        simulate(mixed_requests(3), config, ToyCostModel(), registry=reg)


def test_records_without_token_times_summarize_like_records_with_them(monkeypatch) -> None:
    """A long run keeps an ITL histogram and releases old steps: same figures."""
    from roseinfer import scheduler
    from roseinfer.metrics import summarize

    monkeypatch.setattr(scheduler, "RELEASE_MIN_HELD", 64)
    reqs = mixed_requests(400)
    config = SchedulerConfig(
        num_kv_blocks=400, block_size=16, max_num_seqs=16, max_model_len=1024, policy="fifo"
    )
    cost = make_cost_model("llama-3.1-8b", "h100-sxm")
    full = simulate(reqs, config, cost)
    lean = simulate(reqs, config, cost, keep_token_times=False)
    assert lean.scheduler.step_log.first_kept_step > 0  # old steps were let go
    assert lean.records.token_times_s.isna().all() and lean.itl is not None
    with pytest.raises(ValueError, match="no token times"):
        summarize(lean.records)
    a = summarize(full.records, duration_s=full.duration_s)
    b = summarize(lean.records, duration_s=lean.duration_s, itl=lean.itl)
    assert a.keys() == b.keys()
    for key in a:
        tol = 2e-4 if "itl" in key else 1e-12
        assert b[key] == pytest.approx(a[key], rel=tol, nan_ok=True), key
