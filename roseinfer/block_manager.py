"""KV-cache block accounting shared by the simulator and the executor.

The pool has ``num_blocks`` blocks of ``block_size`` tokens. Each block has a
reference count; blocks with no reference sit in a free queue in LRU order.
With prefix caching, every full prompt block gets a hash chained with its
parent block's hash (as vLLM's ``hash_block_tokens`` and nano-vllm do); a
hash-to-block index lets a later request reuse the block instead of computing
it again. A freed block keeps its hash until it is taken from the free queue
for new content (LRU eviction), so "free" includes evictable cached blocks.

The executor's K/V tensors follow these block ids; the simulator has no
tensors, so its hit rates and preemptions are this algorithm's, not an imitation.

With KV tiers (:mod:`roseinfer.kv_tiers`), an evicted cached block moves down to
the first tier instead of being forgotten, and a prefix hit goes on through the
tiers: those blocks are loaded back at admission. Without tiers, the hot paths
(``lookup``, ``_take``, ``_evict``, ``free``, ``grow``) pay one attribute check.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

import numpy as np

from roseinfer.kv_tiers import (
    DEVICE,
    KVTier,
    KVTierConfig,
    KVTierPolicy,
    KVTransfers,
    make_tiers,
)
from roseinfer.request import Request
from roseinfer.sequence import Sequence

BlockHasher = Callable[[int, SequenceABC[int]], int]
"""``hasher(parent_hash, block_token_ids) -> block hash`` (the first block's parent is 0)."""


def sha256_block_hash(parent: int, token_ids: SequenceABC[int]) -> int:
    """SHA-256 of the parent hash (32 bytes, big-endian) and the block's token ids
    (int64, native order), as an int. Collision-resistant: a crafted prompt cannot
    alias another tenant's cached block, which 64-bit ``hash()`` allows (vLLM's
    CVE-2025-25183; vLLM hashes blocks with SHA-256 since)."""
    data = parent.to_bytes(32, "big") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest(), "big")


def builtin_block_hash(parent: int, token_ids: SequenceABC[int]) -> int:
    """Python's 64-bit ``hash()`` of the tuple: 0.6-0.9 us per 16-token block
    against SHA-256's 4.1-5.9 us on the dev CPU (``benchmarks/input_costs.py``), but
    not collision-resistant (fine for a simulation, where nobody crafts prompts)."""
    return hash((parent, *token_ids))


BLOCK_HASHERS: dict[str, BlockHasher] = {"sha256": sha256_block_hash, "builtin": builtin_block_hash}
"""Hash functions by ``--prefix-caching-hash-algo`` name (vLLM's flag)."""


def compute_block_hashes(
    request: Request, block_size: int, hasher: BlockHasher = sha256_block_hash
) -> list[int]:
    """Chained hashes of the request's full prompt blocks.

    Token ids are hashed when present: block i's hash is ``hasher(hash of block
    i-1, tokens of block i)``. Otherwise Mooncake ``prefix_hash_ids`` (one id per
    ``prefix_hash_block_tokens`` tokens, where an equal id already implies an
    equal whole prefix) give block i the id of the hash block holding its last
    token, paired with i. Without either, the prompt shares nothing: [].

    Returns:
        One int per full prompt block (``num_prompt_tokens // block_size``).
    """
    num_full = request.num_prompt_tokens // block_size
    ids = request.prompt_token_ids
    if ids is not None:
        hashes: list[int] = []
        parent = 0
        for i in range(num_full):
            parent = hasher(parent, ids[i * block_size : (i + 1) * block_size])
            hashes.append(parent)
        return hashes
    hash_ids = request.prefix_hash_ids
    if hash_ids:
        return _prefix_id_hashes(hash_ids, request.prefix_hash_block_tokens, block_size, num_full)
    return []


_PREFIX_KEY_SHIFT = 20  # block index bits in a Mooncake block key (prompts < 2**20 blocks)


