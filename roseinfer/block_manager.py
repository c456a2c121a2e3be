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
COMPILED = not __file__.endswith(".py")  # built by setup.py: loops instead of numpy calls
_MASK64 = (1 << 64) - 1
_FMIX1, _FMIX2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # MurmurHash3's fmix64 (Appleby)


def _prefix_id_hashes(
    hash_ids: SequenceABC[int], span: int, block_size: int, num_full: int
) -> list[int]:
    """Block keys from Mooncake hash ids: ``-(id << 20 | i) - 1`` for block ``i``
    whose last token lies in hash block ``id`` (negative, and distinct for
    distinct (id, i), vectorized); the tuple hash where ids are too large."""
    last = len(hash_ids) - 1
    if COMPILED and num_full < 1 << _PREFIX_KEY_SHIFT and _small_ids(hash_ids):
        block_keys: list[int] = []  # the same keys, block by block (no numpy per request)
        for i in range(num_full):
            key = hash_ids[min(((i + 1) * block_size - 1) // span, last)]
            block_keys.append(-((key << _PREFIX_KEY_SHIFT) | i) - 1)
        return block_keys
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


def _small_ids(hash_ids: SequenceABC[int]) -> bool:
    """True when every id is an int in ``[0, 2**40)`` (a Mooncake key then fits 60 bits)."""
    for key in hash_ids:  # noqa: SIM110 - a loop beats all() on a generator
        if type(key) is not int or not 0 <= key < 1 << 40:
            return False
    return True


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
        # _num_touched); ids above are fresh: free, plain, never touched. The
        # typed arrays grow by doubling, so memory follows the blocks in use.
        self._num_touched = 0
        self._capacity = 0
        self._refs = array("i")  # references per block
        self._block_hash: list[int | None] = []  # the hash a block holds, or None
        self._hash_to_block: dict[int, int] = {}
        # NOTE: the compiled core keeps the index in a typed table instead, until a
        # hash does not fit 64 bits (SHA-256 of token ids: then the dict); tiers
        # look blocks up by hash in their own dicts, so they keep the dict too
        self._table = _HashIndex() if COMPILED and kv_tiers is None else None
        # Free blocks once used: those holding nothing reusable (a stack, taken
        # first, before fresh ids) and cached ones still indexed by hash (an LRU
        # list linked through _lru_prev/_lru_next, evicted oldest first).
        self._plain = array("i")  # stack; its first _num_plain entries are used
        self._num_plain = 0
        self._lru_prev = array("i")
        self._lru_next = array("i")
        self._lru_head = -1
        self._lru_tail = -1
        self._num_free_cached = 0
        self._tables: dict[int, array] = {}  # seq_id -> block ids (array "i")
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
        return self._num_free()

    def _num_free(self) -> int:
        return self.num_blocks - self._num_touched + self._num_plain + self._num_free_cached

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - self._num_free()

    def block_table(self, seq: Sequence) -> list[int]:
        """The block ids of ``seq`` in position order (a copy; empty if it holds none)."""
        table = self._tables.get(seq.seq_id)
        return [] if table is None else table.tolist()

    def block_ids(self, seq: Sequence) -> array:
        """The block ids of ``seq`` in position order as the manager holds them, an
        ``array('i')`` (not a copy: read it before the manager allocates or frees
        again; empty if it holds none). The executor reads it through its buffer
        (:func:`~roseinfer.executor.input_batch.used_block_ids`); :meth:`block_table`
        is the copy."""
        table = self._tables.get(seq.seq_id)
        return array("i") if table is None else table

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
        table = self._table
        if table is not None:
            try:
                for i in range(len(hits), max_hit):
                    found = table.get(hashes[i])
                    if found < 0:
                        break
                    hits.append(found)
            except OverflowError:  # a hash beyond 64 bits is not in the table
                pass
            return hits
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
            for i, h in enumerate(hashes):
                if h not in index and not self._in_tiers(h):
                    return i
            return len(hashes)
        table = self._table
        for i, h in enumerate(hashes):
            if table is not None:
                try:
                    if table.get(h) < 0:
                        return i
                except OverflowError:  # beyond 64 bits: not in the table
                    return i
            elif h not in index:
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
        refs = self._refs
        num_hits = num_hits_free = 0
        for block in hits:
            if block != DEVICE:  # a tier hit needs a new block
                num_hits += 1
                if refs[block] == 0:
                    num_hits_free += 1
        return self.blocks_for(num_tokens) - num_hits <= self._num_free() - num_hits_free

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
        hits = self.lookup(seq)
        seq.prefix_hit = None
        for block in hits:
            self._ref(block)
        num_hit = len(hits)
        table = array("i", hits)
        table.extend(self._take(self.blocks_for(num_tokens) - num_hit))
        self._tables[seq.seq_id] = table
        seq.kv_slots = len(table) * self.block_size
        self._num_registered[seq.seq_id] = num_hit
        self._register(seq, num_tokens)
        return num_hit * self.block_size

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``seq``'s table can be extended to hold ``num_tokens`` tokens."""
        return self.num_blocks_to_grow(seq, num_tokens) <= self._num_free()

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
            if num_new > self._num_free():
                raise RuntimeError(f"not enough free KV blocks to grow {seq}")
            if num_new == 1:  # a decode's next block, mostly
                table.append(self._take_one())
            else:
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
        if table is not None:
            self._release(table)

    def _release(self, table: array) -> None:
        """Drop one reference to each block of ``table``, last block first: an
        unreferenced block goes on the plain stack, or (holding a hash) to the
        LRU tail."""
        refs, hashes, plain = self._refs, self._block_hash, self._plain
        prev, nxt = self._lru_prev, self._lru_next
        num_plain, tail, num_cached = self._num_plain, self._lru_tail, 0
        for i in range(len(table) - 1, -1, -1):
            block = table[i]
            left = refs[block] - 1
            refs[block] = left
            if left == 0:
                if hashes[block] is None:
                    plain[num_plain] = block  # nothing to keep: reused first
                    num_plain += 1
                else:  # to the LRU tail (_lru_push, inline)
                    prev[block] = tail
                    nxt[block] = -1
                    if tail >= 0:
                        nxt[tail] = block
                    else:
                        self._lru_head = block
                    tail = block
                    num_cached += 1
        self._num_plain, self._lru_tail = num_plain, tail
        self._num_free_cached += num_cached

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
        if self._refs[block] == 0:
            self._lru_remove(block)  # a hit on a free cached block revives it
        self._refs[block] += 1

    def _lru_push(self, block: int) -> None:
        """Append a free cached block at the LRU tail (evicted last)."""
        tail = self._lru_tail
        self._lru_prev[block] = tail
        self._lru_next[block] = -1
        if tail >= 0:
            self._lru_next[tail] = block
        else:
            self._lru_head = block
        self._lru_tail = block
        self._num_free_cached += 1

    def _lru_remove(self, block: int) -> None:
        """Unlink a free cached block from the LRU list."""
        prev, nxt = self._lru_prev[block], self._lru_next[block]
        if prev >= 0:
            self._lru_next[prev] = nxt
        else:
            self._lru_head = nxt
        if nxt >= 0:
            self._lru_prev[nxt] = prev
        else:
            self._lru_tail = prev
        self._num_free_cached -= 1

    def _lru_blocks(self) -> list[int]:
        """The free cached blocks, least recently freed first."""
        blocks: list[int] = []
        block = self._lru_head
        while block >= 0:
            blocks.append(block)
            block = self._lru_next[block]
        return blocks

    def _ensure_capacity(self, num_touched: int) -> None:
        """Grow the per-block arrays to hold ``num_touched`` blocks (doubling)."""
        old = self._capacity
        if num_touched <= old:
            return
        capacity = min(self.num_blocks, max(num_touched, 2 * old, 64))
        self._refs = _grown(self._refs, old, capacity)
        self._plain = _grown(self._plain, old, capacity)
        self._lru_prev = _grown(self._lru_prev, old, capacity)
        self._lru_next = _grown(self._lru_next, old, capacity)
        self._block_hash.extend([None] * (capacity - old))
        self._capacity = capacity

    def _take(self, num_blocks: int) -> array:
        """Take ``num_blocks`` free blocks (plain ones first, then fresh ids, then
        LRU cached ones, whose cached content is evicted), each with one reference."""
        taken = array("i", bytes(4 * max(num_blocks, 0)))
        if num_blocks <= 0:
            return taken
        num_plain = min(num_blocks, self._num_plain)
        num_fresh = min(num_blocks - num_plain, self.num_blocks - self._num_touched)
        first = self._num_touched
        self._ensure_capacity(first + num_fresh)
        ids = taken  # NOTE: typed as a view when compiled (block_manager.pxd)
        refs, plain = self._refs, self._plain
        start = self._num_plain - num_plain
        for i in range(num_plain):  # the top of the stack, in stack order
            block = plain[start + i]
            ids[i] = block
            refs[block] = 1
        self._num_plain = start
        for i in range(num_fresh):
            ids[num_plain + i] = first + i
            refs[first + i] = 1
        self._num_touched = first + num_fresh
        if num_plain + num_fresh < num_blocks:
            self._evict(ids, num_plain + num_fresh)
        return taken

    def _take_one(self) -> int:
        """:meth:`_take` of one block."""
        if self._num_plain:
            self._num_plain -= 1
            block = self._plain[self._num_plain]
        elif self._num_touched < self.num_blocks:
            block = self._num_touched
            self._ensure_capacity(block + 1)
            self._num_touched = block + 1
        else:
            return self._take(1)[0]
        self._refs[block] = 1
        return block

    def _evict(self, taken: array, start: int) -> None:
        """Fill ``taken[start:]`` with the least recently freed cached blocks,
        dropping their hashes from the index."""
        refs, nxt = self._refs, self._lru_next
        end = len(taken)
        block = self._lru_head
        for i in range(start, end):  # the LRU head onwards (_lru_remove, inline)
            taken[i] = block
            refs[block] = 1
            block = nxt[block]
        self._lru_head = block
        if block >= 0:
            self._lru_prev[block] = -1
        else:
            self._lru_tail = -1
        self._num_free_cached -= end - start
        if self._tiers is not None:  # move them down before their hashes go
            self._offload([taken[i] for i in range(start, end)])
        hashes, index, table = self._block_hash, self._hash_to_block, self._table
        for i in range(start, end):
            block = taken[i]
            # a block holds hash h exactly when the index maps h to it (_register)
            if table is not None:
                table.delete(hashes[block])
            else:
                del index[hashes[block]]
            hashes[block] = None
        self._num_evictions += 1

    def _register(self, seq: Sequence, num_tokens: int) -> None:
        """Index the full prompt blocks among the first ``num_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes(seq)
        start = self._num_registered[seq.seq_id]
        end = min(len(hashes), num_tokens // self.block_size)
        ids, block_hash, i = self._tables[seq.seq_id], self._block_hash, start
        if self._table is not None:
            try:
                while i < end:
                    h, block = hashes[i], ids[i]
                    if self._table.setdefault(h, block) == block:  # an indexed hash keeps its block
                        block_hash[block] = h
                    i += 1
            except OverflowError:  # a hash beyond 64 bits: a dict from now on
                self._hash_to_block = dict(self._table.items())
                self._table = None
        index = self._hash_to_block
        while i < end:
            h, block = hashes[i], ids[i]
            if index.setdefault(h, block) == block:
                block_hash[block] = h
            i += 1
        self._num_registered[seq.seq_id] = max(start, end)

    def check_invariants(self) -> None:
        """Assert exact accounting: free + used == total, ref counts equal table
        references, the hash index points at blocks holding that hash.

        Raises:
            AssertionError: naming the broken invariant.
        """
        num_touched = self._num_touched
        refs = [0] * num_touched
        for table in self._tables.values():
            for block in table.tolist():
                refs[block] += 1
        assert refs == [self._refs[b] for b in range(num_touched)], (
            "ref counts differ from block tables"
        )
        assert len(self._block_hash) == self._capacity >= num_touched, "per-block state size"
        free = {b for b in range(num_touched) if refs[b] == 0}
        plain = [self._plain[i] for i in range(self._num_plain)]
        cached = self._lru_blocks()
        assert len(cached) == self._num_free_cached, "LRU list length out of sync"
        listed = [*plain, *cached]
        assert len(listed) == len(set(listed)), "a block is listed free twice"
        assert free == set(listed), "free lists differ from unreferenced blocks"
        assert all(self._block_hash[b] is None for b in plain), "hashed block in plain list"
        assert all(self._block_hash[b] is not None for b in cached), "plain block in LRU list"
        used = sum(1 for r in refs if r > 0)
        assert self._num_free() + used == self.num_blocks, "free + used != total"
        index = self._hash_to_block.items() if self._table is None else self._table.items()
        for h, block in index:
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
            self._ref(block)
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
        self._tables[seq.seq_id] = array("i", table)
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


class _HashIndex:
    """A block hash -> block id map for hashes that fit 64 bits (signed), as an
    open-addressing table over typed arrays (linear probing on MurmurHash3's
    64-bit finalizer, backward-shift deletion: Knuth, TAOCP vol. 3, 6.4,
    Algorithm R): the compiled core's prefix-cache index, where a dict costs two
    objects per entry. It grows (doubling) to stay at most half full."""

    __slots__ = ("slots", "mask", "count")

    def __init__(self, capacity: int = 1024) -> None:
        # slot s: its key at 2s and its block at 2s + 1 (one cache line for both);
        # capacity a power of two, block -1 an empty slot
        self.slots = array("q", [0, -1]) * capacity
        self.mask = capacity - 1
        self.count = 0

    def _home(self, key: int) -> int:
        h = key & _MASK64  # the key's 64 bits, mixed (fmix64)
        h = ((h ^ (h >> 33)) * _FMIX1) & _MASK64
        h = ((h ^ (h >> 33)) * _FMIX2) & _MASK64
        return (h ^ (h >> 33)) & self.mask

    def _slot(self, key: int) -> int:
        """The slot holding ``key``, or the empty slot its probe reaches."""
        # NOTE: attributes read in place: a typed view copied to a local costs
        # atomic reference counts, more than the probe itself
        slot = self._home(key)
        while self.slots[2 * slot + 1] >= 0 and self.slots[2 * slot] != key:
            slot = (slot + 1) & self.mask
        return slot

    def get(self, key: int) -> int:
        """The block of ``key``, or -1."""
        return self.slots[2 * self._slot(key) + 1]

    def setdefault(self, key: int, block: int) -> int:
        """The block of ``key``, after mapping it to ``block`` if it had none."""
        slot = self._slot(key)
        if self.slots[2 * slot + 1] >= 0:
            return self.slots[2 * slot + 1]
        if 2 * (self.count + 1) > self.mask + 1:
            self._rehash(2 * (self.mask + 1))
            slot = self._slot(key)
        self.slots[2 * slot] = key
        self.slots[2 * slot + 1] = block
        self.count += 1
        return block

    def delete(self, key: int) -> None:
        """Remove ``key`` (it must be there): later entries of its probe run move
        back into the gap, so no lookup stops early."""
        gap = self._slot(key)
        slot = gap
        while True:
            slot = (slot + 1) & self.mask
            if self.slots[2 * slot + 1] < 0:
                break
            home = self._home(self.slots[2 * slot])
            # the entry at slot stays unless its home is cyclically outside (gap, slot]
            if (gap < slot and gap < home <= slot) or (gap > slot and (home > gap or home <= slot)):
                continue
            self.slots[2 * gap] = self.slots[2 * slot]
            self.slots[2 * gap + 1] = self.slots[2 * slot + 1]
            gap = slot
        self.slots[2 * gap + 1] = -1
        self.count -= 1

    def items(self) -> list[tuple[int, int]]:
        """Every ``(key, block)`` pair."""
        slots = self.slots
        return [
            (slots[i], slots[i + 1]) for i in range(0, 2 * self.mask + 2, 2) if slots[i + 1] >= 0
        ]

    def _rehash(self, capacity: int) -> None:
        entries = self.items()
        self.__init__(capacity)  # type: ignore[misc]
        for key, block in entries:
            self.setdefault(key, block)


def _grown(values: array, size: int, capacity: int) -> array:
    """The first ``size`` ints of ``values`` in a zeroed array of ``capacity``."""
    grown = array("i", bytes(4 * capacity))
    view = grown  # NOTE: typed as a view when compiled (block_manager.pxd)
    for i in range(size):
        view[i] = values[i]
    return grown


class _PrefixHit:
    """A lookup memo: hit blocks found while ``epoch`` evictions had happened."""

    __slots__ = ("epoch", "blocks")

    def __init__(self, epoch: int, blocks: list[int]) -> None:
        self.epoch = epoch
        self.blocks = blocks
