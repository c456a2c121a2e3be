"""The ``flex`` attention backend (CPU): decodes read the paged cache in place.

Prefills go through the SDPA paths (:mod:`~roseinfer.executor.attn_sdpa`); all
single-token queries of a pass go in one ``torch.nn.attention.flex_attention``
call (compiled by ``torch.compile``) whose ``BlockMask`` *is* the block table:
query row ``i`` visits exactly the physical KV blocks of its sequence, read in
place from the cache, the last partial block masked by its fill. No gather, no
padding. This is the paged-attention formulation of PyTorch's
``torch.nn.attention.experimental._paged_attention`` (a logical->physical block
mask), with one query row per sequence (``Q_BLOCK_SIZE = 1``) as in vLLM's
decode kernels. That one-row query block is also why it does not run on CUDA
(:data:`roseinfer.executor.attention.FLEX_CUDA_REASON`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .attn_base import AttentionBackend, BackendUnavailable
from .attn_sdpa import SdpaMetadata, prefill_attention, prefill_metadata
from .input_batch import StepBatch

# torch.compile specialises a dimension of size 1, so the decode batch of the
# flex call is padded to at least 2 rows: one compiled kernel serves every size.
FLEX_MIN_ROWS = 2


@dataclass(slots=True)
class FlexDecodes:
    """All single-token queries of a batch as one flex-attention call.

    Attributes:
        token_indices: ``[n]`` packed index of each one-token query.
        block_mask: a ``BlockMask`` with ``BLOCK_SIZE = (1, block_size)`` over
            ``[rows, num_kv_blocks * block_size]`` physical slots; ``rows =
            max(n, FLEX_MIN_ROWS)`` (padding rows visit no block and give 0).
    """

    token_indices: torch.Tensor
    block_mask: Any


class FlexBackend(AttentionBackend):
    """SDPA prefills, flex decodes (see the module doc); the block mask spans
    every slot of the pool."""

    name = "flex"

    def build_metadata(self, batch: StepBatch) -> tuple[SdpaMetadata, FlexDecodes | None]:
        meta = prefill_metadata(batch)
        if not meta.decodes:
            return meta, None
        rows = meta.decodes
        starts, seq_lens = batch.host.query_start_loc, batch.host.seq_lens
        block_size = batch.block_size
        tables = [
            batch.host.block_tables[i, : -(-int(seq_lens[i]) // block_size)].tolist() for i in rows
        ]
        decodes = flex_decode_metadata(
            [int(starts[i]) for i in rows],
            tables,
            [int(seq_lens[i]) for i in rows],
            batch.num_kv_blocks,
            block_size,
            batch.token_ids.device,
        )
        return meta, decodes

    def forward(self, q, k, v, k_cache, v_cache, meta: Any, batch: StepBatch, scale: float):
        prefills, decodes = meta
        out = torch.empty_like(q)
        prefill_attention(
            out, q, k, v, k_cache, v_cache, batch.block_tables, prefills.prefills, scale
        )
        if decodes is not None:
            flex_decode_attention(out, q, k_cache, v_cache, decodes, scale)
        return out

    @torch.inference_mode()
    def probe(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
        """Compile the decode kernel now, on a probe whose row count equals no
        other size (see :func:`flex_probe_rows`), touching no cache slot; in
        inference mode, as the forward (an inference tensor where the compile saw
        a normal one would recompile, and a recompile breaks; see
        :func:`compiled_flex`).

        Raises:
            BackendUnavailable: if it does not compile here.
        """
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        slots = num_blocks * block_size
        rows = flex_probe_rows(1, num_heads, num_kv_heads, head_dim, num_blocks, slots)
        device = k_cache.device
        decodes = flex_decode_metadata(
            list(range(rows)),
            [[0]] * rows,
            [i % block_size + 1 for i in range(rows)],
            num_blocks,
            block_size,
            device,
        )
        q = torch.zeros((rows, num_heads, head_dim), dtype=k_cache.dtype, device=device)
        flex_decode_attention(torch.empty_like(q), q, k_cache, v_cache, decodes, 1.0)


def flex_available() -> bool:
    """Whether this torch has ``flex_attention`` with ``BlockMask.from_kv_blocks``."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


@functools.cache
def compiled_flex(config: tuple) -> Callable:
    """A compiled flex-attention call for one ``config`` (heads, KV heads, head
    dim, block size, dtype, device): ``fn(q, k, v, block_mask)``.

    Un-compiled, flex attention runs a reference path that materialises the
    scores against every slot of the pool; compiled (inductor's C++ template on
    CPU) it visits only the listed blocks. ``dynamic=True`` keeps one kernel for
    every batch size and pool size.

    NOTE: each config gets a function with its own code object, hence its own
    dynamo cache: a *recompile* of the same function for a new head count or
    after a size specialisation generates C++ that does not compile on CPU
    (torch 2.13, "cur_qSplitSize8 was not declared"), while a first compile of
    the same shapes is fine.
    """
    from torch.nn.attention.flex_attention import flex_attention

    enable_gqa = config[0] != config[1]

    def call(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, scale=1.0, enable_gqa=enable_gqa)

    fresh = types.FunctionType(
        call.__code__.replace(),
        call.__globals__,
        f"flex_{'_'.join(map(str, config))}",
        None,
        call.__closure__,
    )
    return torch.compile(fresh, dynamic=True)


