"""Triton kernels of the ``triton`` attention backend: paged attention and the KV store.

Three kernels, each reading the paged cache in place (layout ``[num_blocks,
block_size, num_kv_heads, head_dim]`` per layer; a token at position ``p`` of a
sequence lives at block ``block_table[p // block_size]``, row ``p % block_size``):

* :func:`paged_attention` (``_paged_attention_kernel``): one varlen launch for
  every query token of a pass, whether it belongs to a prompt from position 0,
  a prompt chunk over a cached prefix, or a decode. A program takes one *query
  block* (up to ``block_q`` consecutive query tokens of one sequence) times one
  KV head, with all ``num_heads / num_kv_heads`` query heads that share that KV
  head packed as rows of the same tile (GQA), so each K/V tile is loaded once
  for all of them. It walks the sequence's keys in tiles of ``tile_n`` tokens,
  looking up each token's physical block in the block table (no gather, no
  padding to the longest context), with a bottom-right causal mask and an
  online softmax in base 2.
* Split-KV (``num_splits > 1``): a third grid axis cuts each query block's key
  range into ``num_splits`` equal runs of tiles; each program writes its
  unnormalised partial output with its running max and sum, and
  ``_split_kv_reduce_kernel`` merges them. Used for decode batches too small to
  fill the GPU (one program per sequence and KV head would leave SMs idle).
* Balanced splits (a *work list*, decode batches only): the grid's first axis
  runs over work items instead of query blocks, each item a query block and a
  run of its key tiles. A large decode batch then cuts only its long contexts
  into several items (see ``attn_triton.balanced_work``), so the longest one no
  longer streams its keys alone on one SM after the rest are done. An item that
  covers its whole context writes the final output; the others write partials,
  which the reduce merges per split sequence, read from a list of ``(token,
  first partial row, rows)``. A work list of this kind, of a fixed length so that
  CUDA graphs hold, is FlashInfer's load-balanced scheduling (Ye et al., 2025,
  arXiv:2501.01005); the rule that fills it here is roseinfer's own.
* :func:`store_kv` (``_store_kv_kernel``): writes each new token's K and V at
  its slot; a negative slot (a padded row of a CUDA-graph batch) is skipped.

The algorithm is the paged, varlen form of FlashAttention's tiling (Dao et al.,
2022) with the split-KV reduction of Flash-Decoding; vLLM's Triton attention
backend (``triton_unified_attention``) uses the same decomposition. Rows that
see no key (padding) output 0, never NaN.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` in the
environment before this module is imported), which the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_base import pow2_at_least

LOG2_E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs
# Finite "minus infinity" for running maxima: exp2(NEG_BIG - m) is 0, not NaN.
NEG_BIG = tl.constexpr(-1.0e30)


def interpreted() -> bool:
    """Whether these kernels were built for Triton's interpreter (CPU tensors).

    Raises:
        RuntimeError: if ``triton.language`` was imported in the other mode (its
            helpers such as ``tl.sum`` would then fail inside the kernels).
    """
    mine = type(_store_kv_kernel).__name__ == "InterpretedFunction"
    if mine != (type(tl.sum).__name__ == "InterpretedFunction"):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET changed; set it before importing "
            "anything that imports triton"
        )
    return mine


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HEAD_DIM_P)[None, :]
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # a padded row (slot < 0) stores nothing
    mask = (head < num_heads) & (dim < HEAD_DIM)
    safe = tl.maximum(slot, 0)
    dst = (
        (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs + head * stride_ch + dim
    )
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dim, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dim, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` at their slots.

    Args:
        k, v: this pass's keys and values (last dimension contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous in their last three dimensions.
        slot_mapping: ``[>= num_tokens]`` int, ``block * block_size + offset`` per
            token; -1 skips the token (padding).
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_P=pow2_at_least(num_kv_heads), HEAD_DIM_P=pow2_at_least(head_dim),
    )  # fmt: skip


@triton.jit
def _store_output(out_ptr, acc, run_sum, token, head, dim, stride_ot, stride_oh, mask):
    denom = tl.where(run_sum > 0, run_sum, 1.0)  # rows that saw no key output 0
    out = acc / denom[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


# The block-table width changes with every pass's longest sequence: compiled
# once for all widths (Triton would otherwise specialise on width 1 and on
# multiples of 16, compiling new variants in the middle of a run).
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    q_block_seq_ptr,
    q_block_start_ptr,
    work_items_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    BLOCK_SIZE: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    GROUPS_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WORK_LIST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if WORK_LIST:  # an item: (query block, first tile, end tile, partial row or -1 / -2)
        item = work_items_ptr + tl.program_id(0) * 4
        q_block = tl.load(item).to(tl.int32)
        item_lo = tl.load(item + 1).to(tl.int32)
        item_hi = tl.load(item + 2).to(tl.int32)
        part_row = tl.load(item + 3).to(tl.int32)
    else:
        q_block = tl.program_id(0)
    seq = tl.load(q_block_seq_ptr + q_block)
    first_query = tl.load(q_block_start_ptr + q_block)
    query_begin = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len
    if WORK_LIST:  # a padding item has no row: nothing loaded, nothing stored
        query_len = tl.where(part_row == -2, 0, query_len)

    rows = tl.arange(0, BLOCK_Q * GROUPS_P)
    query = first_query + rows // GROUPS_P  # index of each row's query within its sequence
    head = kv_head * NUM_GROUPS + rows % GROUPS_P
    row_ok = (query < query_len) & (rows % GROUPS_P < NUM_GROUPS)
    dim = tl.arange(0, HEAD_DIM_P)
    dim_ok = dim < HEAD_DIM
    token = query_begin + query
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    query_pos = prefix_len + query

    # Keys this query block may see: positions [0, position of its last query].
    num_keys = prefix_len + tl.minimum(first_query + BLOCK_Q, query_len)
    num_tiles = tl.cdiv(num_keys, TILE_N)
    if WORK_LIST:
        tile_lo = item_lo
        tile_hi = tl.minimum(item_hi, num_tiles)
    else:  # each context cut into NUM_SPLITS equal runs
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    run_max = tl.full([BLOCK_Q * GROUPS_P], NEG_BIG, tl.float32)
    run_sum = tl.zeros([BLOCK_Q * GROUPS_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUPS_P, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + tl.arange(0, TILE_N)
        key_ok = key_pos < num_keys
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (key_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(
            k_cache_ptr + slot[None, :] + dim[:, None],
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k, input_precision=DOT_PRECISION)
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, 1))
        p = tl.exp2(scores - new_max[:, None])
        alpha = tl.exp2(run_max - new_max)
        run_sum = run_sum * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot[:, None] + dim[None, :],
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        run_max = new_max

    store_mask = row_ok[:, None] & dim_ok[None, :]
    if WORK_LIST:
        if part_row == -1:  # the item covers its context: the final output
            _store_output(out_ptr, acc, run_sum, token, head, dim, stride_ot, stride_oh,
                          store_mask)  # fmt: skip
        elif part_row >= 0:  # one run of a split context (a decode: one query row)
            part = part_row * stride_pt + head[:, None] * stride_ph
            if tile_hi > tile_lo:
                tl.store(part_out_ptr + part + dim[None, :], acc, mask=store_mask)
            stat = part_row * stride_mt + head * stride_mh
            tl.store(part_max_ptr + stat, run_max, mask=row_ok)
            tl.store(part_sum_ptr + stat, run_sum, mask=row_ok)
    elif NUM_SPLITS == 1:
        _store_output(out_ptr, acc, run_sum, token, head, dim, stride_ot, stride_oh, store_mask)
    else:
        part = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        # a split past its context's keys writes only its statistics (sum 0): the
        # reduce reads no partial output where the sum is 0
        if tile_hi > tile_lo:
            tl.store(part_out_ptr + part + dim[None, :], acc, mask=store_mask)
        stat = token * stride_mt + head * stride_mh + split
        tl.store(part_max_ptr + stat, run_max, mask=row_ok)
        tl.store(part_sum_ptr + stat, run_sum, mask=row_ok)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    work_reduce_ptr,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_mt,
    stride_mh,
    stride_ms,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    WORK_LIST: tl.constexpr,
):
    head = tl.program_id(1)
    if WORK_LIST:  # a split sequence: (its token, first partial row, rows); rows 0: none
        entry = work_reduce_ptr + tl.program_id(0) * 3
        token = tl.load(entry)
        first = tl.load(entry + 1)
        count = tl.load(entry + 2)
    else:  # every token, NUM_SPLITS partials each
        token = tl.program_id(0)
        first = token
        count = NUM_SPLITS
    split = tl.arange(0, SPLITS_P)
    split_ok = split < count
    dim = tl.arange(0, HEAD_DIM_P)
    stat = first * stride_mt + head * stride_mh + split * stride_ms
    part_max = tl.load(part_max_ptr + stat, mask=split_ok, other=NEG_BIG)
    part_sum = tl.load(part_sum_ptr + stat, mask=split_ok, other=0.0)
    weight = tl.exp2(part_max - tl.max(part_max, 0))
    total = tl.sum(part_sum * weight, 0)
    part = first * stride_pt + head * stride_ph + split[:, None] * stride_ps + dim[None, :]
    seen = split_ok & (part_sum > 0)  # splits that saw a key wrote a partial output
    acc = tl.load(part_out_ptr + part, mask=seen[:, None] & (dim[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_ptrs = out_ptr + token * stride_ot + head * stride_oh + dim
    if WORK_LIST:  # noqa: SIM108 - a static branch of the kernel, not an expression
        width = tl.where(count > 0, HEAD_DIM, 0)  # a padding entry writes nothing
    else:
        width = HEAD_DIM
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim < width)


@dataclass(frozen=True, slots=True)
class WorkList:
    """A decode pass's balanced splits on the device (built on the host by
    ``attn_triton.balanced_work``).

    Attributes:
        items: ``[num_items, 4]`` int64, one program per item and KV head: its
            query block, first key tile, end tile (clipped to the context) and
            partial row (-1: the item covers its context and writes the output;
            -2: padding, writes nothing).
        reduce: ``[num_reduce, 3]`` int64, per split sequence: its token, first
            partial row and number of rows (consecutive; 0 rows: padding).
        max_parts: the most partial rows of one sequence.
    """

    items: torch.Tensor
    reduce: torch.Tensor
    max_parts: int


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    q_block_seq: torch.Tensor,
    q_block_start: torch.Tensor,
    num_q_blocks: int,
    block_q: int,
    tile_n: int,
    num_splits: int,
    scale: float,
    num_warps: int = 4,
    num_stages: int = 3,
    work: WorkList | None = None,
) -> None:
    """Attention of every query token of a pass over its sequence's paged K/V.

    Args:
        out: ``[num_tokens, num_heads, head_dim]``, written (rows of no query
            block are left as they are).
        q: ``[num_tokens, num_heads, head_dim]``, last dimension contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int, physical blocks per sequence.
        seq_lens: ``[num_seqs]`` int, context tokens per sequence (cached prefix +
            this pass's queries); 0 for a padding sequence (it sees nothing).
        query_start_loc: ``[num_seqs + 1]`` int, prefix sums of the query counts.
        q_block_seq, q_block_start: ``[>= num_q_blocks]`` int: per query block,
            its sequence and the index of its first query in that sequence
            (see :func:`query_blocks`).
        num_q_blocks: query blocks to run (the grid's first axis without ``work``).
        block_q: queries per query block (rows = ``block_q`` x query heads per
            KV head, padded to a power of two).
        tile_n: keys per tile (a power of two >= 16).
        num_splits: key-range splits per query block (1 = no split; > 1 needs
            every query block to hold one query token, i.e. a decode batch).
        scale: softmax scale of q.k.
        num_warps, num_stages: the launch's warps per program and software
            pipeline depth (Triton's launch options; ignored by the interpreter).
        work: balanced splits of a decode batch (every query block one query
            token; its tiles counted in ``tile_n``): the grid runs over its items.

    Raises:
        ValueError: on ``work`` with ``num_splits > 1``.
    """
    if work is not None and num_splits != 1:
        raise ValueError(f"a work list replaces equal splits; got num_splits {num_splits}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_groups = num_heads // k_cache.shape[2]
    head_dim_p = pow2_at_least(head_dim, MIN_DOT)
    # float32 in float32 (tests compare with transformers); tf32 is Triton's default
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    rows = work.items.shape[0] if work is not None else num_q_blocks
    part_out, part_max, part_sum, main_strides, reduce_strides = _partials(
        q, num_splits, head_dim_p, work, out
    )
    items = work.items if work is not None else q_block_seq  # a placeholder when unused
    _paged_attention_kernel[(rows, k_cache.shape[2], num_splits)](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q_block_seq,
        q_block_start, items, part_out, part_max, part_sum, scale * LOG2_E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        *main_strides,
        BLOCK_SIZE=k_cache.shape[1], NUM_GROUPS=num_groups, GROUPS_P=pow2_at_least(num_groups),
        BLOCK_Q=block_q, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, NUM_SPLITS=num_splits,
        WORK_LIST=work is not None, DOT_PRECISION=precision, TILE_N=tile_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits == 1 and work is None:
        return
    num_reduce = work.reduce.shape[0] if work is not None else q.shape[0]
    splits = work.max_parts if work is not None else num_splits
    _split_kv_reduce_kernel[(num_reduce, num_heads)](
        out, part_out, part_max, part_sum, work.reduce if work is not None else q_block_seq,
        out.stride(0), out.stride(1), *reduce_strides,
        NUM_SPLITS=splits, SPLITS_P=pow2_at_least(splits), HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, WORK_LIST=work is not None,
    )  # fmt: skip


def _partials(q, num_splits: int, head_dim_p: int, work: WorkList | None, out):
    """Partial outputs, maxima and sums of a split pass (fp32; placeholders
    without splits), with the main kernel's strides ``(row, head, split, stat
    row, stat head)`` and the reduce's ``(row, head, next split, stat row, stat
    head, next stat)``."""
    num_heads = q.shape[1]
    if work is None and num_splits == 1:
        return out, out, out, (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0)
    as_f32 = {"dtype": torch.float32, "device": q.device}
    if work is not None:  # one partial row per item at most
        num_rows = work.items.shape[0]
        part_out = torch.empty((num_rows, num_heads, head_dim_p), **as_f32)
        part_max = torch.empty((num_rows, num_heads), **as_f32)
        row, head = part_out.stride()[:2]
        stat_row, stat_head = part_max.stride()
        main: tuple[int, ...] = (row, head, 0, stat_row, stat_head)
        return part_out, part_max, torch.empty_like(part_max), main, (
            row, head, row, stat_row, stat_head, stat_row)  # fmt: skip
    num_tokens = q.shape[0]
    part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim_p), **as_f32)
    part_max = torch.empty((num_tokens, num_heads, num_splits), **as_f32)
    main = (*part_out.stride()[:3], *part_max.stride()[:2])
    return part_out, part_max, torch.empty_like(part_max), main, (*main, part_max.stride(2))
