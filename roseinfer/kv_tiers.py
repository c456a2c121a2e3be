"""KV cache tiers below device memory: specs, the tier policy plugin kind, transfers.

A replica's KV blocks live on the device (the :class:`~roseinfer.block_manager.BlockManager`
pool) and, with tiers configured, in an ordered list of lower tiers (host DRAM,
local NVMe, a remote store), each with a capacity in blocks and a read and a write
bandwidth. The block manager moves cached blocks by their chained hash:

- **offload** (device -> tier 0): a cached device block evicted for new content
  is written to the first tier; a full tier evicts a block by its policy and the
  victim moves one tier down (or is dropped at the last tier).
- **load** (tier -> device): a prefix hit that goes on in a tier (the chain of
  block hashes is found there) counts as cached tokens; admission allocates device
  blocks for those and copies them up. A loaded block keeps its copy in the tier
  (as vLLM's CPU offloading keeps its CPU block), so a later offload of the same
  hash only refreshes the policy.

Pricing: a load's transfer time is ``bytes per block / read bandwidth``, summed
per step and charged to the step that admits the request (added to it, or
overlapped with compute: ``max(compute, transfer)`` with
:attr:`KVTierConfig.overlap`). Offloads are counted in bytes but cost no step
time: they are asynchronous in vLLM's offloading connector (stores are issued
after the step and complete in the background), so they are not on the
critical path here either.

The eviction and admission policy of a tier is a plugin kind:
:class:`KVTierPolicy` subclasses contributed through the
``register_kv_tier_policies`` hook (built-ins: ``lru``, ``arc``, ``reuse`` in
``roseinfer.policies.kv_tiers``).

Nothing here imports torch: the executor copies tensors by the block ids and
tier slots the block manager records (:attr:`KVTransfers.ops`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from roseinfer.registry import Registry

HOST_TIER_NAME = "host"
"""Name of the tier ``--kv-offloading-size`` configures (host DRAM)."""

PCIE5_X16_BYTES_PER_S = 50e9
"""Default read and write bandwidth of the host tier (bytes/s): a PCIe 5.0 x16 link.
PCIe 5.0 signals 32 GT/s per lane with 128b/130b encoding (PCI-SIG, PCI Express Base
Specification 5.0, 2019), 63 GB/s per direction over 16 lanes (the "64 GB/s" of
spec sheets; NVIDIA's H100 datasheet gives 128 GB/s for both directions together);
host-device copies from pinned memory reach about 80% of that after packet and DMA
overheads (e.g. ``nvbandwidth`` / CUDA ``bandwidthTest`` on Gen5 hosts), so 50 GB/s."""

GB = 1e9
"""Bytes in a GB: bandwidths are in decimal GB/s, as links are specified."""
GIB = 2**30
"""Bytes in a GiB: capacities are in GiB, as vLLM's ``--kv-offloading-size``."""
MAX_CAPACITY_GIB = float(2**30)
"""Largest tier capacity (GiB): 1 EiB (tier state exists only for blocks stored, so
only the arithmetic bounds it)."""
MIN_GBPS, MAX_GBPS = 1e-3, 1e6
"""Tier bandwidths (GB/s) from 1 MB/s to 1 PB/s: a transfer time stays finite."""

DEVICE = -1
"""Level of the device pool in :attr:`KVTransfers.ops` (tiers are 0, 1, ...)."""

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}\Z")


class KVTierError(ValueError):
    """A bad tier setting (the message names the flag or field and the fix)."""


