"""The ``flash_attn`` attention backend (CUDA, optional package).

One ``flash_attn_varlen_func`` call per layer reads the paged cache through the
block table. flash-attn's causal mask is bottom-right aligned when query and
key lengths differ, which is exactly "see the cached prefix plus earlier new
tokens". Source: flash_attn/flash_attn_interface.py (flash-attn >= 2.5,
``block_table``); its paged path wants page sizes that are multiples of 256.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .attn_base import AttentionBackend
from .input_batch import StepBatch


@dataclass(slots=True)
class FlashMetadata:
    """``cu_seqlens_q``/``cu_seqlens_k`` ``[num_seqs + 1]`` int32 prefix sums of
    query and context lengths, the block table as int32, and the longest query
    and context (host ints)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class FlashAttnBackend(AttentionBackend):
    """flash-attn's varlen kernel over the paged cache.

    Args:
        flash_varlen: ``flash_attn_varlen_func`` (or a function with its semantics).
    """

    name = "flash_attn"

    def __init__(self, flash_varlen: Callable) -> None:
        self.flash_varlen = flash_varlen

    def build_metadata(self, batch: StepBatch) -> FlashMetadata:
        cu_k = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
        torch.cumsum(batch.seq_lens, 0, out=cu_k[1:])
        return FlashMetadata(
            cu_seqlens_q=batch.query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_k,
            block_tables=batch.block_tables.to(torch.int32),
            max_seqlen_q=batch.max_query_len,
            max_seqlen_k=batch.max_seq_len,
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: Any, batch: StepBatch, scale: float):
        return self.flash_varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
        )


def load_flash_varlen() -> Callable | None:
    """``flash_attn.flash_attn_varlen_func`` if installed with paged-KV support."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    params = inspect.signature(flash_attn_varlen_func).parameters
    return flash_attn_varlen_func if "block_table" in params else None
