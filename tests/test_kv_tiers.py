"""KV cache tiers (issue 17): blocks evicted from the device move down tiers and
prefix hits load them back, in the one block manager both backends share.

- The policies: LRU order, ARC keeps reused blocks through a scan of one-time ones.
- The block manager: offload on device eviction, demotion through tiers, drop at the
  last one, loads that count as cached tokens, pinned slots, exact accounting.
- A content-tracking backend (hypothesis): every copy the block manager records is
  applied to labelled fake pools, every step's prefix blocks must hold the content
  of their hash, every request ends exactly once, no block leaks, tier accounting
  exact; and the simulator's multi-step jumps give the same records with tiers.
- Pricing: loads stall the admitting step, or overlap it; offloads cost nothing.
- The flags, result keys, cluster table and Prometheus metrics.
- The executor: greedy outputs equal ``generate()`` while blocks move to the host
  tier and back (real copies into a CPU pool).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roseinfer.block_manager import BlockManager
from roseinfer.calibration.cost_model import BatchShape
from roseinfer.cli.config import kv_tier_config
from roseinfer.cli.flags import CliError
from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepResult, VirtualClock, drive
from roseinfer.kv_tiers import (
    DEVICE,
    KVTierConfig,
    KVTierError,
    KVTierSpec,
    KVTransfers,
    kv_tier_summary,
    tier_from_gib,
)
from roseinfer.policies.kv_tiers import ARCTierPolicy, LRUTierPolicy, ReuseGatedTierPolicy
from roseinfer.records import RecordBuilder
from roseinfer.registry import UnknownPolicyError, load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput
from roseinfer.sequence import Sequence
from roseinfer.simulator import make_cost_model, simulate

REGISTRY = load_registry()
COST = make_cost_model("llama-3.1-8b", "h100-sxm")
BLOCK_BYTES = 2 * 2**20  # Llama-3.1-8B: 128 KiB per token x 16 tokens


def tiers(*sizes: int, policy: str = "lru", overlap: bool = False) -> KVTierConfig:
    """Tiers t0, t1, ... of these sizes (blocks), 50 GB/s and 5 GB/s reads."""
    specs = tuple(
        KVTierSpec(f"t{i}", n, 50e9 if i == 0 else 5e9, 50e9 if i == 0 else 3e9)
        for i, n in enumerate(sizes)
    )
    return KVTierConfig(specs, BLOCK_BYTES, policy=policy, overlap=overlap).resolved(REGISTRY)


def seq_of(i: int, token_ids: list[int], max_tokens: int = 4) -> Sequence:
    req = Request(f"r{i}", 0.0, len(token_ids), max_tokens, tuple(token_ids))
    return Sequence(i, req)


# ----------------------------------------------------------------- policies


def test_lru_evicts_least_recent_and_touch_refreshes() -> None:
    lru = LRUTierPolicy(3)
    for h in (1, 2, 3):
        lru.insert(h)
    lru.touch(1)
    assert lru.evict(4) == 2
    lru.insert(4)
    assert list(lru) == [3, 1, 4] and len(lru) == 3
    lru.remove(3)
    lru.reinsert(3)  # back after a load: most recent
    assert list(lru) == [1, 4, 3]
    lru.remove(1)
    assert lru.evict(5) == 4 and lru.evict(6) == 3
    with pytest.raises(LookupError):
        lru.evict(7)


def run_policy(policy, refs: list[int]) -> int:
    """Hits of a cache of ``policy.capacity_blocks`` over a reference string."""
    held: set[int] = set()
    hits = 0
    for h in refs:
        if h in held:
            hits += 1
            policy.touch(h)
            continue
        if len(held) == policy.capacity_blocks:
            held.remove(policy.evict(h))
        policy.insert(h)
        held.add(h)
        assert len(policy) == len(held) and set(policy) == held
    return hits


def test_arc_keeps_reused_blocks_through_a_scan() -> None:
    """A hot set of 4 reused between scans of 20 one-time blocks: LRU (capacity 8)
    loses the hot set to every scan, ARC keeps it in T2 (Megiddo & Modha's scan
    resistance)."""
    hot = [1, 2, 3, 4]
    refs: list[int] = []
    for r in range(30):
        refs += hot * 2 + [1000 + 20 * r + i for i in range(20)]
    lru_hits = run_policy(LRUTierPolicy(8), refs)
    arc_hits = run_policy(ARCTierPolicy(8), refs)
    assert arc_hits >= lru_hits + 4 * 25, (arc_hits, lru_hits)


def test_arc_ghost_hits_adapt_the_target() -> None:
    arc = ARCTierPolicy(4)
    for h in (1, 2, 3, 4):
        arc.insert(h)
    arc.touch(3)
    arc.touch(4)  # T1 = [1, 2], T2 = [3, 4]
    assert arc.evict(5) == 1  # T1 is over its target (0): its least recent into B1
    arc.insert(5)
    assert arc.p == 0
    assert arc.evict(1) == 2  # 1 is a B1 ghost: T1 was too small, its target grows
    assert arc.p == 1
    arc.insert(1)  # a ghost comes back into T2
    assert arc.evict(6) == 3  # T1 = [5] is at its target: T2's least recent into B2
    assert set(arc) == {5, 4, 1}
    arc.remove(5)
    arc.reinsert(5)  # loaded: a reuse, into T2
    assert arc.evict(7) == 4 and set(arc) == {1, 5}


def test_reuse_gating_stores_blocks_looked_up_twice() -> None:
    """vLLM's reuse-frequency gating: a block is offloaded only once its hash was
    looked up below the device twice, so the first request's blocks are dropped
    and a repeated prefix's are kept."""
    config = KVTierConfig((KVTierSpec("t0", 8, 1e9, 1e9),), 4096, policy=ReuseGatedTierPolicy)
    bm = BlockManager(3, 4, True, kv_tiers=config)
    a, b = list(range(100, 109)), list(range(200, 209))
    bm.free(fill(bm, 0, a))  # looked up once (a miss)
    bm.free(fill(bm, 1, b))  # evicts a's 2 blocks: seen once, not stored
    assert bm.kv_tier_counters()["tiers"]["t0"]["stored_blocks"] == 0
    bm.free(fill(bm, 2, a))  # a again: looked up a 2nd time, evicts b's (seen once)
    bm.free(fill(bm, 3, b))  # evicts a's blocks: now stored
    c = bm.kv_tier_counters()["tiers"]["t0"]
    assert c["stored_blocks"] == 2 and c["held_blocks"] == 2
    seq = seq_of(4, a + [1, 2])
    assert bm.lookup(seq) == [DEVICE, DEVICE]
    bm.check_invariants()
    tracker = ReuseGatedTierPolicy(4, {"store_threshold": 1, "max_size": 2})
    tracker.observe([1, 2, 3])
    assert not tracker.admit(1) and tracker.admit(2) and tracker.admit(3)