@dataclass(frozen=True, slots=True)
class KVTierSpec:
    """One tier below device memory.

    Attributes:
        name: label in results and metrics keys (up to 32 letters, digits, ``_``;
            starts with a letter; not ``device``).
        num_blocks: KV blocks the tier holds (> 0).
        read_bytes_per_s: tier -> device bandwidth (bytes/s, finite, > 0): prices loads.
        write_bytes_per_s: device (or upper tier) -> tier bandwidth (bytes/s, finite,
            > 0): offloads are counted, not charged (module doc), but a result shows it.

    Raises:
        KVTierError: on a bad name, a non-positive count or a non-finite or
            non-positive bandwidth.
    """

    name: str
    num_blocks: int
    read_bytes_per_s: float
    write_bytes_per_s: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name == "device":
            raise KVTierError(
                f"KV tier name {str(self.name)[:40]!r}: use up to 32 letters, digits and _ "
                "(starting with a letter), not 'device'"
            )
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int):
            raise KVTierError(f"KV tier {self.name}: num_blocks must be an int")
        if self.num_blocks <= 0:
            raise KVTierError(f"KV tier {self.name}: num_blocks must be > 0, got {self.num_blocks}")
        for what in ("read_bytes_per_s", "write_bytes_per_s"):
            value = getattr(self, what)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise KVTierError(
                    f"KV tier {self.name}: {what} must be a finite number > 0, got {value!r}"
                )


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    """The tiers of a replica, in order (tier 0 right below the device).

    Attributes:
        tiers: one spec per tier (>= 1, names unique).
        block_bytes: bytes of one KV block, all layers, K and V (> 0): what one
            block moved costs.
        policy: the tiers' eviction policy: a :class:`KVTierPolicy` subclass, or a
            registered name (``--kv-tier-policy``) that :meth:`resolved` looks up in
            the registry it is given before the config reaches a block manager.
        overlap: loads overlap the step's compute (the step costs
            ``max(compute, transfer)``); False: they stall it (``compute + transfer``).

    Raises:
        KVTierError: on no tiers, duplicate names or a bad block size.
    """

    tiers: tuple[KVTierSpec, ...]
    block_bytes: int
    policy: str | type[KVTierPolicy] = "lru"
    overlap: bool = False

    def __post_init__(self) -> None:
        if not self.tiers:
            raise KVTierError("a KV tier config needs at least one tier")
        names = [t.name for t in self.tiers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise KVTierError(f"KV tier names must be unique; repeated: {', '.join(duplicates)}")
        if isinstance(self.block_bytes, bool) or not isinstance(self.block_bytes, int):
            raise KVTierError("KV tier config: block_bytes must be an int")
        if self.block_bytes <= 0:
            raise KVTierError(f"KV tier config: block_bytes must be > 0, got {self.block_bytes}")

    @property
    def policy_name(self) -> str:
        """The policy's registered name."""
        return self.policy if isinstance(self.policy, str) else self.policy.name

    def resolved(self, registry: Registry) -> KVTierConfig:
        """This config with its policy name looked up in ``registry`` (a class stays).

        Raises:
            UnknownPolicyError: (a ValueError) listing the registered names.
        """
        if not isinstance(self.policy, str):
            return self
        return replace(self, policy=registry.kv_tier_policy(self.policy))

    def for_block_bytes(self, block_bytes: int) -> KVTierConfig:
        """The same tiers (capacity in bytes kept, rounded down to whole blocks, at
        least one) for blocks of ``block_bytes`` (another model's replica)."""
        if block_bytes == self.block_bytes:
            return self
        tiers = tuple(
            replace(t, num_blocks=max(1, t.num_blocks * self.block_bytes // block_bytes))
            for t in self.tiers
        )
        return replace(self, tiers=tiers, block_bytes=block_bytes)

    def describe(self) -> str:
        """One line for the result files: ``host:131072 blocks:50/50 GB/s, ...``."""
        return ", ".join(
            f"{t.name}:{t.num_blocks} blocks:{t.read_bytes_per_s / GB:g}/"
            f"{t.write_bytes_per_s / GB:g} GB/s"
            for t in self.tiers
        )


def tier_from_gib(
    name: str, capacity_gib: float, read_gbps: float, write_gbps: float, block_bytes: int
) -> KVTierSpec:
    """A tier spec from a capacity in GiB and bandwidths in GB/s (the flags' units).

    Raises:
        KVTierError: on a capacity outside (0, :data:`MAX_CAPACITY_GIB`] GiB or below one
            block, or a bandwidth outside [:data:`MIN_GBPS`, :data:`MAX_GBPS`] GB/s (NaN
            and infinities included).
    """
    if not 0 < capacity_gib <= MAX_CAPACITY_GIB:
        raise KVTierError(
            f"KV tier {name}: capacity must be in (0, {MAX_CAPACITY_GIB:g}] GiB, got {capacity_gib}"
        )
    for what, value in (("read", read_gbps), ("write", write_gbps)):
        if not MIN_GBPS <= value <= MAX_GBPS:
            raise KVTierError(
                f"KV tier {name}: {what} bandwidth must be in [{MIN_GBPS:g}, {MAX_GBPS:g}] GB/s, "
                f"got {value}"
            )
    num_blocks = int(capacity_gib * GIB // block_bytes)
    if num_blocks < 1:
        raise KVTierError(
            f"KV tier {name}: {capacity_gib:g} GiB holds no KV block of {block_bytes} B; "
            "give more capacity"
        )
    return KVTierSpec(name, num_blocks, read_gbps * GB, write_gbps * GB)


# ------------------------------------------------------------------ policies
class KVTierPolicy:
    """The eviction (and offload admission) policy of one tier: a plugin kind.

    One instance per tier, holding the tier's order state over block hashes. The
    block manager keeps the hash -> slot index and calls:

    - :meth:`admit` before storing a hash not in the tier (False: do not store it;
      e.g. frequency gating), and :meth:`observe` with the prompt block hashes a
      first admission looked for below the device (only if overridden),
    - :meth:`insert` once it is stored, :meth:`touch` when a stored hash is used
      again (a load, or an offload of a hash already there),
    - :meth:`evict` when the tier is full and a hash must make room,
    - :meth:`remove` when a hash leaves without eviction (its slot is pinned while
      it is loaded), then :meth:`reinsert` once the load is recorded.

    Every call is O(1) in the built-ins; a plugin should keep it so (one call per
    block moved). Subclasses set ``name`` (the ``--kv-tier-policy`` value) and
    ``description``.

    Args:
        capacity_blocks: blocks the tier holds (> 0).
        options: knobs (none for the built-ins).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, capacity_blocks: int, options: Mapping[str, Any] | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.options = dict(options or {})

    def admit(self, block_hash: int) -> bool:
        """Whether to store ``block_hash`` (not in the tier) now; default always."""
        return True

    def observe(self, block_hashes: Sequence[int]) -> None:
        """A request's first admission looked these prompt block hashes up below the
        device (the blocks after its device hit; vLLM's offloading ``lookup``).
        Called only when a subclass overrides it; default nothing."""

    def insert(self, block_hash: int) -> None:
        """``block_hash`` was stored (the tier had room, or :meth:`evict` made it)."""
        raise NotImplementedError

    def touch(self, block_hash: int) -> None:
        """A stored ``block_hash`` was used again."""
        raise NotImplementedError

    def reinsert(self, block_hash: int) -> None:
        """``block_hash``, removed while it was loaded, is stored again and was just
        used (default: :meth:`insert` then :meth:`touch`)."""
        self.insert(block_hash)
        self.touch(block_hash)

    def evict(self, incoming: int) -> int:
        """Choose a stored hash to drop for ``incoming`` and forget it.

        Raises:
            LookupError: if nothing is stored.
        """
        raise NotImplementedError

    def remove(self, block_hash: int) -> None:
        """Forget a stored ``block_hash`` (not an eviction: no history kept)."""
        raise NotImplementedError

    def __len__(self) -> int:
        """Hashes stored."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        """The stored hashes (any order; for invariant checks)."""
        raise NotImplementedError


# --------------------------------------------------------------------- tiers
class KVTier:
    """One tier's state: hash -> slot index, policy, and counters.

    Slots are ids in ``[0, num_blocks)`` (the executor's host pool rows); slots
    below ``num_touched`` were handed out once, the rest are fresh. A slot is
    reused only through an eviction, so the tier never holds a free slot list.

    Attributes:
        spec: the tier's spec.
        policy: its policy instance.
        slots: hash -> slot of every block stored.
        num_touched: slots handed out so far.
        num_pinned: slots held out of the index while their block is loaded
            (0 between block-manager calls).
        num_stored: blocks written into the tier (offloads and demotions).
        num_evicted: blocks evicted from it (moved down or dropped).
        num_loaded: blocks loaded from it to the device.
        num_hit_tokens: prompt tokens of first admissions served by loads from it.
    """

    __slots__ = (
        "spec", "policy", "slots", "num_touched", "num_pinned", "num_stored",
        "num_evicted", "num_loaded", "num_hit_tokens",
    )  # fmt: skip

    def __init__(self, spec: KVTierSpec, policy: KVTierPolicy) -> None:
        self.spec = spec
        self.policy = policy
        self.slots: dict[int, int] = {}
        self.num_touched = 0
        self.num_pinned = 0
        self.num_stored = 0
        self.num_evicted = 0
        self.num_loaded = 0
        self.num_hit_tokens = 0

    def check(self) -> None:
        """Assert the tier's accounting (capacity, index = policy, slots unique).

        Raises:
            AssertionError: naming the broken invariant and the tier.
        """
        name, cap = self.spec.name, self.spec.num_blocks
        assert self.num_pinned == 0, f"tier {name}: slots left pinned"
        assert self.num_touched <= cap, f"tier {name}: more slots than its capacity"
        assert len(self.slots) == self.num_touched, f"tier {name}: a touched slot is unused"
        assert len(set(self.slots.values())) == len(self.slots), f"tier {name}: slot shared"
        assert all(0 <= s < self.num_touched for s in self.slots.values()), (
            f"tier {name}: slot out of range"
        )
        assert len(self.policy) == len(self.slots), f"tier {name}: policy size differs"
        assert set(self.policy) == set(self.slots), f"tier {name}: policy keys differ"
        assert self.num_stored - self.num_evicted == len(self.slots), (
            f"tier {name}: stored - evicted != held"
        )


def make_tiers(config: KVTierConfig) -> list[KVTier]:
    """Fresh tier states for ``config`` (one policy instance per tier).

    Raises:
        KVTierError: when the policy is still a name (:meth:`KVTierConfig.resolved`
            looks it up; the core loads no plugins itself).
    """
    cls = config.policy
    if isinstance(cls, str):
        raise KVTierError(
            f"KV tier policy {cls!r} is a name: look it up first with "
            "KVTierConfig.resolved(registry)"
        )
    return [KVTier(spec, cls(spec.num_blocks)) for spec in config.tiers]


@dataclass(slots=True)
class KVTransfers:
    """The block copies one scheduler output needs before its forward.

    Attributes:
        ops: ``(src_level, src_index, dst_level, dst_index)`` in the order the
            block manager decided them (level :data:`DEVICE` = a device block id,
            0, 1, ... = a tier slot); recorded only when the backend asks for them
            (the executor), and to be applied in this order: a slot or block may be
            read by one copy and written by a later one.
        load_s: transfer time of the loads (s): bytes / each tier's read bandwidth.
        overlap: whether the loads overlap the step's compute (see
            :attr:`KVTierConfig.overlap`).
        num_loaded: blocks loaded (all tiers); num_offloaded: blocks written into
            tiers (offloads and demotions).
    """

    ops: list[tuple[int, int, int, int]] = field(default_factory=list)
    load_s: float = 0.0
    overlap: bool = False
    num_loaded: int = 0
    num_offloaded: int = 0

    def step_time_s(self, compute_s: float) -> float:
        """A step's time (s) with these loads: ``compute + load`` or, overlapped,
        ``max(compute, load)``."""
        if self.load_s <= 0:
            return compute_s
        return max(compute_s, self.load_s) if self.overlap else compute_s + self.load_s

    def extend(self, other: KVTransfers | None) -> None:
        """Append ``other``'s copies and times (later decisions go after)."""
        if other is None:
            return
        self.ops += other.ops
        self.load_s += other.load_s
        self.num_loaded += other.num_loaded
        self.num_offloaded += other.num_offloaded


# ------------------------------------------------------------------ results
def kv_tier_summary(counters: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Flat result keys from one or more block managers' tier counters
    (``BlockManager.kv_tier_counters``, e.g. every replica of a cluster, summed).

    Keys: ``kv_hit_rate_device`` and ``kv_hit_rate_<tier>`` (prompt tokens of first
    admissions served from the device cache / loaded from that tier, over prompt
    tokens looked up; their sum is the block manager's hit rate),
    ``kv_offloaded_bytes`` and ``kv_loaded_bytes`` (all tiers) and
    ``kv_offloaded_bytes_<tier>`` / ``kv_loaded_bytes_<tier>`` (bytes written into /
    read from that tier; a demotion counts in the tier it enters),
    ``kv_load_time_s`` (summed transfer time of the loads as priced), ``kv_tiers``
    and ``kv_tier_policy``. Empty when no block manager has tiers.
    """
    rows = [c for c in counters if c]
    if not rows:
        return {}
    queried = sum(r["queried_tokens"] for r in rows)
    out: dict[str, Any] = {
        "kv_tiers": rows[0]["describe"],
        "kv_tier_policy": rows[0]["policy"],
        "kv_hit_rate_device": _rate(sum(r["device_hit_tokens"] for r in rows), queried),
    }
    names = list(rows[0]["tiers"])
    for name in names:
        hits = sum(r["tiers"].get(name, {}).get("hit_tokens", 0) for r in rows)
        out[f"kv_hit_rate_{name}"] = _rate(hits, queried)
    total_off = total_load = 0
    for name in names:
        off = sum(_tier_bytes(r, name, "stored_blocks") for r in rows)
        load = sum(_tier_bytes(r, name, "loaded_blocks") for r in rows)
        out[f"kv_offloaded_bytes_{name}"] = off
        out[f"kv_loaded_bytes_{name}"] = load
        total_off += off
        total_load += load
    out["kv_offloaded_bytes"] = total_off
    out["kv_loaded_bytes"] = total_load
    out["kv_load_time_s"] = sum(r["load_s"] for r in rows)
    return out


def _tier_bytes(row: Mapping[str, Any], name: str, key: str) -> int:
    tier = row["tiers"].get(name)
    return 0 if tier is None else int(tier[key]) * int(row["block_bytes"])


def _rate(hits: int, queried: int) -> float:
    return hits / queried if queried else 0.0