def _prefix_id_hashes(
    hash_ids: SequenceABC[int], span: int, block_size: int, num_full: int
) -> list[int]:
    """Block keys from Mooncake hash ids: ``-(id << 20 | i) - 1`` for block ``i``
    whose last token lies in hash block ``id`` (negative, and distinct for
    distinct (id, i), vectorized); the tuple hash where ids are too large."""
    last = len(hash_ids) - 1
    owner = np.minimum((np.arange(1, num_full + 1) * block_size - 1) // span, last)
    ids = np.asarray(hash_ids)
    if (
        ids.dtype.kind not in "iu"
        or ids.min() < 0
        or ids.max() >= 1 << 40
        or num_full >= 1 << _PREFIX_KEY_SHIFT
    ):
        return [hash(("prefix", hash_ids[k], i)) for i, k in enumerate(owner.tolist())]
    keys = -((ids[owner].astype(np.int64) << _PREFIX_KEY_SHIFT) | np.arange(num_full)) - 1
    return keys.tolist()


class BlockManager:
    """Free list, reference counts, block tables and the prefix-cache index.

    Every ``can_*`` check has its action beside it (``can_allocate`` /
    ``allocate``, ``can_grow`` / ``grow``); actions assume the check passed and
    raise ``RuntimeError`` otherwise.

    A request's blocks are allocated for the tokens its step computes (the
    whole prompt, or one chunk) and grown as later steps compute more. The
    hash of a full prompt block is registered as soon as a step that computes
    it is scheduled, so a request scheduled later in the same step (or after)
    reuses it: identical prompts admitted together share blocks (seed 004's
    in-batch dedup), and a chunked prefill never exposes a block it has not
    computed yet.

    Args:
        num_blocks: blocks in the pool (> 0).
        block_size: tokens per block (> 0).
        enable_prefix_caching: index full prompt blocks by hash for reuse.
        block_hasher: hashes a block's token ids with its parent's hash
            (default SHA-256; see :data:`BLOCK_HASHERS`).
        kv_tiers: tiers below the device (None: evicted blocks are forgotten).

    Raises:
        ValueError: on a non-positive size, or tiers without prefix caching
            (blocks move between tiers by their hash).
        UnknownPolicyError: for an unregistered tier policy.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        block_hasher: BlockHasher = sha256_block_hash,
        kv_tiers: KVTierConfig | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        if kv_tiers is not None and not enable_prefix_caching:
            raise ValueError("KV tiers move cached blocks by hash: enable prefix caching")
        self.block_hasher = block_hasher
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per-block state exists only for blocks taken at least once (ids below
        # len(self._ref_counts)); ids above are fresh: free, plain, never touched.
        # Memory follows the blocks in use, not the pool size.
        self._ref_counts: list[int] = []
        self._block_hash: list[int | None] = []
        self._hash_to_block: dict[int, int] = {}
        # Free blocks once used: those holding nothing reusable (a stack, taken
        # first, before fresh ids) and cached ones still indexed by hash (LRU
        # order, evicted oldest first).
        self._free_plain: list[int] = []
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._tables: dict[int, list[int]] = {}
        self._num_registered: dict[int, int] = {}  # seq_id -> prompt blocks hashed so far
        self._num_evictions = 0  # bumps whenever a cached block loses its hash
        self.num_queried_tokens = 0  # prompt tokens looked up at first admissions
        self.num_hit_tokens = 0  # of which served from the cache
        # KV tiers (None: none; every hot path tests only this attribute)
        self.kv_tiers = kv_tiers
        self._tiers: list[KVTier] | None = None if kv_tiers is None else make_tiers(kv_tiers)
        self._tier_slots = [t.slots for t in self._tiers or ()]  # hash -> slot, tier by tier
        self._observers = [  # tier policies that watch lookups (reuse-frequency gating)
            t.policy
            for t in self._tiers or ()
            if type(t.policy).observe is not KVTierPolicy.observe
        ]
        self.record_transfer_ops = False  # the executor sets it: it copies by these
        self._pending: KVTransfers | None = None  # transfers not yet handed to a step
        self._last_split: tuple[int, int, list[int]] | None = None  # (seq_id, device, per tier)
        self.num_device_hit_tokens = 0  # hit tokens served by device blocks (tiers only)
        self.kv_load_s = 0.0  # summed transfer time of the loads (s)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (including evictable cached blocks)."""
        return (
            self.num_blocks - len(self._ref_counts) + len(self._free_plain) + len(self._free_cached)
        )

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self.num_free_blocks

    def block_table(self, seq: Sequence) -> list[int]:
        """The block ids of ``seq`` in position order (empty if it holds none)."""
        return self._tables.get(seq.seq_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence) -> list[int]:
        if seq.block_hashes is None:
            seq.block_hashes = compute_block_hashes(seq.request, self.block_size, self.block_hasher)
        return seq.block_hashes

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks of the longest prefix hit of a request not holding blocks,
        capped so that at least its last token is computed (its logits give the
        next token). Do not mutate the list.

        Memoized on the sequence: while no cached block was evicted, a repeated
        lookup resumes the walk where the last one stopped (blocks registered
        since can only extend the hit), so an admission round costs one walk
        per request, not one per question (cost, validation, allocation).
        """
        if not self.enable_prefix_caching:
            return []
        if self._tiers is not None:
            return self._lookup_tiered(seq)
        hashes = self._hashes(seq)
        max_hit = min(len(hashes), (seq.num_tokens - 1) // self.block_size)
        memo = seq.prefix_hit
        if isinstance(memo, _PrefixHit) and memo.epoch == self._num_evictions:
            hits = memo.blocks
        else:
            hits = []
            seq.prefix_hit = _PrefixHit(self._num_evictions, hits)
        if len(hits) > max_hit:
            del hits[max_hit:]
        index = self._hash_to_block
        for i in range(len(hits), max_hit):
            block = index.get(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_blocks(self, hashes: list[int]) -> int:
        """Leading blocks of the chained ``hashes`` (``compute_block_hashes``) that
        the prefix cache holds now, without touching any request (a router's query)."""
        if not self.enable_prefix_caching:
            return 0
        index = self._hash_to_block
        if self._tiers is not None:
            if len(self._tier_slots) == 1:
                slots = self._tier_slots[0]
                for i, h in enumerate(hashes):
                    if h not in index and h not in slots:
                        return i
                return len(hashes)
            in_tiers = self._in_tiers
            for i, h in enumerate(hashes):
                if h not in index and not in_tiers(h):
                    return i
            return len(hashes)
        for i, h in enumerate(hashes):
            if h not in index:
                return i
        return len(hashes)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that a prefill now would take from the prefix cache."""
        return len(self.lookup(seq)) * self.block_size

    # --------------------------------------------------------------- allocation
    def can_allocate(self, seq: Sequence, num_tokens: int | None = None) -> bool:
        """True when blocks for the first ``num_tokens`` tokens of ``seq`` (default:
        all ``seq.num_tokens``) can be had now, prefix hits included."""
        hits = self.lookup(seq)
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        if self._tiers is not None:
            refs = self._ref_counts
            on_device = [b for b in hits if b != DEVICE]  # a tier hit needs a new block
            num_hits_free = sum(1 for b in on_device if refs[b] == 0)
            return (
                self.blocks_for(num_tokens) - len(on_device) <= self.num_free_blocks - num_hits_free
            )
        num_new = self.blocks_for(num_tokens) - len(hits)
        num_hits_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        return num_new <= self.num_free_blocks - num_hits_free

    def allocate(self, seq: Sequence, num_tokens: int | None = None) -> int:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens (default all),
        reusing cached ones, and register the hashes of the full prompt blocks
        those tokens cover.

        Returns:
            Tokens served from the prefix cache.

        Raises:
            RuntimeError: if ``seq`` already holds blocks or the pool is short.
        """
        if seq.seq_id in self._tables:
            raise RuntimeError(f"{seq} already holds KV blocks")
        num_tokens = seq.num_tokens if num_tokens is None else num_tokens
        if not self.can_allocate(seq, num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {seq}")
        if self._tiers is not None:
            return self._allocate_tiered(seq, num_tokens)
        table = list(self.lookup(seq))
        seq.prefix_hit = None
        for block in table:
            self._ref(block)
        num_hit = len(table)
        table.extend(self._take(self.blocks_for(num_tokens) - num_hit))
        self._tables[seq.seq_id] = table
        seq.kv_slots = len(table) * self.block_size
        self._num_registered[seq.seq_id] = num_hit
        self._register(seq, num_tokens)
        return num_hit * self.block_size

    def num_slots(self, seq: Sequence) -> int:
        """Tokens ``seq``'s blocks can hold now (0 if it holds none): a decode
        that stays within them needs no block operation. Also kept on the
        sequence as ``seq.kv_slots`` for hot loops."""
        return seq.kv_slots

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``seq``'s table can be extended to hold ``num_tokens`` tokens."""
        return self.num_blocks_to_grow(seq, num_tokens) <= self.num_free_blocks

    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables[seq.seq_id]))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend ``seq``'s table to hold ``num_tokens`` tokens (a later prefill
        chunk, or decode slots) and register the prompt blocks now covered.

        Raises:
            RuntimeError: if the pool is short (call ``can_grow`` first).
        """
        table = self._tables[seq.seq_id]
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            if num_new > self.num_free_blocks:
                raise RuntimeError(f"not enough free KV blocks to grow {seq}")
            table.extend(self._take(num_new))
            seq.kv_slots = len(table) * self.block_size
        if self.enable_prefix_caching and self._num_registered[seq.seq_id] < min(
            len(self._hashes(seq)), num_tokens // self.block_size
        ):
            self._register(seq, num_tokens)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Tail blocks are freed first, so they are
        evicted before the shared prefix blocks (vLLM frees in reverse order)."""
        table = self._tables.pop(seq.seq_id, None)
        seq.kv_slots = 0
        self._num_registered.pop(seq.seq_id, None)
        if table is None:
            return
        refs, hashes = self._ref_counts, self._block_hash
        for block in reversed(table):
            refs[block] -= 1
            if refs[block] == 0:
                if hashes[block] is None:
                    self._free_plain.append(block)  # nothing to keep: reused first
                else:
                    self._free_cached[block] = None

    def record_prefix_query(self, seq: Sequence, num_cached_tokens: int) -> None:
        """Count a first admission for the prefix-cache hit rate."""
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += num_cached_tokens
        if self._tiers is not None and self._last_split is not None:
            seq_id, num_device, loaded = self._last_split
            if seq_id == seq.seq_id:
                self.num_device_hit_tokens += num_device * self.block_size
                for tier, n in zip(self._tiers, loaded):
                    tier.num_hit_tokens += n * self.block_size
                if self._observers:
                    below = self._hashes(seq)[num_device:]
                    for policy in self._observers:
                        policy.observe(below)
            self._last_split = None

    # ------------------------------------------------------------------ helpers
    def _ref(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free_cached[block]  # a hit on a free cached block revives it
        self._ref_counts[block] += 1

    def _take(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (plain ones first, then fresh ids, then
        LRU cached ones, whose cached content is evicted)."""
        if num_blocks <= 0:
            return []
        plain, refs = self._free_plain, self._ref_counts
        blocks = plain[-num_blocks:]
        del plain[-num_blocks:]
        for block in blocks:
            refs[block] = 1
        short = num_blocks - len(blocks)
        if short > 0:
            start = len(refs)
            num_fresh = min(short, self.num_blocks - start)
            refs.extend([1] * num_fresh)
            self._block_hash.extend([None] * num_fresh)
            blocks.extend(range(start, start + num_fresh))
            if short > num_fresh:
                blocks.extend(self._evict(short - num_fresh))
        return blocks

    def _evict(self, num_blocks: int) -> list[int]:
        """Take the ``num_blocks`` least recently freed cached blocks, dropping
        their hashes from the index."""
        cached, hashes, index, refs = (
            self._free_cached, self._block_hash, self._hash_to_block, self._ref_counts,
        )  # fmt: skip
        pop = cached.popitem
        blocks = [pop(last=False)[0] for _ in range(num_blocks)]
        if self._tiers is not None:  # move them down before their hashes go
            self._offload(blocks)
        for block in blocks:
            # a block holds hash h exactly when the index maps h to it (_register)
            del index[hashes[block]]  # type: ignore[arg-type]
            hashes[block] = None
            refs[block] = 1
        self._num_evictions += 1
        return blocks

    def _register(self, seq: Sequence, num_tokens: int) -> None:
        """Index the full prompt blocks among the first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq)
        start = self._num_registered[seq.seq_id]
        end = min(len(hashes), num_tokens // self.block_size)
        table = self._tables[seq.seq_id]
        for i in range(start, end):
            h = hashes[i]
            if h not in self._hash_to_block:
                self._hash_to_block[h] = table[i]
                self._block_hash[table[i]] = h
        self._num_registered[seq.seq_id] = max(start, end)

    def check_invariants(self) -> None:
        """Assert exact accounting: free + used == total, ref counts equal table
        references, the hash index points at blocks holding that hash.

        Raises:
            AssertionError: naming the broken invariant.
        """
        num_touched = len(self._ref_counts)
        refs = [0] * num_touched
        for table in self._tables.values():
            for block in table:
                refs[block] += 1
        assert refs == self._ref_counts, "ref counts differ from block tables"
        assert len(self._block_hash) == num_touched, "per-block lists differ in length"
        free = {b for b in range(num_touched) if refs[b] == 0}
        listed = [*self._free_plain, *self._free_cached]
        assert len(listed) == len(set(listed)), "a block is listed free twice"
        assert free == set(listed), "free lists differ from unreferenced blocks"
        assert all(self._block_hash[b] is None for b in self._free_plain), (
            "hashed block in plain list"
        )
        used = sum(1 for r in refs if r > 0)
        assert self.num_free_blocks + used == self.num_blocks, "free + used != total"
        for h, block in self._hash_to_block.items():
            assert self._block_hash[block] == h, f"hash index stale for block {block}"
        if self._tiers is not None:
            for tier in self._tiers:
                tier.check()
            tier_hits = sum(t.num_hit_tokens for t in self._tiers)
            assert self.num_device_hit_tokens + tier_hits <= self.num_hit_tokens, (
                "tier hit tokens exceed the hits"
            )
            assert sum(t.num_loaded for t in self._tiers) * self.block_size >= tier_hits, (
                "tier hits without loads"
            )

    # -------------------------------------------------------------- KV tiers
    def _lookup_tiered(self, seq: Sequence) -> list[int]:
        """:meth:`lookup` with tiers: the hit goes on through blocks found in a
        tier, marked :data:`~roseinfer.kv_tiers.DEVICE` (-1) in the list. The memo
        stays valid until a device eviction (the only thing that changes a tier's
        contents, besides loads, which :meth:`_allocate_tiered` resolves again)."""
        hashes = self._hashes(seq)
        max_hit = min(len(hashes), (seq.num_tokens - 1) // self.block_size)
        memo = seq.prefix_hit
        if isinstance(memo, _PrefixHit) and memo.epoch == self._num_evictions:
            hits = memo.blocks
        else:
            hits = []
            seq.prefix_hit = _PrefixHit(self._num_evictions, hits)
        if len(hits) > max_hit:
            del hits[max_hit:]
        index = self._hash_to_block
        if len(self._tier_slots) == 1:  # one tier: its index inline
            slots = self._tier_slots[0]
            for i in range(len(hits), max_hit):
                h = hashes[i]
                block = index.get(h)
                if block is None:
                    if h not in slots:
                        break
                    block = DEVICE
                hits.append(block)
            return hits
        in_tiers = self._in_tiers
        for i in range(len(hits), max_hit):
            h = hashes[i]
            block = index.get(h)
            if block is None:
                if not in_tiers(h):
                    break
                block = DEVICE
            hits.append(block)
        return hits

    def _in_tiers(self, h: int) -> bool:
        """Whether some tier holds block hash ``h``."""
        for slots in self._tier_slots:  # noqa: SIM110 - a loop beats any() on a generator
            if h in slots:
                return True
        return False

    def _allocate_tiered(self, seq: Sequence, num_tokens: int) -> int:
        """:meth:`allocate` with tiers: device hits are referenced, tier hits get new
        device blocks and a load each (their tier slot pinned while the device
        blocks are taken, so the offloads that taking may cause cannot overwrite
        them; put back, most recently used, once the load is recorded)."""
        hits = self.lookup(seq)
        seq.prefix_hit = None
        hashes = self._hashes(seq)
        index = self._hash_to_block
        tiers: list[KVTier] = self._tiers  # type: ignore[assignment]
        tier_slots = self._tier_slots
        table: list[int] = []
        loads: list[tuple[int, int, int]] = []  # (position, level, slot)
        refs, free_cached = self._ref_counts, self._free_cached
        for i, block in enumerate(hits):
            if block == DEVICE:
                h = hashes[i]
                block = index.get(h, DEVICE)  # loaded by another request since?
                if block == DEVICE:
                    for level, slots in enumerate(tier_slots):
                        slot = slots.pop(h, None)
                        if slot is not None:
                            tiers[level].policy.remove(h)
                            loads.append((i, level, slot))
                            break
                    else:  # pragma: no cover - the memo is reset by every tier change
                        raise RuntimeError(f"block hash of {seq} left every tier")
                    table.append(DEVICE)
                    continue
            if refs[block] == 0:  # as _ref: a hit on a free cached block revives it
                del free_cached[block]
            refs[block] += 1
            table.append(block)
        num_hit = len(table)
        for _, level, _ in loads:  # the popped slots are pinned: out of every index
            tiers[level].num_pinned += 1
        fresh = self._take(len(loads) + self.blocks_for(num_tokens) - num_hit)
        loaded = [0] * len(tiers)
        if loads:
            pending = self._pending_transfers()
            ops = pending.ops if self.record_transfer_ops else None
            block_hash = self._block_hash
            for (i, level, slot), block in zip(loads, fresh):
                h = hashes[i]
                table[i] = block
                index[h] = block
                block_hash[block] = h
                tier_slots[level][h] = slot
                tiers[level].policy.reinsert(h)
                loaded[level] += 1
                if ops is not None:
                    ops.append((level, slot, DEVICE, block))
            block_bytes = self.kv_tiers.block_bytes  # type: ignore[union-attr]
            for tier, n in zip(tiers, loaded):
                if n:
                    tier.num_pinned = 0
                    tier.num_loaded += n
                    load_s = n * block_bytes / tier.spec.read_bytes_per_s
                    pending.load_s += load_s
                    self.kv_load_s += load_s
            pending.num_loaded += len(loads)
            table.extend(fresh[len(loads) :])
        else:
            table.extend(fresh)
        self._tables[seq.seq_id] = table
        seq.kv_slots = len(table) * self.block_size
        self._num_registered[seq.seq_id] = num_hit
        self._register(seq, num_tokens)
        self._last_split = (seq.seq_id, num_hit - len(loads), loaded)
        return num_hit * self.block_size

    def _offload(self, blocks: list[int]) -> None:
        """Write the cached device ``blocks`` (being evicted) into tier 0: :meth:`_store`
        for each, unrolled for the first tier (one call per block moved down)."""
        tier = self._tiers[0]  # type: ignore[index]
        slots, policy, capacity = tier.slots, tier.policy, tier.spec.num_blocks
        gates = type(policy).admit is not KVTierPolicy.admit
        has_next = len(self._tiers) > 1  # type: ignore[arg-type]
        pending = self._pending_transfers()
        ops = pending.ops if self.record_transfer_ops else None
        hashes = self._block_hash
        touch, insert, evict = policy.touch, policy.insert, policy.evict
        num_stored = num_evicted = 0
        num_touched = tier.num_touched  # tier 0 only changes here (demotions go below)
        for block in blocks:
            h: int = hashes[block]  # type: ignore[assignment]
            if h in slots:
                touch(h)
                continue
            if gates and not policy.admit(h):
                continue
            if num_touched < capacity:
                slot = num_touched
                num_touched += 1
            elif slots:
                victim = evict(h)
                slot = slots.pop(victim)
                num_evicted += 1
                if has_next:
                    self._store(1, victim, 0, slot)
            else:  # every slot pinned by a load in progress
                if has_next:
                    self._store(1, h, DEVICE, block)
                continue
            slots[h] = slot
            insert(h)
            num_stored += 1
            if ops is not None:
                ops.append((DEVICE, block, 0, slot))
        tier.num_touched = num_touched
        tier.num_stored += num_stored
        tier.num_evicted += num_evicted
        pending.num_offloaded += num_stored

    def _store(self, level: int, h: int, src_level: int, src_index: int) -> None:
        """Write block hash ``h`` (held at ``src_index`` of ``src_level``) into tier
        ``level``; a full tier first moves its policy's victim one tier down (whose
        copy is therefore recorded first), or drops it below the last tier."""
        tiers: list[KVTier] = self._tiers  # type: ignore[assignment]
        if level >= len(tiers):
            return
        tier = tiers[level]
        slots = tier.slots
        if h in slots:
            tier.policy.touch(h)
            return
        policy = tier.policy
        if not policy.admit(h):
            return
        if tier.num_touched < tier.spec.num_blocks:
            slot = tier.num_touched
            tier.num_touched += 1
        elif slots:
            victim = policy.evict(h)
            slot = slots.pop(victim)
            tier.num_evicted += 1
            self._store(level + 1, victim, level, slot)
        else:  # every slot pinned by a load in progress: go one tier down
            self._store(level + 1, h, src_level, src_index)
            return
        slots[h] = slot
        policy.insert(h)
        tier.num_stored += 1
        pending = self._pending_transfers()
        pending.num_offloaded += 1
        if self.record_transfer_ops:
            pending.ops.append((src_level, src_index, level, slot))

    def _pending_transfers(self) -> KVTransfers:
        pending = self._pending
        if pending is None:
            overlap = self.kv_tiers.overlap  # type: ignore[union-attr]
            pending = self._pending = KVTransfers(overlap=overlap)
        return pending

    def pop_transfers(self) -> KVTransfers | None:
        """The block copies decided since the last call (None if none): the step
        that is about to run must apply them (executor) or price them (simulator)
        before its forward."""
        pending, self._pending = self._pending, None
        return pending

    def kv_tier_counters(self) -> dict[str, object]:
        """Raw tier counters for :func:`~roseinfer.kv_tiers.kv_tier_summary` (empty
        without tiers): prompt tokens looked up, hit tokens by device and by tier,
        blocks stored into and loaded from each tier, block bytes, load seconds."""
        if self._tiers is None or self.kv_tiers is None:
            return {}
        return {
            "describe": self.kv_tiers.describe(),
            "policy": self.kv_tiers.policy_name,
            "block_bytes": self.kv_tiers.block_bytes,
            "queried_tokens": self.num_queried_tokens,
            "device_hit_tokens": self.num_device_hit_tokens,
            "load_s": self.kv_load_s,
            "tiers": {
                t.spec.name: {
                    "hit_tokens": t.num_hit_tokens,
                    "stored_blocks": t.num_stored,
                    "loaded_blocks": t.num_loaded,
                    "evicted_blocks": t.num_evicted,
                    "held_blocks": len(t.slots),
                }
                for t in self._tiers
            },
        }


class _PrefixHit:
    """A lookup memo: hit blocks found while ``epoch`` evictions had happened."""

    __slots__ = ("epoch", "blocks")

    def __init__(self, epoch: int, blocks: list[int]) -> None:
        self.epoch = epoch
        self.blocks = blocks
