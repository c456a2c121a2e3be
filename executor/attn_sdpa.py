"""The ``sdpa`` attention backend: the reference, on any device.

``torch.nn.functional.scaled_dot_product_attention`` over gathered context:

* a prefill that starts at position 0 attends over its own new K/V (no cache
  read); one with a cached prefix gathers its context blocks and uses a
  bottom-right causal mask;
* single-token queries (decodes) are grouped by context length; each group
  gathers its context blocks (padded to its longest) for one SDPA call.

Every other backend is tested against this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .attn_base import AttentionBackend
from .input_batch import StepBatch

# NOTE: SDPA grew ``enable_gqa`` in torch 2.5; before, K/V heads are repeated.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
MAX_DECODE_PADDING = 1.5  # a decode group's longest context vs its shortest


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
class SdpaMetadata:
    """Per-pass inputs of the SDPA paths (shared by all layers).

    Attributes:
        prefills: sequences with several query tokens.
        decode_groups: single-token queries, grouped by context length.
        decodes: the single-token queries' rows (for backends that attend them
            another way, e.g. flex).
    """

    prefills: list[Prefill] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)


class SdpaBackend(AttentionBackend):
    """The reference backend (see the module doc)."""

    name = "sdpa"

    def build_metadata(self, batch: StepBatch) -> SdpaMetadata:
        meta = prefill_metadata(batch)
        if meta.decodes:
            meta.decode_groups = decode_groups(batch, meta.decodes)
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: Any, batch: StepBatch, scale: float):
        out = torch.empty_like(q)
        prefill_attention(out, q, k, v, k_cache, v_cache, batch.block_tables, meta.prefills, scale)
        grouped_decode_attention(out, q, k_cache, v_cache, meta.decode_groups, scale)
        return out


def prefill_metadata(batch: StepBatch) -> SdpaMetadata:
    """The prefills (with their masks) and the rows of the single-token queries."""
    meta = SdpaMetadata()
    starts = batch.host.query_start_loc.tolist()
    query_lens = batch.host.query_lens.tolist()
    seq_lens = batch.host.seq_lens.tolist()
    device = batch.token_ids.device
    for seq_idx, num_query in enumerate(query_lens):
        if num_query == 1:
            meta.decodes.append(seq_idx)
            continue
        ctx = seq_lens[seq_idx]
        mask = None if ctx == num_query else offset_causal_mask(num_query, ctx, device)
        meta.prefills.append(Prefill(seq_idx, starts[seq_idx], num_query, ctx, mask))
    return meta


def decode_groups(batch: StepBatch, rows: list[int]) -> list[DecodeGroup]:
    """Group the decodes by context length (sorted, a new group once the longest
    would exceed ``MAX_DECODE_PADDING`` x the shortest) so the padded gather of
    each group reads little more than its real contexts."""
    seq_lens = batch.host.seq_lens.tolist()
    order = sorted(rows, key=lambda i: seq_lens[i])
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and seq_lens[i] > MAX_DECODE_PADDING * seq_lens[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    return [_decode_group(batch, g, seq_lens) for g in groups]


def _decode_group(batch: StepBatch, members: list[int], seq_lens: list[int]) -> DecodeGroup:
    """Block ids ``[n * max_blocks]`` and padding mask of one decode group."""
    block_size = batch.block_size
    num_blocks = [-(-seq_lens[i] // block_size) for i in members]
    max_blocks = max(num_blocks)
    block_ids = batch.host.block_tables[members, :max_blocks].reshape(-1)
    device = batch.token_ids.device
    lens = torch.tensor([seq_lens[i] for i in members], device=device)
    offsets = torch.arange(max_blocks * block_size, device=device)
    starts = batch.host.query_start_loc
    return DecodeGroup(
        token_indices=torch.tensor(
            [int(starts[i]) for i in members], dtype=torch.long, device=device
        ),
        block_ids=torch.as_tensor(block_ids, device=device),
        mask=(offsets[None, :] < lens[:, None])[:, None, None, :],
    )


def offset_causal_mask(num_query: int, context_len: int, device: torch.device) -> torch.Tensor:
    """``[num_query, context_len]`` bool: query i (position ``context_len -
    num_query + i``) sees keys at positions up to its own (bottom-right causal)."""
    query_pos = torch.arange(context_len - num_query, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


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
