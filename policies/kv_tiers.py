"""Built-in KV tier policies (``--kv-tier-policy``): ``lru``, ``arc`` and ``reuse``.

All are O(1) per call (ordered dicts). vLLM's native CPU offloading ships the same
(``vllm/v1/kv_offload``: ``lru_manager``, ``arc_manager``, and ``reuse_manager``'s
reuse-frequency gating).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from roseinfer import hookimpl
from roseinfer.kv_tiers import KVTierPolicy


class LRUTierPolicy(KVTierPolicy):
    """Least recently used: evict the block stored or used longest ago."""

    name = "lru"
    description = "evict the least recently stored or loaded block (default)"

    def __init__(self, capacity_blocks: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(capacity_blocks, options)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def insert(self, block_hash: int) -> None:
        """Stored now: most recent."""
        self._order[block_hash] = None

    def touch(self, block_hash: int) -> None:
        """Used again: most recent."""
        self._order.move_to_end(block_hash)

    def reinsert(self, block_hash: int) -> None:
        """Stored again after a load: most recent."""
        self._order[block_hash] = None

    def evict(self, incoming: int) -> int:
        """The least recent hash.

        Raises:
            LookupError: if nothing is stored.
        """
        if not self._order:
            raise LookupError("the tier holds no block")
        return self._order.popitem(last=False)[0]

    def remove(self, block_hash: int) -> None:
        """Forget ``block_hash``."""
        del self._order[block_hash]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)


class ARCTierPolicy(KVTierPolicy):
    """Adaptive Replacement Cache (N. Megiddo and D. S. Modha, "ARC: A Self-Tuning,
    Low Overhead Replacement Cache", USENIX FAST 2003, Fig. 4).

    T1 holds blocks used once since they entered, T2 blocks used again; B1 and B2
    remember the hashes recently evicted from each (ghosts, no data). A store of a
    hash found in B1 means T1 was too small: the target size ``p`` of T1 grows (by
    ``max(|B2| / |B1|, 1)``); one found in B2 shrinks it. Eviction takes T1's least
    recent block while T1 exceeds ``p`` (or equals it and the incoming hash is a B2
    ghost), else T2's. A scan of one-time blocks (a burst of unique prompts) thus
    flushes T1 only, keeping the reused prefixes in T2, which LRU would lose.

    Adaptation to a tier: the block manager asks for a victim (:meth:`evict`, ARC's
    REPLACE) before it stores the incoming hash (:meth:`insert`, ARC's cases II-IV),
    so ``p`` is adapted in whichever comes first; ghost lists are trimmed to
    ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c`` after each store.
    """

    name = "arc"
    description = "adaptive replacement cache (Megiddo & Modha, FAST 2003): recency vs reuse"

    def __init__(self, capacity_blocks: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(capacity_blocks, options)
        self.p = 0.0  # target size of T1 (blocks)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._adapted: int | None = None  # the incoming hash p was adapted for

    def _adapt(self, block_hash: int) -> None:
        if self._adapted == block_hash:
            return
        self._adapted = block_hash
        b1, b2, c = len(self._b1), len(self._b2), self.capacity_blocks
        if block_hash in self._b1:
            self.p = min(float(c), self.p + max(b2 / b1, 1.0))
        elif block_hash in self._b2:
            self.p = max(0.0, self.p - max(b1 / b2, 1.0))

    def insert(self, block_hash: int) -> None:
        """Stored now: into T2 if it was a ghost (reused after eviction), else T1."""
        self._adapt(block_hash)
        self._adapted = None
        if block_hash in self._b1:
            del self._b1[block_hash]
            self._t2[block_hash] = None
        elif block_hash in self._b2:
            del self._b2[block_hash]
            self._t2[block_hash] = None
        else:
            self._t1[block_hash] = None
        c = self.capacity_blocks
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            (self._b2 or self._b1).popitem(last=False)

    def reinsert(self, block_hash: int) -> None:
        """Stored again after a load (a reuse): most recent of T2."""
        self._t2[block_hash] = None

    def touch(self, block_hash: int) -> None:
        """Used again: most recent of T2."""
        if block_hash in self._t1:
            del self._t1[block_hash]
            self._t2[block_hash] = None
        else:
            self._t2.move_to_end(block_hash)

    def evict(self, incoming: int) -> int:
        """ARC's REPLACE: T1's least recent block into B1, or T2's into B2.

        Raises:
            LookupError: if nothing is stored.
        """
        self._adapt(incoming)
        t1 = len(self._t1)
        if t1 and (t1 > self.p or (incoming in self._b2 and t1 == self.p) or not self._t2):
            victim = self._t1.popitem(last=False)[0]
            self._b1[victim] = None
        elif self._t2:
            victim = self._t2.popitem(last=False)[0]
            self._b2[victim] = None
        else:
            raise LookupError("the tier holds no block")
        return victim

    def remove(self, block_hash: int) -> None:
        """Forget ``block_hash`` (no ghost kept)."""
        if block_hash in self._t1:
            del self._t1[block_hash]
        else:
            del self._t2[block_hash]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[int]:
        yield from self._t1
        yield from self._t2


class ReuseGatedTierPolicy(LRUTierPolicy):
    """LRU that stores a block only once its hash was looked up below the device
    ``store_threshold`` times (vLLM's reuse-frequency gating,
    ``vllm/v1/kv_offload/reuse_manager.py``: ``BlockReuseTracker`` counts each hash
    its offloading ``lookup`` is asked about, in an LRU table of ``max_size``
    hashes, and ``FilteredOffloadingManager`` skips stores below the threshold).
    One-time prompts then cost no offload bandwidth and do not flush the tier.

    Options: ``store_threshold`` (default 2, vLLM's) and ``max_size`` (hashes
    tracked, default 64,000, vLLM's).
    """

    name = "reuse"
    description = "LRU storing only blocks looked up twice (vLLM's reuse-frequency gating)"

    def __init__(self, capacity_blocks: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(capacity_blocks, options)
        self.store_threshold = int(self.options.get("store_threshold", 2))
        self.max_size = int(self.options.get("max_size", 64_000))
        self._seen: OrderedDict[int, int] = OrderedDict()  # hash -> lookups, least recent first

    def observe(self, block_hashes: Sequence[int]) -> None:
        """Count each hash looked up (most recent last; the oldest leave past ``max_size``)."""
        seen = self._seen
        for h in block_hashes:
            seen[h] = seen.pop(h, 0) + 1
        while len(seen) > self.max_size:
            seen.popitem(last=False)

    def admit(self, block_hash: int) -> bool:
        """Store only hashes looked up at least ``store_threshold`` times."""
        return self._seen.get(block_hash, 0) >= self.store_threshold


@hookimpl
def register_kv_tier_policies() -> list[type[KVTierPolicy]]:
    """The built-in tier policies."""
    return [LRUTierPolicy, ARCTierPolicy, ReuseGatedTierPolicy]
