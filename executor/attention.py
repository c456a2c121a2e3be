"""Attention kernels over the paged KV cache (the model runner's ``_attend``).

Three ways to attend, chosen per runner (``attention_backend``):

* ``sdpa`` (any device): ``torch.nn.functional.scaled_dot_product_attention``.
  A prefill that starts at position 0 attends over its own new K/V (no cache
  read); one with a cached prefix gathers its context blocks and uses a
  bottom-right causal mask. Single-token queries (decodes) are grouped by
  context length; each group gathers its context blocks (padded to its longest)
  for one SDPA call.
* ``flex``: prefills as under ``sdpa``; all single-token queries in one
  ``torch.nn.attention.flex_attention`` call (compiled by ``torch.compile``)
  whose ``BlockMask`` *is* the block table: query row ``i`` visits exactly the
  physical KV blocks of its sequence, read in place from the cache, the last
  partial block masked by its fill. No gather, no padding. This is the
  paged-attention formulation of PyTorch's ``torch.nn.attention.experimental.
  _paged_attention`` (a logical->physical block mask), with one query row per
  sequence (``Q_BLOCK_SIZE = 1``) as in vLLM's decode kernels.
* ``flash_attn`` (CUDA): one ``flash_attn_varlen_func`` call reading the paged
  cache through a block table.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

# NOTE: SDPA grew ``enable_gqa`` in torch 2.5; before, K/V heads are repeated.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# torch.compile specialises a dimension of size 1, so the decode batch of the
# flex call is padded to at least 2 rows: one compiled kernel serves every size.
FLEX_MIN_ROWS = 2


@dataclass(slots=True)
class Prefill:
    """A sequence with more than one query token (attended alone).

    Attributes:
        seq_idx: its row in the batch's block tables.
        query_start: index of its first token in the packed batch.
        num_query_tokens: its new tokens this step.
        context_len: ``start_pos + num_query_tokens``.
        mask: ``[num_query, context]`` bool (True = attend) when it has a cached
            prefix; None for a prompt from position 0 (plain causal over its own K/V).
    """

    seq_idx: int
    query_start: int
    num_query_tokens: int
    context_len: int
    mask: torch.Tensor | None


@dataclass(slots=True)
class DecodeGroup:
    """One SDPA call over single-token queries of similar context length.

    Attributes:
        token_indices: ``[n]`` packed index of each one-token query.
        block_ids: ``[n * max_blocks]`` the group's block tables, row-major,
            padded with block 0 (a valid block whose slots are masked out).
        mask: ``[n, 1, 1, max_blocks * block_size]`` bool, True = attend.
    """

    token_indices: torch.Tensor
    block_ids: torch.Tensor
    mask: torch.Tensor


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


@dataclass(slots=True)
class AttentionMetadata:
    """Per-batch attention inputs shared by all layers (what ``prepare`` adds).

    Attributes:
        prefills: sequences with several query tokens.
        decode_groups: single-token queries for SDPA, grouped by context length.
        flex_decodes: single-token queries for flex attention (``flex`` only).
    """

    prefills: list[Prefill] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    flex_decodes: FlexDecodes | None = None


# ---------------------------------------------------------------- sdpa paths


def prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefills: list[Prefill],
    scale: float,
) -> None:
    """Write each prefill's attention output into ``out`` (SDPA, one call each).

    Args:
        out, q: ``[num_tokens, num_heads, head_dim]``.
        k_new, v_new: ``[num_tokens, num_kv_heads, head_dim]``, this step's K/V
            (already written to the cache).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int64.
    """
    for p in prefills:
        rows = slice(p.query_start, p.query_start + p.num_query_tokens)
        if p.mask is None:  # a prompt from position 0: its context is its own new K/V
            k, v = k_new[rows], v_new[rows]
        else:
            blocks = block_tables[p.seq_idx]
            k = k_cache.index_select(0, blocks).flatten(0, 1)[: p.context_len]
            v = v_cache.index_select(0, blocks).flatten(0, 1)[: p.context_len]
        out[rows] = sdpa(q[rows].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), p.mask, scale)[0]


def grouped_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: list[DecodeGroup],
    scale: float,
) -> None:
    """Single-token queries, one SDPA call per group over its gathered blocks.

    Blocks are gathered whole with ``index_select`` (contiguous
    ``block_size * heads * head_dim`` copies), several times faster on CPU than
    indexing slot by slot.
    """
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    for group in groups:
        n = group.token_indices.numel()
        ctx_shape = (n, -1, num_kv_heads, head_dim)
        k = k_cache.index_select(0, group.block_ids).view(ctx_shape)
        v = v_cache.index_select(0, group.block_ids).view(ctx_shape)
        q_dec = q.index_select(0, group.token_indices).unsqueeze(1)  # [n, 1, H, D]
        o = sdpa(q_dec, k, v, group.mask, scale)
        out.index_copy_(0, group.token_indices, o[:, 0])


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA on ``[B, len, heads, head_dim]`` tensors (K/V may have fewer heads).

    ``mask`` is None for plain top-left causal (query len == key len), else a
    bool mask broadcastable to ``[B, heads, q_len, k_len]``.
    """
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    num_groups = q.shape[1] // k.shape[1]
    kwargs = {}
    if num_groups > 1 and _SDPA_HAS_GQA:
        kwargs["enable_gqa"] = True
    elif num_groups > 1:
        k, v = k.repeat_interleave(num_groups, dim=1), v.repeat_interleave(num_groups, dim=1)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, **kwargs
    )
    return o.transpose(1, 2)


# ---------------------------------------------------------------- flex path


def flex_available() -> bool:
    """Whether this torch has ``flex_attention`` with ``BlockMask.from_kv_blocks``."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(BlockMask, "from_kv_blocks")


class FlexUnavailable(RuntimeError):
    """The compiled flex-attention kernel failed to build or run here."""


@functools.cache
def compiled_flex(config: tuple) -> Callable:
    """A compiled flex-attention call for one ``config`` (heads, KV heads, head
    dim, block size, dtype, device): ``fn(q, k, v, block_mask)``.

    Un-compiled, flex attention runs a reference path that materialises the
    scores against every slot of the pool; compiled (inductor's C++ template on
    CPU, Triton on CUDA) it visits only the listed blocks. ``dynamic=True``
    keeps one kernel for every batch size and pool size.

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
        FlexUnavailable: if the kernel does not compile or run (the runner
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
        raise FlexUnavailable(f"{type(e).__name__}: {first_line}") from e
    out.index_copy_(0, dec.token_indices, o[0, :, :n].transpose(0, 1))


# ---------------------------------------------------------------- flash path


def flash_attention(
    flash_varlen: Callable,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One ``flash_attn_varlen_func`` call reading the paged cache.

    flash-attn's causal mask is bottom-right aligned when query and key lengths
    differ, which is exactly "see the cached prefix plus earlier new tokens".
    Source: flash_attn/flash_attn_interface.py (flash-attn >= 2.5, ``block_table``).
    """
    return flash_varlen(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_tables,
    )