def test_policies_are_registered_plugins() -> None:
    assert REGISTRY.kv_tier_policy("lru") is LRUTierPolicy
    assert REGISTRY.kv_tier_policy("arc") is ARCTierPolicy
    assert REGISTRY.kv_tier_policy("reuse") is ReuseGatedTierPolicy
    with pytest.raises(UnknownPolicyError, match="known: arc, lru, reuse"):
        REGISTRY.kv_tier_policy("mru")
    assert "KV tier policies (--kv-tier-policy" in REGISTRY.describe()


# -------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "device"}, "not 'device'"),
        ({"name": "a b"}, "letters"),
        ({"num_blocks": 0}, "num_blocks must be > 0"),
        ({"read_bytes_per_s": math.nan}, "finite"),
        ({"write_bytes_per_s": math.inf}, "finite"),
        ({"read_bytes_per_s": -1.0}, "> 0"),
    ],
)
def test_tier_specs_reject_bad_values(kwargs: dict, match: str) -> None:
    spec = {"name": "host", "num_blocks": 4, "read_bytes_per_s": 1.0, "write_bytes_per_s": 1.0}
    with pytest.raises(KVTierError, match=match):
        KVTierSpec(**{**spec, **kwargs})


def test_tier_configs_reject_duplicates_and_convert_gib() -> None:
    with pytest.raises(KVTierError, match="repeated: a"):
        KVTierConfig((KVTierSpec("a", 1, 1, 1), KVTierSpec("a", 2, 1, 1)), 8)
    spec = tier_from_gib("host", 256, 50, 40, BLOCK_BYTES)
    assert spec.num_blocks == 131072 and spec.read_bytes_per_s == 50e9
    with pytest.raises(KVTierError, match="holds no KV block"):
        tier_from_gib("host", 1e-6, 50, 50, BLOCK_BYTES)
    with pytest.raises(ValueError, match="enable prefix caching"):
        BlockManager(8, 4, False, kv_tiers=tiers(4))
    with pytest.raises(ValueError, match="no-enable-prefix-caching"):
        SchedulerConfig(num_kv_blocks=8, enable_prefix_caching=False, kv_tiers=tiers(4))


# ------------------------------------------------------------ block manager


def fill(bm: BlockManager, i: int, ids: list[int]) -> Sequence:
    """Admit a request for all its tokens, as a first admission does."""
    seq = seq_of(i, ids)
    cached = bm.allocate(seq)
    bm.record_prefix_query(seq, cached)
    return seq


