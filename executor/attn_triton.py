"""The ``triton`` attention backend: one paged-attention kernel per layer (CUDA).

Host side of :mod:`roseinfer.executor.triton_kernels` (imported when the
backend is built, so ``TRITON_INTERPRET`` set before that applies). Per pass it
chooses the launch shape from host integers only (no device read):

* query blocks: each sequence's query tokens cut into runs of ``block_q``
  (:func:`query_blocks`); ``block_q`` gives 16 rows per program for a decode
  batch (``block_q`` x query heads per KV head; ``tl.dot`` needs >= 16) and 64
  otherwise, so a prefill's K/V tiles are reused across many queries;
* key tiles of 32 tokens for decodes, 64 otherwise;
* split-KV: a decode batch whose ``sequences x KV heads`` programs would not
  reach one per SM is split into ``ceil(SMs / programs)`` key ranges (at most
  :data:`MAX_SPLITS`). The split count depends on the batch size rounded up to
  the CUDA-graph capture grid, so a graph replay and an eager step of the same
  batch run the same kernels.

Every launch parameter is a function of the pass's shape, so a padded decode
batch has one fixed launch: the backend supports CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .attn_base import AttentionBackend, pow2_at_least
from .graph_runner import DEFAULT_CAPTURE_LIMIT, capture_sizes, padded_size
from .input_batch import StepBatch

DECODE_ROWS, PREFILL_ROWS = 16, 64  # query rows per program
DECODE_TILE, PREFILL_TILE = 32, 64  # keys per tile
MAX_SPLITS = 16
INTERPRETER_NUM_SMS = 4  # what the CPU interpreter pretends to have (exercises split-KV)
_SPLIT_GRID = capture_sizes(DEFAULT_CAPTURE_LIMIT)


@dataclass(slots=True)
class TritonMetadata:
    """Launch shape of one pass (host ints) and the query-block map (device).

    Attributes:
        q_block_seq, q_block_start: ``[num_q_blocks]`` int64 (see :func:`query_blocks`).
        block_q, tile_n, num_splits: see the module doc.
    """

    q_block_seq: torch.Tensor
    q_block_start: torch.Tensor
    block_q: int
    tile_n: int
    num_splits: int


class TritonBackend(AttentionBackend):
    """Paged attention and the KV store in Triton (see the module doc).

    Args:
        num_heads, num_kv_heads: the model's query and KV heads.
        device: CUDA, or CPU under Triton's interpreter.

    Raises:
        ValueError: if the kernels were imported for the wrong place (the
            interpreter on CUDA, or compiled kernels on CPU).
    """

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, device: torch.device) -> None:
        from . import triton_kernels

        if triton_kernels.interpreted() != (device.type != "cuda"):
            raise ValueError(
                f"the Triton kernels were loaded {'for' if triton_kernels.interpreted() else 'without'}"
                f" Triton's interpreter but run on {device.type}; set TRITON_INTERPRET=1 only to "
                "run them on CPU, before they are first imported"
            )
        self.kernels = triton_kernels
        self.num_kv_heads = num_kv_heads
        self.groups_p = pow2_at_least(num_heads // num_kv_heads)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else INTERPRETER_NUM_SMS
        )

    def block_q(self, max_query_len: int) -> int:
        """Queries per program: rows (16 decode, 64 otherwise) / query heads per KV head."""
        rows = DECODE_ROWS if max_query_len == 1 else PREFILL_ROWS
        return max(1, rows // self.groups_p)

    def num_splits(self, num_seqs: int, max_query_len: int) -> int:
        """Key-range splits: > 1 only for a decode batch too small to give every SM
        a program (sequences rounded up to the capture grid; see the module doc)."""
        if max_query_len != 1:
            return 1
        programs = (padded_size(num_seqs, _SPLIT_GRID) or num_seqs) * self.num_kv_heads
        return max(1, min(MAX_SPLITS, -(-self.num_sms // programs)))

    def host_fields(self, query_lens: np.ndarray, max_query_len: int) -> dict[str, np.ndarray]:
        seq, start = query_blocks(query_lens, self.block_q(max_query_len))
        return {"q_block_seq": seq, "q_block_start": start}

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        decode = batch.max_query_len == 1
        return TritonMetadata(
            q_block_seq=batch.extra["q_block_seq"],
            q_block_start=batch.extra["q_block_start"],
            block_q=self.block_q(batch.max_query_len),
            tile_n=DECODE_TILE if decode else PREFILL_TILE,
            num_splits=self.num_splits(batch.num_seqs, batch.max_query_len),
        )

    def write_kv(self, k, v, k_cache, v_cache, batch: StepBatch) -> None:
        self.kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: Any, batch: StepBatch, scale: float):
        out = torch.empty_like(q)
        self.kernels.paged_attention(
            out,
            q,
            k_cache,
            v_cache,
            block_tables=batch.block_tables,
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc,
            q_block_seq=meta.q_block_seq,
            q_block_start=meta.q_block_start,
            num_q_blocks=meta.q_block_seq.shape[0],
            block_q=meta.block_q,
            tile_n=meta.tile_n,
            num_splits=meta.num_splits,
            scale=scale,
        )
        return out


def query_blocks(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut each sequence's queries into blocks of ``block_q``.

    Returns:
        per block, its sequence and the index of its first query in that
        sequence (int64 arrays of ``sum(ceil(query_lens / block_q))``).
    """
    counts = -(-query_lens // block_q)
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int64), counts)
    first_block = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(len(seq), dtype=np.int64) - first_block) * block_q
    return seq, start
