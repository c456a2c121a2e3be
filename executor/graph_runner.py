"""Decode passes replayed from CUDA graphs captured at fixed batch sizes.

A decode step launches hundreds of small kernels (a few per layer); on a GPU
their launch cost, not their work, bounds small batches. A CUDA graph records
the whole decode body once (embedding, every layer, the final hidden states)
and replays it with one launch. Graphs replay fixed addresses and shapes, so:

* the body reads persistent *static* buffers (token ids, positions, slot
  mapping, sequence lengths, query starts, block tables ``[max_num_seqs,
  max_blocks_per_seq]`` and the backend's fields), sized once;
* graphs are captured at the batch sizes of :func:`capture_sizes` (vLLM's: 1,
  2, 4, 8, then every multiple of 8 up to ``max_num_seqs``, at most 512;
  ``_BATCH_SIZES_TO_CAPTURE`` in vllm/worker/model_runner.py, 512 in v1's
  CompilationConfig), largest first, all in one memory pool (a graph's
  intermediate buffers are dead once it returns, so the next one reuses them);
  the output is copied into a static buffer allocated outside the pool;
* a batch is padded up to the next captured size with rows that compute nothing
  (:mod:`roseinfer.executor.input_batch`), copied into the static buffers, and
  replayed; its real rows come back first.

Mixed and prefill passes stay eager: their shapes vary without bound.

Without CUDA (or with ``use_cuda_graphs=False``) the same object runs the same
static-buffer path eagerly: sizes, padding, buffer copies and per-size metadata
are exercised by the CPU tests; only ``torch.cuda.CUDAGraph`` is left out.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roseinfer.calibration.profile_grid import MAX_GRAPH_BATCH_SIZE, cuda_graph_batch_sizes

from .input_batch import PAD_SLOT, HostStep, StepBatch

if TYPE_CHECKING:
    from .attn_base import AttentionBackend

DEFAULT_CAPTURE_LIMIT = MAX_GRAPH_BATCH_SIZE  # 512, vLLM's
Body = Callable[[StepBatch, Any], torch.Tensor]


def capture_sizes(max_num_seqs: int, limit: int = DEFAULT_CAPTURE_LIMIT) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8, up to ``max_num_seqs``
    and never past ``limit`` (the one rule: :func:`roseinfer.calibration.profile_grid.
    cuda_graph_batch_sizes`, which the profiler times decodes at). A larger batch
    runs eagerly.

    Raises:
        ValueError: if ``max_num_seqs`` < 1.
    """
    return list(cuda_graph_batch_sizes(max_num_seqs, limit))


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= ``num_seqs`` (None when larger than all)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass(slots=True)
class _Captured:
    """One captured size: its graph (None when eager), metadata and input views."""

    graph: Any
    meta: Any
    batch: StepBatch