def test_evicted_blocks_move_down_and_hits_load_them_back() -> None:
    bm = BlockManager(4, 4, True, kv_tiers=tiers(4))
    bm.record_transfer_ops = True
    a = list(range(100, 113))  # 3 full blocks + 1 token
    sa = fill(bm, 0, a)
    bm.free(sa)
    sb = fill(bm, 1, list(range(200, 213)))  # takes all 4 blocks: a's 3 cached ones move down
    moved = bm.pop_transfers()
    assert moved is not None and moved.num_offloaded == 3 and moved.load_s == 0
    assert [op[2] for op in moved.ops] == [0, 0, 0] and {op[0] for op in moved.ops} == {DEVICE}
    bm.free(sb)
    sa2 = seq_of(2, a + [7, 8, 9])
    assert bm.lookup(sa2) == [DEVICE] * 3  # the hit goes on in the tier
    assert bm.num_cached_tokens(sa2) == 12
    assert bm.can_allocate(sa2)
    assert bm.allocate(sa2) == 12
    bm.record_prefix_query(sa2, 12)
    loads = bm.pop_transfers()
    assert loads is not None and loads.num_loaded == 3
    assert loads.load_s == pytest.approx(3 * BLOCK_BYTES / 50e9)
    # b's blocks were evicted for them first (offloads), then the loads, in that order
    assert [op[0] for op in loads.ops] == [DEVICE] * 3 + [0] * 3
    load_dst = [op[3] for op in loads.ops[3:]]
    assert bm.block_table(sa2)[:3] == load_dst
    counters = bm.kv_tier_counters()
    assert counters["tiers"]["t0"]["hit_tokens"] == 12 and counters["device_hit_tokens"] == 0
    bm.check_invariants()
    # the loaded blocks are on the device again: a new request hits them there
    bm.free(sa2)
    assert all(b != DEVICE for b in bm.lookup(seq_of(3, a + [1])))
    bm.check_invariants()


def test_full_tier_demotes_to_the_next_and_drops_at_the_last() -> None:
    bm = BlockManager(2, 4, True, kv_tiers=tiers(1, 1))
    bm.record_transfer_ops = True
    blocks = [[i * 10 + j for j in range(4)] for i in range(4)]
    for i, ids in enumerate(blocks):  # one full block each (+1 token so it is cached)
        bm.free(fill(bm, i, ids + [999]))
    ops = bm.pop_transfers().ops
    # 3 device evictions: 1st -> t0; 2nd -> t0 demotes the 1st to t1 first; 3rd drops the 1st
    assert ops[0][2:] == (0, 0)
    assert ops[1] == (0, 0, 1, 0) and ops[2][2:] == (0, 0)
    assert ops[3] == (0, 0, 1, 0) and ops[4][2:] == (0, 0)
    c = bm.kv_tier_counters()["tiers"]
    assert (c["t0"]["stored_blocks"], c["t0"]["evicted_blocks"]) == (3, 2)
    assert (c["t1"]["stored_blocks"], c["t1"]["evicted_blocks"]) == (2, 1)
    seq = seq_of(9, blocks[1] + [5])
    assert bm.num_cached_tokens(seq) == 4  # found in t1
    bm.allocate(seq)
    bm.record_prefix_query(seq, 4)
    assert bm.kv_tier_counters()["tiers"]["t1"]["hit_tokens"] == 4
    bm.check_invariants()


def test_loads_pin_their_slots_while_device_blocks_are_taken() -> None:
    """A 2-block tier full of the hit's blocks: taking device blocks for them evicts
    cached device blocks into that same tier, which must not overwrite the slots
    being loaded (they go one tier down, or nowhere)."""
    bm = BlockManager(4, 2, True, kv_tiers=tiers(2, 2))
    bm.record_transfer_ops = True
    hit = [1, 2, 3, 4]
    bm.free(fill(bm, 0, hit + [0]))  # blocks [1,2] [3,4] cached
    bm.free(fill(bm, 1, [5, 6, 7, 8, 0]))  # evicts hit's 2 blocks into t0
    bm.free(fill(bm, 2, [11, 12, 0]))  # 2 device blocks still cached (5-8)
    bm.pop_transfers()
    seq = seq_of(3, hit + [9, 9, 9])
    assert bm.lookup(seq) == [DEVICE, DEVICE]
    bm.allocate(seq)  # 4 blocks: evicts 5-8 (and 11-12) while t0's slots are pinned
    ops = bm.pop_transfers().ops
    loads = [op for op in ops if op[2] == DEVICE]
    assert len(loads) == 2 and all(op[0] == 0 for op in loads)
    pinned = {op[1] for op in loads}
    first_load = ops.index(loads[0])
    assert not any(op[2] == 0 and op[3] in pinned for op in ops[:first_load])
    bm.check_invariants()


