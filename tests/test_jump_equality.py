"""The simulator's fast path equals its reference mode, for any workload and policy.

``simulate(..., jump=True)`` advances the running set by whole runs of decode
steps between events; ``jump=False`` (``rose-sim --no-jump``) plans every step
alone and is the reference. Over random workloads (bursts, long prompts, shared
prefixes, tenants, priorities, deadlines), every registered policy and loop
order, chunked prefill and pools small enough to preempt, the two must give
identical records (every column, every token time), preemptions, prefix-cache
hit counts and step counts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.registry import load_registry
from roseinfer.request import Request
from roseinfer.simulator import make_cost_model, simulate

REGISTRY = load_registry()
POLICIES = sorted(REGISTRY.policies)
ORDERS = sorted(REGISTRY.loop_orders)
COST = make_cost_model("llama-3.1-8b", "h100-sxm")


@st.composite
def workloads(draw: st.DrawFn) -> list[Request]:
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    burst = draw(st.booleans())
    gaps = rng.exponential(0.002 if burst else 0.02, n)
    shared = draw(st.booleans())
    reqs = []
    for i, t in enumerate(np.cumsum(gaps) - gaps[0]):
        prompt = int(rng.integers(1, 300))
        hashes = tuple(int(h) for h in rng.integers(0, 3, -(-prompt // 32))) if shared else None
        reqs.append(
            Request(
                f"r{i}", float(t), prompt, int(rng.integers(1, 120)),
                prefix_hash_ids=hashes, prefix_hash_block_tokens=32,
                tenant=f"t{int(rng.integers(0, 3))}", priority=int(rng.integers(0, 3)),
                deadline_s=float(rng.uniform(0.005, 0.5)) if rng.random() < 0.5 else None,
            )
        )  # fmt: skip
    return reqs


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    policy = draw(st.sampled_from(POLICIES))
    order = draw(st.sampled_from(ORDERS))
    entry = REGISTRY.policies[policy].cls
    chunked = order == "mixed" or draw(st.booleans())
    budget = draw(st.sampled_from([None, 64, 256])) if entry.uses_token_budget else None
    batched = draw(st.sampled_from([None, 128, 512])) if chunked else None
    if chunked and budget is None and batched is None:
        batched = 256
    extra = {"length_predictor": "noisy-oracle"} if entry.uses_length_predictor else {}
    if policy == "edf":
        extra["drop_late"] = draw(st.booleans())
    return SchedulerConfig(
        num_kv_blocks=draw(st.integers(24, 200)),
        block_size=16,
        max_num_seqs=draw(st.integers(1, 12)),
        prefill_max_tokens=budget,
        max_num_batched_tokens=batched,
        enable_chunked_prefill=chunked,
        max_model_len=384,
        policy=policy,
        loop_order=order,
        options=PolicyOptions(
            extra, force_fifo_every=draw(st.sampled_from([0, 0, 3])),
        ),
    )  # fmt: skip


def assert_same_frames(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns)
    for col in a.columns:
        if col == "token_times_s":
            for x, y in zip(a[col], b[col]):
                np.testing.assert_array_equal(x, y)
        else:
            pd.testing.assert_series_equal(a[col], b[col], check_exact=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), configs())
def test_jumps_equal_stepping_one_step_at_a_time(reqs, config):
    fast = simulate(reqs, config, COST, jump=True)
    slow = simulate(reqs, config, COST, jump=False)
    assert fast.num_steps == slow.num_steps
    assert fast.scheduler.num_preemptions == slow.scheduler.num_preemptions
    bm_fast, bm_slow = fast.scheduler.block_manager, slow.scheduler.block_manager
    assert (bm_fast.num_hit_tokens, bm_fast.num_queried_tokens) == (
        bm_slow.num_hit_tokens,
        bm_slow.num_queried_tokens,
    )
    assert_same_frames(fast.records, slow.records)
    np.testing.assert_array_equal(fast.scheduler.step_log.end_s, slow.scheduler.step_log.end_s)