class GraphRunner:
    """Runs padded decode passes through static buffers, replaying CUDA graphs.

    Args:
        body: the model body ``(batch, meta) -> hidden [num_tokens, hidden]``.
        backend: the attention backend (must support CUDA graphs).
        device, dtype: where and in what the body runs.
        hidden_size: width of the body's output.
        max_num_seqs: the largest decode batch (capture sizes follow it).
        max_blocks_per_seq: block-table width of the static buffers; a batch
            with a longer table runs eagerly.
        block_size, num_kv_blocks: the pool's (carried in the static batch).
        use_cuda_graphs: capture graphs (CUDA only); False runs the same static
            path eagerly.

    Raises:
        ValueError: if the backend cannot be captured.
    """

    def __init__(
        self,
        body: Body,
        backend: AttentionBackend,
        *,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        num_kv_blocks: int,
        use_cuda_graphs: bool,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot be captured")
        self.body, self.backend, self.device = body, backend, device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size, self.num_kv_blocks = block_size, num_kv_blocks
        max_bs = self.sizes[-1]
        self._flat = self._static_fields(max_bs)
        self._tables = torch.zeros((max_bs, max_blocks_per_seq), dtype=torch.long, device=device)
        self._out = torch.zeros((max_bs, hidden_size), dtype=dtype, device=device)
        self._captured: dict[int, _Captured] = {}
        self.capture_s = 0.0

    # ------------------------------------------------------------- public
    def padded_size(self, num_seqs: int, max_blocks: int) -> int | None:
        """The captured size a decode batch runs at, or None (run it eagerly)."""
        if max_blocks > self.max_blocks_per_seq:
            return None
        return padded_size(num_seqs, self.sizes)

    def capture(self, sizes: Sequence[int] | None = None) -> float:
        """Warm up and capture ``sizes`` (default: every capture size), largest
        first; returns the seconds spent (also in :attr:`capture_s`). Eager mode
        only warms up and builds metadata.

        Raises:
            ValueError: on a size that is not a capture size.
        """
        todo = self.sizes if sizes is None else sorted(sizes)
        if not set(todo) <= set(self.sizes):
            raise ValueError(f"sizes {list(todo)} are not all capture sizes {self.sizes}")
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for bs in reversed(todo):
            self._captured[bs] = self._capture_one(bs, pool)
        if self.use_cuda_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        return self.capture_s

    @property
    def captured_sizes(self) -> list[int]:
        """Sizes captured so far, ascending."""
        return sorted(self._captured)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Run a decode batch already padded to a captured size.

        Returns:
            hidden states ``[batch.num_seqs, hidden]`` (a view of a static buffer,
            valid until the next run).

        Raises:
            ValueError: if ``batch.num_seqs`` is not a captured size.
        """
        bs = batch.num_seqs
        captured = self._captured.get(bs)
        if captured is None:
            if bs not in self.sizes:
                raise ValueError(f"decode batch of {bs} is not a capture size {self.sizes}")
            batch_views = self._static_batch(bs)  # not captured: same path, eagerly
            meta = self.backend.build_metadata(batch_views)
            captured = self._captured[bs] = _Captured(None, meta, batch_views)
        self._load(batch)
        if captured.graph is not None:
            captured.graph.replay()
        else:
            self._out[:bs].copy_(self.body(captured.batch, captured.meta))
        return self._out[:bs]

    # ------------------------------------------------------------ private
    def _capture_one(self, bs: int, pool: Any) -> _Captured:
        """Metadata, one eager warm-up run (compiles the kernels outside the
        capture), then the capture itself when graphs are on."""
        batch = self._static_batch(bs)
        meta = self.backend.build_metadata(batch)
        self._out[:bs].copy_(self.body(batch, meta))
        if not self.use_cuda_graphs or pool is None:
            return _Captured(None, meta, batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._out[:bs].copy_(self.body(batch, meta))
        return _Captured(graph, meta, batch)

    def _load(self, batch: StepBatch) -> None:
        """Copy a padded batch into the static buffers (device to device)."""
        for name, values in batch.flat_fields().items():
            self._flat[name][: values.numel()].copy_(values)
        width = batch.block_tables.shape[1]
        self._tables[: batch.num_seqs, :width].copy_(batch.block_tables)

    def _static_fields(self, max_bs: int) -> dict[str, torch.Tensor]:
        """Static 1-d buffers holding an all-padding batch of ``max_bs`` rows, so a
        warm-up or capture run writes no cache slot and reads no key."""
        rows = np.arange(max_bs + 1, dtype=np.int64)
        values = {
            "token_ids": np.zeros(max_bs, np.int64),
            "positions": np.zeros(max_bs, np.int64),
            "slot_mapping": np.full(max_bs, PAD_SLOT, np.int64),
            "query_start_loc": rows,
            "seq_lens": np.zeros(max_bs, np.int64),
            "last_token_indices": rows[:-1].copy(),
            **self.backend.host_fields(np.ones(max_bs, np.int64), 1),
        }
        return {name: torch.from_numpy(a).to(self.device) for name, a in values.items()}

    def _static_batch(self, bs: int) -> StepBatch:
        """A :class:`StepBatch` of views of the static buffers for ``bs`` rows."""
        ones = np.ones(bs, np.int64)
        extra_lens = {n: len(a) for n, a in self.backend.host_fields(ones, 1).items()}
        flat = self._flat
        host = HostStep(
            ones, np.zeros(bs, np.int64), np.arange(bs + 1), np.zeros((bs, 1), np.int64)
        )
        return StepBatch(
            num_tokens=bs,
            num_seqs=bs,
            num_real_seqs=bs,
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq * self.block_size,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            token_ids=flat["token_ids"][:bs],
            positions=flat["positions"][:bs],
            slot_mapping=flat["slot_mapping"][:bs],
            query_start_loc=flat["query_start_loc"][: bs + 1],
            seq_lens=flat["seq_lens"][:bs],
            last_token_indices=flat["last_token_indices"][:bs],
            block_tables=self._tables[:bs],
            host=host,
            extra={name: flat[name][:n] for name, n in extra_lens.items()},
        )