def test_no_tier_block_manager_has_no_tier_state() -> None:
    bm = BlockManager(4, 4, True)
    assert bm._tiers is None and bm.kv_tier_counters() == {}
    bm.free(fill(bm, 0, list(range(9))))
    fill(bm, 1, list(range(50, 66)))
    assert bm.pop_transfers() is None


# ------------------------------------------------ content-tracking backend


class ContentBackend:
    """Applies each output's recorded copies to labelled fake pools, writes the
    content a step computes, and checks that every prefix block a step reads
    holds its hash's content (what the executor's tensors would hold)."""

    def __init__(self, sched: Scheduler, jump: bool) -> None:
        self.sched, self.jump = sched, jump
        self.bm = sched.block_manager
        self.bm.record_transfer_ops = True
        self.pools: dict[tuple[int, int], object] = {}
        self.num_loads = 0

    def decode_run_length(self, out, now_s, next_arrival_s, max_steps):  # type: ignore[no-untyped-def]
        return max_steps if self.jump else 1

    def execute(self, out: SchedulerOutput, now_s: float) -> StepResult:
        tr = out.kv_transfers
        if tr is not None:
            for src, src_i, dst, dst_i in tr.ops:
                self.pools[dst, dst_i] = self.pools.get((src, src_i))
            self.num_loads += tr.num_loaded
        bs = self.bm.block_size
        for item in out.scheduled:  # the forward writes all new K/V before attending
            table, hashes = self.bm.block_table(item.seq), item.seq.block_hashes or []
            end = item.num_context_tokens + (out.num_steps - 1 if item.is_decode else 0)
            for i in range(item.num_computed_tokens // bs, -(-end // bs)):
                full = i < len(hashes) and (i + 1) * bs <= end
                label = ("h", hashes[i]) if full else ("w", item.seq.seq_id, i)
                self.pools[DEVICE, table[i]] = label
        for item in out.scheduled:
            table, hashes = self.bm.block_table(item.seq), item.seq.block_hashes or []
            for i in range(min(len(hashes), item.num_context_tokens // bs)):
                assert self.pools.get((DEVICE, table[i])) == ("h", hashes[i]), (
                    f"{item.seq} block {i} (device block {table[i]}) holds the wrong content"
                )
        return StepResult([now_s + 0.001 * (k + 1) for k in range(out.num_steps)])


def run_tracked(reqs: list[Request], config: SchedulerConfig, jump: bool):  # type: ignore[no-untyped-def]
    policy = REGISTRY.make(config.policy, config.loop_order, config.options)
    sched = Scheduler(config, policy)
    backend = ContentBackend(sched, jump)
    ended: dict[str, int] = {}
    records = RecordBuilder()

    def on_ended(seqs: list[Sequence]) -> None:
        for s in seqs:
            ended[s.request_id] = ended.get(s.request_id, 0) + 1
        records.extend(seqs, sched.step_log)

    drive(sched, sorted(reqs, key=lambda r: r.arrival_time_s), backend, VirtualClock(), on_ended)
    assert ended == {r.request_id: 1 for r in reqs}, "a request did not end exactly once"
    sched.check_invariants()  # includes every tier's accounting
    assert sched.block_manager.num_used_blocks == 0
    return sched, backend, records.frame()


@st.composite
def shared_prefix_workloads(draw: st.DrawFn) -> list[Request]:
    """Requests over a few shared prefixes (token ids or Mooncake hash ids)."""
    n = draw(st.integers(2, 30))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    with_tokens = draw(st.booleans())
    prefixes = [rng.integers(0, 50, int(rng.integers(8, 80))).tolist() for _ in range(3)]
    gaps = rng.exponential(draw(st.sampled_from([0.0005, 0.005, 0.05])), n)
    reqs = []
    for i, t in enumerate(np.cumsum(gaps)):
        tail = rng.integers(0, 50, int(rng.integers(1, 40))).tolist()
        ids = prefixes[int(rng.integers(0, 3))] + tail
        out = int(rng.integers(1, 30))
        if with_tokens:
            reqs.append(Request(f"r{i}", float(t), len(ids), out, tuple(ids)))
        else:
            hashes = tuple(int(h) for h in rng.integers(0, 3, -(-len(ids) // 8)))
            reqs.append(
                Request(f"r{i}", float(t), len(ids), out, prefix_hash_ids=hashes,
                        prefix_hash_block_tokens=8)
            )  # fmt: skip
    return reqs


@st.composite
def tier_configs(draw: st.DrawFn) -> SchedulerConfig:
    policy = draw(st.sampled_from(["fifo", "budget", "pack", "lpm", "sjf", "priority"]))
    entry = REGISTRY.policies[policy].cls
    chunked = draw(st.booleans())
    sizes = draw(st.lists(st.integers(1, 12), min_size=1, max_size=2))
    budget = draw(st.sampled_from([None, 64])) if entry.uses_token_budget else None
    return SchedulerConfig(
        num_kv_blocks=draw(st.integers(16, 40)),
        block_size=4,
        max_num_seqs=draw(st.integers(1, 6)),
        prefill_max_tokens=budget,
        max_num_batched_tokens=64 if chunked else None,
        enable_chunked_prefill=chunked,
        max_model_len=128,
        policy=policy,
        loop_order=draw(st.sampled_from(["prefill-first", "decode-first"])),
        kv_tiers=tiers(*sizes, policy=draw(st.sampled_from(["lru", "arc", "reuse"]))),
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=shared_prefix_workloads(), config=tier_configs(), jump=st.booleans())
def test_tier_copies_keep_every_prefix_block_right(reqs, config, jump) -> None:
    sched, backend, records = run_tracked(reqs, config, jump)
    bm = sched.block_manager
    c = bm.kv_tier_counters()
    tier_hits = sum(t["hit_tokens"] for t in c["tiers"].values())
    assert c["device_hit_tokens"] + tier_hits == bm.num_hit_tokens  # no KV arrives with requests
    assert backend.num_loads == sum(t["loaded_blocks"] for t in c["tiers"].values())
    assert int(records["num_cached_prompt_tokens"].sum()) == bm.num_hit_tokens


class EvenOnly(LRUTierPolicy):
    """A gating policy (stores only even hashes), as a third-party plugin would."""

    name = "even-only"

    def admit(self, block_hash: int) -> bool:
        return block_hash % 2 == 0


def test_a_gating_policy_stores_only_what_it_admits() -> None:
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, 50, 40).tolist() for _ in range(3)]
    reqs = [
        Request(f"r{i}", 0.01 * i, 48, 3, tuple(prefixes[i % 3] + rng.integers(0, 50, 8).tolist()))
        for i in range(24)
    ]
    config = SchedulerConfig(
        num_kv_blocks=16, block_size=4, max_num_seqs=2, max_model_len=64,
        kv_tiers=KVTierConfig((KVTierSpec("t0", 64, 1e9, 1e9),), 4096, policy=EvenOnly),
    )  # fmt: skip
    sched, backend, _ = run_tracked(reqs, config, jump=True)
    tier = sched.block_manager._tiers[0]
    assert tier.slots and all(h % 2 == 0 for h in tier.slots)
    assert backend.num_loads > 0


def assert_same_frames(a, b) -> None:  # type: ignore[no-untyped-def]
    """Every column equal, token times included (as ``test_jump_equality``)."""
    import pandas as pd

    assert list(a.columns) == list(b.columns)
    for col in a.columns:
        if col == "token_times_s":
            for x, y in zip(a[col], b[col]):
                np.testing.assert_array_equal(x, y)
        else:
            pd.testing.assert_series_equal(a[col], b[col], check_exact=True)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=shared_prefix_workloads(), config=tier_configs(), overlap=st.booleans())
def test_jumps_equal_stepping_with_tiers(reqs, config, overlap) -> None:
    from dataclasses import replace

    assert config.kv_tiers is not None
    config = replace(config, kv_tiers=replace(config.kv_tiers, overlap=overlap))
    fast = simulate(reqs, config, COST, jump=True)
    slow = simulate(reqs, config, COST, jump=False)
    assert fast.num_steps == slow.num_steps
    assert_same_frames(fast.records, slow.records)
    np.testing.assert_array_equal(fast.scheduler.step_log.end_s, slow.scheduler.step_log.end_s)
    a, b = fast.scheduler.block_manager, slow.scheduler.block_manager
    assert a.kv_tier_counters() == b.kv_tier_counters()


# ------------------------------------------------------------------ pricing


def test_loads_stall_the_admitting_step_or_overlap_it() -> None:
    t = KVTransfers(load_s=0.004)
    assert t.step_time_s(0.010) == pytest.approx(0.014)
    t.overlap = True
    assert t.step_time_s(0.010) == 0.010 and t.step_time_s(0.001) == 0.004
    assert KVTransfers().step_time_s(0.01) == 0.01


def shared_then_evicted() -> list[Request]:
    """r0 and r2 share a 64-block prompt prefix; r1's unique prompt in between
    evicts it from a 100-block device pool."""
    prefix = list(range(1024))
    return [
        Request("r0", 0.0, 1040, 2, tuple(prefix + [1] * 16)),
        Request("r1", 1.0, 1584, 2, tuple(range(5000, 6584))),
        Request("r2", 2.0, 1040, 2, tuple(prefix + [2] * 16)),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_simulator_prices_loads_on_the_admitting_step(overlap: bool) -> None:
    reqs = shared_then_evicted()
    base = SchedulerConfig(num_kv_blocks=100, block_size=16, max_model_len=2048)
    plain = simulate(reqs, base, COST)
    with_tier = {**_fields(base), "kv_tiers": tiers(200, overlap=overlap)}
    tiered = simulate(reqs, SchedulerConfig(**with_tier), COST)

    def cached(r):  # type: ignore[no-untyped-def]
        return dict(zip(r.records.request_id, r.records.num_cached_prompt_tokens))

    def ttft(r) -> float:  # type: ignore[no-untyped-def]
        return float(r.records.set_index("request_id").first_token_s["r2"] - 2.0)

    assert cached(plain)["r2"] <= 16 and cached(tiered)["r2"] == 1024
    bm = tiered.scheduler.block_manager
    loaded = bm.kv_tier_counters()["tiers"]["t0"]["loaded_blocks"]
    assert loaded >= 63  # the whole prefix but what stayed on the device
    load_s = loaded * BLOCK_BYTES / 50e9
    assert bm.kv_load_s == pytest.approx(load_s)
    # r2 arrives on an idle engine and its one step computes 16 tokens over 1040
    compute_s = COST.step_time_s(BatchShape([16], [1040]))
    expected = max(compute_s, load_s) if overlap else compute_s + load_s
    assert ttft(tiered) == pytest.approx(expected, rel=1e-9)
    assert ttft(tiered) < ttft(plain)
    summary = kv_tier_summary([bm.kv_tier_counters()])
    assert summary["kv_loaded_bytes"] == loaded * BLOCK_BYTES
    assert summary["kv_offloaded_bytes"] >= 64 * BLOCK_BYTES
    assert summary["kv_hit_rate_t0"] == pytest.approx(16 * loaded / (1040 + 1584 + 1040))


def _fields(config: SchedulerConfig) -> dict:
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


# -------------------------------------------------------------- flags, keys


def parse(*argv: str):  # type: ignore[no-untyped-def]
    from roseinfer.cli.sim import build_parser

    return build_parser().parse_args(["--block-size", "16", *argv])


def test_flags_build_tiers_in_order() -> None:
    args = parse(
        "--kv-offloading-size", "256", "--kv-tier", "nvme:1024:7:5", "--kv-tier-policy", "arc",
        "--kv-offloading-overlap",
    )  # fmt: skip
    cfg = kv_tier_config(args, REGISTRY, 131072, 16)
    assert cfg is not None and [t.name for t in cfg.tiers] == ["host", "nvme"]
    assert cfg.tiers[0].num_blocks == 131072 and cfg.tiers[0].read_bytes_per_s == 50e9
    assert cfg.tiers[1].num_blocks == 524288 and cfg.tiers[1].write_bytes_per_s == 5e9
    assert cfg.policy is ARCTierPolicy and cfg.overlap
    assert kv_tier_config(parse(), REGISTRY, 131072, 16) is None


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (("--kv-tier-policy", "arc"), "needs a tier"),
        (("--kv-offloading-overlap",), "needs a tier"),
        (("--kv-offloading-size", "1", "--kv-tier", "host:1:1:1"), "given twice"),
        (("--kv-tier", "a:1:1:1", "--kv-tier", "a:2:1:1"), "given twice"),
        (("--kv-offloading-size", "1", "--no-enable-prefix-caching"), "prefix-caching"),
        (("--kv-offloading-size", "1e-9"), "holds no KV block"),
    ],
)
def test_bad_tier_flags_name_the_fix(argv: tuple[str, ...], match: str) -> None:
    with pytest.raises(CliError, match=match):
        kv_tier_config(parse(*argv), REGISTRY, 131072, 16)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-tier", "nvme:1:1"],
        ["--kv-tier", "nvme:nan:1:1"],
        ["--kv-tier", "nvme:1:inf:1"],
        ["--kv-tier", "nvme:1:1:-5"],
        ["--kv-tier", "1x:1:1:1"],
        ["--kv-offloading-size", "nan"],
        ["--kv-offloading-size", "0"],
    ],
)
def test_malformed_tier_flags_are_one_error_line(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as err:
        parse(*argv)
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rose-sim: error: argument --kv-")


def run_rose_sim(monkeypatch, tmp_path, *argv: str) -> dict:  # type: ignore[no-untyped-def]
    import sys

    from roseinfer.cli.sim import main

    path = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["rose-sim", *argv, "--save-result", str(path)])
    assert main() == 0
    return json.loads(path.read_text())


