"""The simulator's fast path equals its reference mode, for any workload and policy.

``simulate(..., jump=True)`` advances the running set by whole runs of decode
steps between events; ``jump=False`` (``rose-sim --no-jump``) plans every step
alone and is the reference. Over random workloads (bursts, long prompts, shared
prefixes, tenants, priorities, deadlines), every registered policy and loop
order, chunked prefill, prefix caching, KV tiers and pools small enough to
preempt (``tests/strategies.py``), the two must give
identical records (every column, every token time), preemptions, prefix-cache
hit counts and step counts.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from strategies import configs, workloads

from roseinfer.simulator import make_cost_model, simulate

COST = make_cost_model("llama-3.1-8b", "h100-sxm")


def assert_same_frames(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert list(a.columns) == list(b.columns)
    for col in a.columns:
        if col == "token_times_s":
            for x, y in zip(a[col], b[col]):
                np.testing.assert_array_equal(x, y)
        else:
            pd.testing.assert_series_equal(a[col], b[col], check_exact=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_requests=40), configs())
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
