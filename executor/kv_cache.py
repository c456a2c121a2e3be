"""The KV cache: the device pool, the optional host tier, and copies between them.

Layout (vLLM's): per layer, K and V are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; the whole pool is one tensor ``[num_layers, 2,
num_blocks, block_size, num_kv_heads, head_dim]``. The scheduler's
``BlockManager`` owns the block ids. How many blocks the pool gets is the
memory planner's call (:mod:`roseinfer.executor.memory`); this component only
allocates them, and can be re-allocated at another size (the planner profiles
on a small pool first).

The host tier has the pool's layout with its own block count, in host memory
(pinned when the device is CUDA); :meth:`KVCache.apply_transfers` copies
blocks into and out of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .adapters import AttentionShape


def block_bytes(shape: AttentionShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over all layers, K and V."""
    per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim
    return per_token * block_size * torch.finfo(dtype).bits // 8


class KVCache:
    """The paged KV pool and its host tier (see the module doc).

    Args:
        shape: the model's attention shape.
        num_blocks: device blocks; block_size: tokens per block.
        dtype, device: of the pool.
        num_tier_blocks: blocks of the host tier (0 = none).

    Raises:
        ValueError: on non-positive sizes.
    """

    def __init__(
        self,
        shape: AttentionShape,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_tier_blocks: int = 0,
    ) -> None:
        if num_tier_blocks < 0:
            raise ValueError(f"num_tier_blocks must be >= 0, got {num_tier_blocks}")
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_kv_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.shape, self.block_size, self.dtype, self.device = shape, block_size, dtype, device
        self.pool = self._zeros(num_blocks, device, pin=False)
        self.num_tier_blocks = num_tier_blocks
        cuda = device.type == "cuda"
        self.tier = (
            self._zeros(num_tier_blocks, torch.device("cpu"), pin=cuda) if num_tier_blocks else None
        )
        self._copy_stream = torch.cuda.Stream(device) if num_tier_blocks and cuda else None

    @property
    def num_blocks(self) -> int:
        """Blocks in the device pool."""
        return self.pool.shape[2]

    @property
    def num_bytes(self) -> int:
        """Bytes of the device pool."""
        return self.pool.numel() * self.pool.element_size()

    def k(self, layer_idx: int) -> torch.Tensor:
        """Layer K cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.pool[layer_idx, 0]

    def v(self, layer_idx: int) -> torch.Tensor:
        """Layer V cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.pool[layer_idx, 1]

    def reallocate(self, num_blocks: int) -> None:
        """Replace the device pool by a zeroed one of ``num_blocks`` (the old one is
        freed first, so both never coexist). Its contents are lost.

        Raises:
            ValueError: if ``num_blocks`` < 1.
        """
        if num_blocks < 1:
            raise ValueError(f"need num_kv_blocks > 0, got {num_blocks}")
        del self.pool
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.pool = self._zeros(num_blocks, self.device, pin=False)

    def _zeros(self, num_blocks: int, device: torch.device, *, pin: bool) -> torch.Tensor:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` zeros.

        NOTE: zeros, not empty: padded context slots are masked to weight 0, and
        0 * NaN from uninitialised memory would still poison the output.
        """
        s = self.shape
        dims = (s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return torch.zeros(dims, dtype=self.dtype, device=device, pin_memory=pin)

    def apply_transfers(self, ops: Sequence[tuple[int, int, int, int]]) -> None:
        """Make the block copies the block manager decided for this step, in order,
        before the forward: ``(src_level, src_index, dst_level, dst_index)`` with
        level -1 the device pool and 0 the host tier. Consecutive copies between
        the same two pools go as one ``index_select`` + ``index_copy_`` over all
        layers, K and V, cut where a copy reads or writes a block an earlier copy
        of the batch wrote.

        On CUDA the copies run on a side stream that first waits for the device's
        queued work; host->device copies are asynchronous from pinned memory, the
        device->host ones wait for their data; the device stream waits on an
        event before the forward (vLLM's offloading worker does the same).

        Raises:
            ValueError: on a level other than -1 or 0, or with no host tier.
        """
        if not ops:
            return
        if self.tier is None:
            raise ValueError("KV tier copies asked for but the runner has no host tier")
        stream = self._copy_stream
        if stream is None:
            for src, dst, src_ids, dst_ids in copy_batches(ops):
                self._copy_blocks(src, dst, src_ids, dst_ids)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for src, dst, src_ids, dst_ids in copy_batches(ops):
                self._copy_blocks(src, dst, src_ids, dst_ids)
        torch.cuda.current_stream(self.device).wait_event(stream.record_event())

    @torch.inference_mode()
    def _copy_blocks(self, src: int, dst: int, src_ids: list[int], dst_ids: list[int]) -> None:
        pools = {-1: self.pool, 0: self.tier}
        if src not in pools or dst not in pools:
            raise ValueError(f"KV copy between levels {src} and {dst}: only -1 and 0 exist")
        source, target = pools[src], pools[dst]
        assert source is not None and target is not None
        rows = source.index_select(2, torch.tensor(src_ids, device=source.device))
        if rows.device != target.device:
            if target.device.type == "cpu":
                rows = rows.to("cpu")  # waits for the gather on the side stream
            else:
                rows = rows.pin_memory().to(target.device, non_blocking=True)
        target.index_copy_(2, torch.tensor(dst_ids, device=target.device), rows)


def copy_batches(
    ops: Sequence[tuple[int, int, int, int]],
) -> list[tuple[int, int, list[int], list[int]]]:
    """Group consecutive copies between the same two levels into batches
    ``(src_level, dst_level, src_ids, dst_ids)``; a copy that writes a block the
    batch already wrote, or reads one it wrote, starts a new batch (so batched
    copies equal the copies made one by one, in order)."""
    batches: list[tuple[int, int, list[int], list[int]]] = []
    written: set[tuple[int, int]] = set()
    for src, src_id, dst, dst_id in ops:
        if (
            not batches
            or batches[-1][:2] != (src, dst)
            or (dst, dst_id) in written
            or (src, src_id) in written
        ):
            batches.append((src, dst, [], []))
            written = set()
        batches[-1][2].append(src_id)
        batches[-1][3].append(dst_id)
        written.add((dst, dst_id))
    return batches