def flex_probe_rows(*dims: int) -> int:
    """A row count for the first (compiling) call equal to none of ``dims``: dynamo
    would otherwise tie the two sizes together ("duck sizing") and recompile
    once they differ (see :func:`compiled_flex` on recompiles)."""
    rows = FLEX_MIN_ROWS + 1
    while rows in dims:
        rows += 1
    return rows


def flex_decode_metadata(
    token_indices: list[int],
    block_tables: list[list[int]],
    context_lens: list[int],
    num_kv_blocks: int,
    block_size: int,
    device: torch.device,
) -> FlexDecodes:
    """Block mask of single-token queries: row ``i`` sees the full blocks of its
    table whole and its last block up to its context length.

    Args:
        token_indices: packed index of each query.
        block_tables: each query's blocks, exactly covering its context.
        context_lens: tokens each query attends over (including itself).
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows = max(len(token_indices), FLEX_MIN_ROWS)
    lists = _flex_block_lists(block_tables, context_lens, rows, num_kv_blocks, block_size)
    full_num, full_idx, part_num, part_idx, fill_end = (t.to(device) for t in lists)

    # NOTE: the mask reads no Python int: torch.compile(dynamic=True) would make
    # one a symbol, and inductor's CPU flex template then emits C++ that does
    # not compile (torch 2.13: "cur_kvSplitSize1 was not declared").
    def in_filled_part(b, h, q_idx, kv_idx):
        return kv_idx < fill_end[q_idx]

    mask = BlockMask.from_kv_blocks(
        part_num[None, None],
        part_idx[None, None],
        full_num[None, None],
        full_idx[None, None],
        BLOCK_SIZE=(1, block_size),
        mask_mod=in_filled_part,
        seq_lengths=(rows, num_kv_blocks * block_size),
        compute_q_blocks=False,
    )
    return FlexDecodes(
        token_indices=torch.tensor(token_indices, dtype=torch.long, device=device),
        block_mask=mask,
    )


def _flex_block_lists(
    block_tables: list[list[int]],
    context_lens: list[int],
    rows: int,
    num_kv_blocks: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """Host int32 tensors of the block mask: per row, its number of full blocks
    ``[rows]`` and their ids ``[rows, num_kv_blocks]`` (zero-padded: the kernel
    wants room for every block of the pool), the same for its partial last block
    (0 or 1), and ``fill_end`` ``[rows]``: the slot after its last token (its
    partial block holds tokens in slots ``[block * block_size, fill_end)``)."""
    full_idx = torch.zeros((rows, num_kv_blocks), dtype=torch.int32)
    part_idx = torch.zeros((rows, num_kv_blocks), dtype=torch.int32)
    full_num, part_num, fill_end = [0] * rows, [0] * rows, [0] * rows
    for i, (table, ctx) in enumerate(zip(block_tables, context_lens)):
        num_full, rest = divmod(ctx, block_size)
        full_num[i] = num_full
        full_idx[i, :num_full] = torch.tensor(table[:num_full], dtype=torch.int32)
        if rest:
            part_num[i], part_idx[i, 0] = 1, table[num_full]
            fill_end[i] = table[num_full] * block_size + rest
    as_int32 = functools.partial(torch.tensor, dtype=torch.int32)
    return as_int32(full_num), full_idx, as_int32(part_num), part_idx, as_int32(fill_end)


def flex_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dec: FlexDecodes,
    scale: float,
) -> None:
    """Single-token queries of ``q`` in one flex call reading the cache in place.

    The softmax scale is applied to the queries (the kernel runs with scale 1),
    so the compiled kernel never specialises on a per-layer float.

    Raises:
        BackendUnavailable: if the kernel does not compile or run (the runner
            then falls back to SDPA).
    """
    n = dec.token_indices.numel()
    rows = dec.block_mask.shape[-2]
    q_dec = q.index_select(0, dec.token_indices) * scale  # [n, H, D]
    if rows > n:
        q_dec = F.pad(q_dec, (0, 0, 0, 0, 0, rows - n))
    q_dec = q_dec.transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]
    # [1, Hkv, slots, D] views of the cache; detach() drops the view's base, whose
    # unrelated sizes (layers, K/V) dynamo would otherwise guard on.
    k = k_cache.flatten(0, 1).transpose(0, 1).unsqueeze(0).detach()
    v = v_cache.flatten(0, 1).transpose(0, 1).unsqueeze(0).detach()
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    config = (heads, kv_heads, head_dim, k_cache.shape[1], str(q.dtype), str(q.device))
    try:
        o = compiled_flex(config)(q_dec, k, v, dec.block_mask)
    except Exception as e:  # noqa: BLE001 - compiler failures come in many types
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise BackendUnavailable(f"{type(e).__name__}: {first_line}") from e
    out.index_copy_(0, dec.token_indices, o[0, :, :n].transpose(0, 1))