def test_rose_sim_counts_tier_hits_as_prefix_hits(monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 1024, "output_length": 4,
         "hash_ids": [i % 3 * 100 + k for k in range(2)]}
        for i in range(30)
    ]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    common = ("--trace", str(trace), "--num-kv-blocks", "80", "--max-model-len", "2048")
    plain = run_rose_sim(monkeypatch, tmp_path, *common)
    tiered = run_rose_sim(monkeypatch, tmp_path, *common, "--kv-offloading-size", "1")
    printed = capsys.readouterr().out
    assert "hit rate, host (%)" in printed and "KV loaded (GiB)" in printed
    assert tiered["prefix_cache_hit_rate"] > plain["prefix_cache_hit_rate"] + 0.2
    assert tiered["kv_hit_rate_device"] + tiered["kv_hit_rate_host"] == pytest.approx(
        tiered["prefix_cache_hit_rate"]
    )
    assert tiered["kv_loaded_bytes"] > 0 and tiered["kv_offloaded_bytes"] > 0
    assert tiered["kv_tiers"].startswith("host:512 blocks:50/50 GB/s")
    assert tiered["completed"] == tiered["num_requests"] == 30
    cluster = run_rose_sim(
        monkeypatch, tmp_path, *common, "--kv-offloading-size", "1", "--num-replicas", "2",
        "--router", "prefix-aware",
    )  # fmt: skip
    rows_ = cluster["replica_summaries"]
    assert all("kv_hit_rate_host" in r and "kv_loaded_bytes" in r for r in rows_)
    assert sum(r["kv_loaded_bytes"] for r in rows_) == cluster["kv_loaded_bytes"]
    assert "    host%" in capsys.readouterr().out


