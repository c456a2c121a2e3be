"""Hypothesis strategies shared by the simulator's equality tests: random
workloads (bursty or sparse arrivals; shared prefixes as token ids or as Mooncake
hash ids; tenants, priorities, deadlines) and scheduler configurations (every
registered policy and loop order, token budgets, chunked prefill, prefix caching,
KV tiers, pools small enough to preempt).

``tests/test_core_equality.py`` (compiled core = pure core) and
``tests/test_jump_equality.py`` (multi-step jumps = one step at a time) draw
from the same ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from roseinfer.config import SchedulerConfig
from roseinfer.interface import PolicyOptions
from roseinfer.kv_tiers import KVTierConfig, KVTierSpec
from roseinfer.registry import load_registry
from roseinfer.request import Request

REGISTRY = load_registry()
POLICIES = sorted(REGISTRY.policies)
ORDERS = sorted(REGISTRY.loop_orders)
TIER_POLICIES = sorted(REGISTRY.kv_tier_policies)


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 30) -> list[Request]:
    n = draw(st.integers(1, max_requests))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    gaps = rng.exponential(draw(st.sampled_from([0.0005, 0.005, 0.05])), n)
    shared = draw(st.sampled_from([True, True, True, False]))
    ids = draw(st.booleans())  # token ids (hashed) rather than Mooncake hash ids
    # three shared prefixes (system prompts, documents) that prompts start with
    prefixes = [rng.integers(0, 1000, 300) for _ in range(3)]
    reqs = []
    for i, t in enumerate(np.cumsum(gaps) - gaps[0]):
        prompt = int(rng.integers(1, 300))
        hashes = tokens = None
        if shared:
            head = prefixes[int(rng.integers(0, 3))][: int(rng.integers(0, prompt + 1))]
            body = np.concatenate([head, rng.integers(1000, 2000, prompt - len(head))])
            if ids:
                tokens = tuple(int(x) for x in body)
            else:  # a Mooncake id per 32 tokens: the prefix's, then the request's own
                hashes = tuple(
                    int(body[k]) if k + 32 <= len(head) else 10_000 + 100 * i + k // 32
                    for k in range(0, prompt, 32)
                )
        reqs.append(
            Request(
                f"r{i}", float(t), prompt, int(rng.integers(1, 100)), prompt_token_ids=tokens,
                prefix_hash_ids=hashes, prefix_hash_block_tokens=32,
                tenant=f"t{int(rng.integers(0, 3))}", priority=int(rng.integers(0, 3)),
                deadline_s=float(rng.uniform(0.005, 0.5)) if rng.random() < 0.5 else None,
            )
        )  # fmt: skip
    return reqs


@st.composite
def configs(draw: st.DrawFn, policy: str | None = None) -> SchedulerConfig:
    policy = policy or draw(st.sampled_from(POLICIES))
    order = draw(st.sampled_from(ORDERS))
    entry = REGISTRY.policies[policy].cls
    chunked = order == "mixed" or draw(st.booleans())
    budget = draw(st.sampled_from([None, 64, 256])) if entry.uses_token_budget else None
    batched = draw(st.sampled_from([None, 128, 512])) if chunked else None
    if chunked and budget is None and batched is None:
        batched = 256
    extra: dict[str, Any] = {}
    if entry.uses_length_predictor:
        extra["length_predictor"] = draw(st.sampled_from(["noisy-oracle", "oracle", "bucket"]))
    if policy == "edf":
        extra["drop_late"] = draw(st.booleans())
    caching = draw(st.sampled_from([True, True, True, False]))
    tiers = None
    if caching and draw(st.booleans()):
        specs = tuple(
            KVTierSpec(f"t{i}", draw(st.integers(1, 40)), 50e9, 20e9)
            for i in range(draw(st.integers(1, 2)))
        )
        tiers = KVTierConfig(
            specs, 2 * 2**20, policy=draw(st.sampled_from(TIER_POLICIES)),
            overlap=draw(st.booleans()),
        ).resolved(REGISTRY)  # fmt: skip
    return SchedulerConfig(
        num_kv_blocks=draw(st.integers(24, 200)),
        block_size=draw(st.sampled_from([8, 16])),
        max_num_seqs=draw(st.integers(1, 12)),
        prefill_max_tokens=budget,
        max_num_batched_tokens=batched,
        enable_chunked_prefill=chunked,
        max_num_partial_prefills=draw(st.sampled_from([None, None, 1, 2])) if chunked else None,
        max_model_len=384,
        enable_prefix_caching=caching,
        prefix_caching_hash_algo=draw(st.sampled_from(["sha256", "builtin"])),
        policy=policy,
        loop_order=order,
        options=PolicyOptions(extra, force_fifo_every=draw(st.sampled_from([0, 0, 3]))),
        kv_tiers=tiers,
    )  # fmt: skip
