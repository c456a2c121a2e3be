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
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC

import numpy as np

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
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        block_hasher: BlockHasher = sha256_block_hash,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
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


class _PrefixHit:
    """A lookup memo: hit blocks found while ``epoch`` evictions had happened."""

    __slots__ = ("epoch", "blocks")

    def __init__(self, epoch: int, blocks: list[int]) -> None:
        self.epoch = epoch
        self.blocks = blocks