def test_prometheus_metrics_per_tier() -> None:
    pytest.importorskip("prometheus_client")
    from roseinfer.serve.metrics import _kv_tier_metrics

    bm = BlockManager(4, 4, True, kv_tiers=tiers(4))
    bm.free(fill(bm, 0, list(range(13))))
    bm.free(fill(bm, 1, list(range(50, 66))))
    fill(bm, 2, list(range(12)) + [77])
    families = {m.name: m for m in _kv_tier_metrics(bm.kv_tier_counters())}
    rate = {s.labels["tier"]: s.value for s in families["roseinfer_kv_tier_hit_rate"].samples}
    assert rate == {"device": 0.0, "t0": pytest.approx(12 / (13 + 16 + 13))}
    loaded = families["roseinfer_kv_loaded_bytes"].samples
    assert [(s.labels["tier"], s.value) for s in loaded if s.name.endswith("_total")] == [
        ("t0", 3 * BLOCK_BYTES)
    ]
    assert list(_kv_tier_metrics({})) == []


# ----------------------------------------------------------------- executor


def test_executor_greedy_output_survives_the_host_tier() -> None:
    """A 10-block device pool, a 6-block host tier: requests over two shared
    prefixes, run one at a time between long unique prompts that flush the
    device, so prefix blocks are evicted to the host (some then dropped), loaded
    back and evicted again; every output equals ``generate()``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_engine import assert_matches_generate, cached_model, random_ids, request
    from test_engine import run as run_engine

    from roseinfer.executor.engine import Engine
    from roseinfer.executor.model_runner import ModelRunner

    model = cached_model("tiny-gpt2")
    prefixes = [random_ids(12, 300), random_ids(9, 301)]
    reqs = []
    for i in range(12):  # one at a time: a prefix user, then a long unique flusher
        if i % 3 == 2:
            reqs.append(request(i, random_ids(28 + i % 2, 500 + i), 5))
        else:
            reqs.append(request(i, prefixes[i % 2] + random_ids(3 + i % 4, 400 + i), 5 + i % 3))
    num_blocks, host = 10, 6
    config = SchedulerConfig(
        num_kv_blocks=num_blocks, block_size=4, max_num_seqs=1, max_model_len=64,
        kv_tiers=KVTierConfig((KVTierSpec("host", host, 50e9, 50e9),), 4096, LRUTierPolicy),
    )  # fmt: skip
    runner = ModelRunner(
        model, num_kv_blocks=num_blocks, block_size=4, device="cpu", dtype=torch.float32,
        num_tier_blocks=host,
    )  # fmt: skip
    result, _ = run_engine(Engine(runner, config), reqs)
    assert_matches_generate(model, reqs, result)
    c = result.scheduler.block_manager.kv_tier_counters()["tiers"]["host"]
    assert c["loaded_blocks"] >= 5 and c["stored_blocks"] > host and c["evicted_blocks"] > 0
    cached = result.records["num_cached_prompt_tokens"]
    assert int(cached.sum()) >= 4 * c["loaded_blocks"]


def test_metrics_endpoint_reports_the_host_tier() -> None:
    """``/metrics``' text, from an engine whose prefix blocks went to the host and back."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families
    from test_engine import cached_model, random_ids, request

    from roseinfer.executor.engine import Engine
    from roseinfer.executor.model_runner import ModelRunner
    from roseinfer.serve.metrics import ServerMetrics

    prefix = random_ids(12, 7)
    reqs = [
        request(0, prefix + [1, 2], 3),
        request(1, random_ids(34, 8), 3),  # all 10 blocks: the prefix goes to the host
        request(2, prefix + [3, 4], 3),
    ]
    config = SchedulerConfig(
        num_kv_blocks=10, block_size=4, max_num_seqs=1, max_model_len=64,
        kv_tiers=KVTierConfig((KVTierSpec("host", 8, 50e9, 50e9),), 4096, LRUTierPolicy),
    )  # fmt: skip
    runner = ModelRunner(
        cached_model("tiny-gpt2"), num_kv_blocks=10, block_size=4, device="cpu",
        dtype=torch.float32, num_tier_blocks=8,
    )  # fmt: skip
    engine = Engine(runner, config)
    engine.run(reqs)
    text = ServerMetrics(SimpleNamespace(engine=engine, num_waiting=lambda: 0)).render()  # type: ignore[arg-type]
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
    bm = engine.scheduler.block_manager
    c = bm.kv_tier_counters()
    host = c["tiers"]["host"]
    assert host["loaded_blocks"] >= 2 and host["stored_blocks"] >= 3
    assert samples["roseinfer_kv_tier_hit_rate", "host"] == pytest.approx(host["hit_tokens"] / 62)
    assert samples["roseinfer_kv_tier_hit_rate", "device"] == pytest.approx(
        c["device_hit_tokens"] / 62
    )
    assert (host["hit_tokens"] + c["device_hit_tokens"]) / 62 == pytest.approx(12 / 62)
    assert samples["roseinfer_kv_loaded_bytes_total", "host"] == host["loaded_blocks"] * 4096
    assert samples["roseinfer_kv_offloaded_bytes_total", "host"] == host["stored_blocks"] * 4096


