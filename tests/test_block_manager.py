"""KV block accounting and prefix caching."""

from __future__ import annotations

import pytest
from conftest import req

from roseinfer.block_manager import BlockManager, compute_block_hashes
from roseinfer.sequence import Sequence


def seq(i: int, ids: list[int] | None = None, prompt: int = 0, output: int = 4, **kw) -> Sequence:
    n = len(ids) if ids is not None else prompt
    return Sequence(i, req(i, n, output, prompt_token_ids=tuple(ids) if ids else None, **kw))


def test_allocate_and_free_balance() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    a = seq(0, prompt=9)
    assert bm.can_allocate(a)
    assert bm.allocate(a) == 0
    assert len(bm.block_table(a)) == 3
    assert bm.num_free_blocks == 7
    bm.check_invariants()
    bm.free(a)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_cannot_allocate_past_the_pool() -> None:
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    assert not bm.can_allocate(seq(0, prompt=9))
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq(0, prompt=9))


def test_prefix_hit_reuses_full_blocks_and_computes_the_last_token() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = seq(0, list(range(10)))
    bm.allocate(a)
    b = seq(1, list(range(10)) + [99])
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b) == 8
    assert bm.block_table(b)[:2] == bm.block_table(a)[:2]
    # an identical, block-aligned prompt still computes its last block
    c = seq(2, list(range(8)))
    assert bm.num_cached_tokens(c) == 4
    bm.check_invariants()


def test_identical_prompts_in_one_round_share_blocks() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a, b = seq(0, list(range(13))), seq(1, list(range(13)))
    bm.allocate(a)
    assert bm.allocate(b) == 12  # registered at allocation: in-batch dedup (seed 004)
    assert bm.num_used_blocks == 4 + 1


def test_different_first_block_breaks_the_chain() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    bm.allocate(seq(0, list(range(12))))
    other = seq(1, [7, 7, 7, 7] + list(range(4, 12)))
    assert bm.num_cached_tokens(other) == 0


def test_freed_cached_blocks_stay_reusable_until_evicted_lru() -> None:
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = seq(0, list(range(9)))  # 3 blocks, 2 full hashed
    bm.allocate(a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = seq(1, list(range(9)))
    assert bm.num_cached_tokens(again) == 8
    # a 4-block request needs every block: the cached ones get evicted
    big = seq(2, [50 + i for i in range(16)], output=1)
    bm.allocate(big)
    bm.free(big)
    assert bm.num_cached_tokens(seq(3, list(range(9)))) == 0
    bm.check_invariants()


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    bm.allocate(seq(0, list(range(12))))
    assert bm.num_cached_tokens(seq(1, list(range(12)))) == 0


def test_mooncake_hash_ids_share_prefix_blocks() -> None:
    a = req(0, 1024, prefix_hash_ids=(1, 2), prefix_hash_block_tokens=512)
    b = req(1, 1024, prefix_hash_ids=(1, 3), prefix_hash_block_tokens=512)
    ha, hb = compute_block_hashes(a, 16), compute_block_hashes(b, 16)
    assert len(ha) == 64
    assert ha[:32] == hb[:32]
    assert not set(ha[32:]) & set(hb[32:])


def test_requests_without_ids_or_hashes_share_nothing() -> None:
    assert compute_block_hashes(req(0, 100), 16) == []


def test_grow_adds_blocks_for_decode_slots() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = seq(0, prompt=4)
    bm.allocate(a)
    assert bm.num_blocks_to_grow(a, 5) == 1
    bm.grow(a, 5)
    assert len(bm.block_table(a)) == 2
    assert bm.num_blocks_to_grow(a, 8) == 0