def test_engine_refuses_tiers_it_cannot_hold() -> None:
    torch = pytest.importorskip("torch")
    from test_engine import cached_model

    from roseinfer.executor.engine import Engine
    from roseinfer.executor.model_runner import ModelRunner

    runner = ModelRunner(
        cached_model("tiny-gpt2"), num_kv_blocks=8, block_size=4, device="cpu",
        dtype=torch.float32, num_tier_blocks=4,
    )  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=8, block_size=4, max_model_len=32, kv_tiers=tiers(4, 4))
    with pytest.raises(ValueError, match="one host KV tier"):
        Engine(runner, config)
    with pytest.raises(ValueError, match="no host tier"):
        ModelRunner(
            cached_model("tiny-gpt2"), num_kv_blocks=8, block_size=4, device="cpu",
            dtype=torch.float32,
        ).apply_kv_transfers([(DEVICE, 0, 0, 0)])  # fmt: skip


def test_batched_copies_equal_copies_one_by_one() -> None:
    torch = pytest.importorskip("torch")
    from test_engine import cached_model

    from roseinfer.executor.model_runner import ModelRunner, _copy_batches

    ops = [(DEVICE, 0, 0, 1), (DEVICE, 1, 0, 2), (0, 1, DEVICE, 3), (DEVICE, 3, 0, 1),
           (0, 2, DEVICE, 0), (0, 1, DEVICE, 2), (DEVICE, 2, 0, 0), (DEVICE, 0, 0, 0)]  # fmt: skip
    assert len(_copy_batches(ops)) == 6  # cut at level changes and the rewrite of slot 0
    runner = ModelRunner(
        cached_model("tiny-gpt2"), num_kv_blocks=4, block_size=4, device="cpu",
        dtype=torch.float32, num_tier_blocks=3,
    )  # fmt: skip
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    runner.tier_kv_cache.normal_()
    pools = {DEVICE: runner.kv_cache.clone(), 0: runner.tier_kv_cache.clone()}
    for src, si, dst, di in ops:
        pools[dst][:, :, di] = pools[src][:, :, si]
    runner.apply_kv_transfers(ops)
    assert torch.equal(runner.kv_cache, pools[DEVICE])
    assert torch.equal(runner.tier_kv_cache, pools[0])
