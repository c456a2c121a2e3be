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
  (:mod:`roseinfer.executor.input_batch`), written into the static buffers and
  replayed; its real rows come back first. The static fields are views of one
  device region with a host mirror (pinned on CUDA): a pass's host arrays are
  written into the mirror and arrive with one host-to-device copy, plus one
  device copy that moves its block table into place (a decode step used to make
  about a dozen; with the decode batch's own host arrays, the runner's host work
  per decode step fell to 0.61-0.95x on the 2-core VM: README, "The host work of
  a decode step").

Mixed and prefill passes stay eager by default (vLLM's ``FULL_DECODE_ONLY``
cudagraph mode). With ``mixed_max_tokens`` (the ``FULL`` mode, as vLLM's) a
pass of prefill tokens with up to that many new tokens is replayed too, from a
graph captured per *token* count (the same capture sizes, from 2): the pass is
padded with one extra sequence that owns the padding tokens and sees no key, its
per-sequence fields fill a prefix of static buffers sized for ``min(tokens,
max_num_seqs) + 1`` sequences, and the attention backend pads its own fields to
a length fixed by the token count
(:meth:`~roseinfer.executor.attn_base.AttentionBackend.graph_host_fields`), so
one launch shape serves every pass of that size. A small prefill on a GPU is
bound by launching its kernels (about 0.3 ms a layer from the host on an H100,
so 10 ms for a 32-layer model whatever its length); replayed, it costs its GPU
time. Whether that pays for the padding is measured, not assumed: the mode is
off unless asked for.

Without CUDA (or with ``use_cuda_graphs=False``) the same object runs the same
static-buffer path eagerly: sizes, padding, buffer copies and per-size metadata
are exercised by the CPU tests; only ``torch.cuda.CUDAGraph`` is left out.
"""

from __future__ import annotations

import bisect
import functools
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from roseinfer.calibration.graph_replay import (
    MAX_GRAPH_BATCH_SIZE,
    cuda_graph_batch_sizes,
    mixed_graph_token_sizes,
)

from .gc_watch import collector_paused
from .input_batch import PAD_SLOT, HostBatch, HostStep, StepBatch, aligned

if TYPE_CHECKING:
    from .attn_base import AttentionBackend

DEFAULT_CAPTURE_LIMIT = MAX_GRAPH_BATCH_SIZE  # 512, vLLM's
Body = Callable[[StepBatch, Any], torch.Tensor]


def capture_sizes(max_num_seqs: int, limit: int = DEFAULT_CAPTURE_LIMIT) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then steps of 8, up to ``max_num_seqs``
    and never past ``limit`` (the one rule: :func:`roseinfer.calibration.graph_replay.
    cuda_graph_batch_sizes`, which the profiler times decodes at and the simulator
    prices graphs by). A larger batch
    runs eagerly.

    Raises:
        ValueError: if ``max_num_seqs`` < 1.
    """
    return list(cuda_graph_batch_sizes(max_num_seqs, limit))


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= ``num_seqs`` (None when larger than all)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class GraphCaptureError(ValueError):
    """CUDA refused to capture one graph (the driver invalidated the capture).

    Seen once on an H100 (2026-11-27, torch 2.11, Triton 3.6): ``--cudagraph-mode
    FULL --max-model-len 8192``, the first process on a fresh machine, while the
    memory planner captured a prefill/mixed pass
    (``benchmarks/gpu/results/h100-2026-11-27d-full/check19-parts/a.txt``). Its
    log shows two CUDA graphs reset during that capture, as many as the planner
    had captured and released before it: under ``FULL`` a released runner sat in
    a reference cycle with its graphs until a collection destroyed them mid-capture.
    Released graphs are now destroyed at once (:meth:`GraphRunner.release`), the
    runner holds no cycle, and captures run with the collector paused (all
    untested on a GPU). A ``ValueError``, so the CLIs print it as one ``error:``
    line naming the flag that avoids it."""

    @classmethod
    def of(cls, mixed: bool, size: int, err: BaseException) -> GraphCaptureError:
        """The error for a pass of ``size`` tokens (``mixed``) or a decode batch of
        ``size`` sequences, quoting the first line of CUDA's ``err``."""
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if mixed:
            what = f"prefill/mixed pass of {size} tokens"
            fix = "--cudagraph-mode FULL_DECODE_ONLY (those passes eager) or --enforce-eager"
        else:
            what, fix = f"decode batch of {size} sequences", "--enforce-eager (no CUDA graphs)"
        return cls(f"capturing the CUDA graph of a {what} failed ({first}); run with {fix}")


@dataclass(slots=True)
class _Captured:
    """One captured size: its graph (None when eager), metadata and input views."""

    graph: Any
    meta: Any
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a family's buffers live and their widths."""

    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    max_blocks_per_seq: int


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture prefill/mixed passes at
    (:func:`~roseinfer.calibration.graph_replay.mixed_graph_token_sizes`)."""
    return list(mixed_graph_token_sizes(max_tokens))


def _mixed_seq_rows(max_num_seqs: int, num_tokens: int) -> int:
    """See :meth:`GraphRunner.mixed_seq_rows`."""
    return min(num_tokens, max_num_seqs) + 1


def _decode_host_fields(backend: Any, num_seqs: int) -> dict[str, np.ndarray]:
    """The backend's fields of an all-padding decode batch of ``num_seqs`` rows
    (one query each, no context)."""
    return backend.host_fields(np.ones(num_seqs, np.int64), 1, np.zeros(num_seqs, np.int64))


def _mixed_host_fields(
    backend: Any, rows_of: Callable[[int], int], num_tokens: int
) -> dict[str, np.ndarray]:
    """The backend's fields of an all-padding mixed pass of ``num_tokens``: every
    sequence empty (so every query block computes nothing)."""
    rows = rows_of(num_tokens)
    return backend.graph_host_fields(np.zeros(rows, np.int64), num_tokens, rows)


class _Family:
    """The static buffers and captured graphs of one kind of pass: decode batches
    keyed by sequences (``mixed`` False), or prefill/mixed passes keyed by tokens.

    Args:
        sizes: the capture sizes (sequences, or tokens).
        fields: the all-padding 1-d static fields of the largest size.
        num_rows: block-table rows of the largest size.
        seq_rows: per size, its sequence count (``size -> rows``).
        field_lens: per size, each backend field's length.
    """

    def __init__(
        self,
        sizes: list[int],
        fields: dict[str, np.ndarray],
        num_rows: int,
        seq_rows: Callable[[int], int],
        field_lens: Callable[[int], dict[str, int]],
        *,
        mixed: bool,
        place: _Place,
    ) -> None:
        self.sizes, self.mixed = sizes, mixed
        self.seq_rows, self.field_lens = seq_rows, field_lens
        device = place.device
        # Every static field is a view of one region, laid out as the host mirror is,
        # with room at its end to stage a block table; a pass then arrives in one copy.
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, a in fields.items():
            if a.dtype != np.int64 or a.ndim != 1:
                raise ValueError(f"static field {name!r} must be 1-d int64, not {a.dtype}")
            self.offsets[name] = (start, a.size)
            start = aligned(start + a.size)
        self.table_start = start
        size = start + num_rows * place.max_blocks_per_seq
        cuda = device.type == "cuda"
        self.mirror = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self.region = self.mirror.to(device) if cuda else self.mirror
        self.copied: torch.cuda.Event | None = None  # the last copy out of the mirror
        for name, (begin, n) in self.offsets.items():
            self.mirror[begin : begin + n] = torch.from_numpy(fields[name])
        if cuda:
            self.region.copy_(self.mirror)
        self.flat = {name: self.region[b : b + n] for name, (b, n) in self.offsets.items()}
        self.tables = torch.zeros(
            (num_rows, place.max_blocks_per_seq), dtype=torch.long, device=device
        )
        self.out = torch.zeros((sizes[-1], place.hidden_size), dtype=place.dtype, device=device)
        self.captured: dict[int, _Captured] = {}

    def static_batch(self, size: int, max_seq_len: int, block_size: int, num_kv_blocks: int):
        """A :class:`StepBatch` of views of the static buffers for ``size``."""
        rows = self.seq_rows(size)
        flat = self.flat
        query_lens = np.ones(rows, np.int64)
        host = HostStep(query_lens, np.zeros(rows, np.int64), np.arange(rows + 1),
                        np.zeros((rows, 1), np.int64))  # fmt: skip
        return StepBatch(
            num_tokens=size,
            num_seqs=rows,
            num_real_seqs=rows,
            max_query_len=MIXED_QUERY_LEN if self.mixed else 1,
            max_seq_len=max_seq_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            token_ids=flat["token_ids"][:size],
            positions=flat["positions"][:size],
            slot_mapping=flat["slot_mapping"][:size],
            query_start_loc=flat["query_start_loc"][: rows + 1],
            seq_lens=flat["seq_lens"][:rows],
            last_token_indices=flat["last_token_indices"][:rows],
            block_tables=self.tables[:rows],
            host=host,
            extra={name: flat[name][:n] for name, n in self.field_lens(size).items()},
        )

    def load(self, batch: HostBatch) -> None:
        """Write a padded pass into the static buffers: its fields and block table
        into the host mirror of the region (pinned on CUDA), one host-to-device copy
        of the region, and the table moved from the region's end into place. On
        CUDA the mirror is rewritten only once its last copy is done (an event,
        long finished by then: the previous step's sampling waited for the device).

        Raises:
            ValueError: on a field the static buffers do not have, or longer.
        """
        if self.copied is not None:
            self.copied.synchronize()
        mirror = self.mirror.numpy()
        offsets = self.offsets
        for name, values in batch.fields.items():
            if name not in offsets:
                raise ValueError(f"the static buffers have no field {name!r}")
            begin, room = offsets[name]
            if values.size > room:
                raise ValueError(f"field {name!r} of {values.size} does not fit the static "
                                 f"buffers ({room})")  # fmt: skip
            mirror[begin : begin + values.size] = values
        tables = batch.host.block_tables
        rows, width = tables.shape
        start, end = self.table_start, self.table_start + rows * width
        mirror[start:end] = tables.reshape(-1)
        if self.region is not self.mirror:
            self.region[:end].copy_(self.mirror[:end], non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.tables[:rows, :width].copy_(self.region[start:end].view(rows, width))


MIXED_QUERY_LEN = 2
"""The ``max_query_len`` a mixed family's static batches carry: any prefill length
below the backend's long-prefill threshold gives the same launch shape."""


class GraphRunner:
    """Runs padded passes through static buffers, replaying CUDA graphs.

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
        mixed_max_tokens: the largest prefill or mixed pass (new tokens) to
            capture and replay, at most the backend's
            :attr:`~roseinfer.executor.attn_base.AttentionBackend.mixed_graph_max_tokens`;
            0: decodes only (the default).

    Raises:
        ValueError: if the backend cannot be captured, or cannot capture mixed
            passes of ``mixed_max_tokens``.
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
        mixed_max_tokens: int = 0,
    ) -> None:
        if not backend.supports_cuda_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot be captured")
        if mixed_max_tokens > backend.mixed_graph_max_tokens:
            raise ValueError(
                f"attention backend {backend.name!r} captures passes of at most "
                f"{backend.mixed_graph_max_tokens} tokens, not {mixed_max_tokens}"
            )
        self.body, self.backend, self.device = body, backend, device
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size, self.num_kv_blocks = block_size, num_kv_blocks
        place = _Place(device, dtype, hidden_size, max_blocks_per_seq)
        sizes = capture_sizes(max_num_seqs)
        self.decode = _Family(
            sizes, self._decode_fields(sizes[-1]), sizes[-1], lambda bs: bs,
            lambda bs: {n: len(a) for n, a in _decode_host_fields(backend, bs).items()},
            mixed=False, place=place,
        )  # fmt: skip
        self.mixed: _Family | None = None
        mixed_sizes = mixed_capture_sizes(mixed_max_tokens)
        if mixed_sizes:
            # NOTE: the family's callables must not hold self: a cycle kept a released
            # runner and its captured graphs alive until a collection destroyed them,
            # which invalidated a later capture it ran into (H100, 2026-11-27)
            rows_of = functools.partial(_mixed_seq_rows, max_num_seqs)
            self.mixed = _Family(
                mixed_sizes, self._mixed_fields(mixed_sizes[-1]), rows_of(mixed_sizes[-1]),
                rows_of,
                lambda t: {n: len(a) for n, a in _mixed_host_fields(backend, rows_of, t).items()},
                mixed=True, place=place,
            )  # fmt: skip
        self.capture_s = 0.0

    # ------------------------------------------------------------- public
    @property
    def sizes(self) -> list[int]:
        """The decode capture sizes (sequences)."""
        return self.decode.sizes

    @property
    def mixed_sizes(self) -> list[int]:
        """The prefill/mixed capture sizes (tokens; empty: decodes only)."""
        return self.mixed.sizes if self.mixed is not None else []

    def mixed_seq_rows(self, num_tokens: int) -> int:
        """Sequence rows of a mixed pass padded to ``num_tokens``: as many as it can
        hold (``min(num_tokens, max_num_seqs)``) plus the padding sequence."""
        return _mixed_seq_rows(self.max_num_seqs, num_tokens)

    def padded_size(self, num_seqs: int, max_blocks: int) -> int | None:
        """The captured size a decode batch runs at, or None (run it eagerly)."""
        if max_blocks > self.max_blocks_per_seq:
            return None
        return padded_size(num_seqs, self.decode.sizes)

    def padded_tokens(self, num_tokens: int, num_seqs: int, max_blocks: int) -> int | None:
        """The captured token count a prefill/mixed pass runs at, or None (eagerly)."""
        if self.mixed is None or max_blocks > self.max_blocks_per_seq:
            return None
        size = padded_size(num_tokens, self.mixed.sizes)
        if size is None or num_seqs + 1 > self.mixed_seq_rows(size):
            return None
        return size

    def graph_host_fields(self, num_tokens: int):
        """The backend's fields of a mixed pass padded to ``num_tokens``, as
        :class:`~roseinfer.executor.input_batch.InputBatch` asks for them."""
        rows = self.mixed_seq_rows(num_tokens)
        backend = self.backend

        def fields(
            query_lens: np.ndarray, max_query_len: int, seq_lens: np.ndarray
        ) -> dict[str, np.ndarray]:
            return backend.graph_host_fields(query_lens, num_tokens, rows)

        return fields

    def capture(
        self, sizes: Sequence[int] | None = None, mixed_sizes: Sequence[int] | None = None
    ) -> float:
        """Warm up and capture ``sizes`` (decode; default: every capture size) and
        ``mixed_sizes`` (tokens; default: every mixed size), largest first; returns
        the seconds spent (also in :attr:`capture_s`). Eager mode only warms up
        and builds metadata.

        Raises:
            ValueError: on a size that is not a capture size.
        """
        todo = self.decode.sizes if sizes is None else sorted(sizes)
        todo_mixed = self.mixed_sizes if mixed_sizes is None else sorted(mixed_sizes)
        if not set(todo) <= set(self.decode.sizes):
            raise ValueError(f"sizes {list(todo)} are not all capture sizes {self.decode.sizes}")
        if not set(todo_mixed) <= set(self.mixed_sizes):
            raise ValueError(
                f"mixed sizes {list(todo_mixed)} are not all capture sizes {self.mixed_sizes}"
            )
        start = time.perf_counter()
        if self.use_cuda_graphs:
            gc.collect()  # NOTE: torch.cuda.graph no longer collects before a capture
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for family, family_sizes in ((self.mixed, todo_mixed), (self.decode, todo)):
            for size in reversed(family_sizes):
                assert family is not None
                family.captured[size] = self._capture_one(family, size, pool)
        if self.use_cuda_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - start
        return self.capture_s

    def release(self) -> None:
        """Destroy every captured graph now (their memory returns to the pool), so none
        is left for a garbage collection to destroy later, perhaps in the middle of
        another capture (CUDA refuses a graph's reset while a stream captures)."""
        for family in (self.decode, self.mixed):
            if family is None:
                continue
            for captured in family.captured.values():
                if captured.graph is not None:
                    captured.graph.reset()
            family.captured.clear()

    @property
    def captured_sizes(self) -> list[int]:
        """Decode sizes captured so far, ascending."""
        return sorted(self.decode.captured)

    @property
    def captured_mixed_sizes(self) -> list[int]:
        """Mixed token counts captured so far, ascending."""
        return sorted(self.mixed.captured) if self.mixed is not None else []

    def run(self, batch: HostBatch) -> torch.Tensor:
        """Run a decode batch already padded to a captured size (its host arrays:
        :meth:`~roseinfer.executor.input_batch.InputBatch.host_batch`).

        Returns:
            hidden states ``[batch.num_seqs, hidden]`` (a view of a static buffer,
            valid until the next run).

        Raises:
            ValueError: if ``batch.num_seqs`` is not a captured size.
        """
        if batch.num_seqs not in self.decode.sizes:
            raise ValueError(
                f"decode batch of {batch.num_seqs} is not a capture size {self.decode.sizes}"
            )
        return self._run(self.decode, batch.num_seqs, batch)

    def run_mixed(self, batch: HostBatch) -> torch.Tensor:
        """Run a prefill/mixed pass already padded to a captured token count
        (:meth:`padded_tokens`, built with :meth:`graph_host_fields`).

        Returns:
            hidden states ``[batch.num_tokens, hidden]`` of every token, padding
            included (a view of a static buffer, valid until the next run).

        Raises:
            ValueError: without mixed graphs, or if ``batch.num_tokens`` is not a
                mixed capture size.
        """
        if self.mixed is None or batch.num_tokens not in self.mixed.sizes:
            raise ValueError(f"a pass of {batch.num_tokens} tokens is not a mixed capture size "
                             f"{self.mixed_sizes}")  # fmt: skip
        return self._run(self.mixed, batch.num_tokens, batch)

    def mixed_last_tokens(self, num_seqs: int) -> torch.Tensor:
        """``[num_seqs]`` device indices of the last token of each of the first
        ``num_seqs`` sequences of the mixed pass last run (a view of a static
        buffer, valid until the next run).

        Raises:
            ValueError: without mixed graphs.
        """
        if self.mixed is None:
            raise ValueError("no mixed graphs: this runner replays decodes only")
        return self.mixed.flat["last_token_indices"][:num_seqs]

    # ------------------------------------------------------------ private
    def _run(self, family: _Family, size: int, batch: HostBatch) -> torch.Tensor:
        captured = family.captured.get(size)
        if captured is None:  # not captured: the same path, eagerly
            views = self._static_batch(family, size)
            captured = family.captured[size] = _Captured(
                None, self.backend.build_metadata(views), views
            )
        family.load(batch)
        if captured.graph is not None:
            captured.graph.replay()
        else:
            family.out[:size].copy_(self.body(captured.batch, captured.meta))
        return family.out[:size]

    def _static_batch(self, family: _Family, size: int) -> StepBatch:
        return family.static_batch(
            size, self.max_blocks_per_seq * self.block_size, self.block_size, self.num_kv_blocks
        )

    def _capture_one(self, family: _Family, size: int, pool: Any) -> _Captured:
        """Metadata, one eager warm-up run (compiles the kernels outside the
        capture), then the capture itself when graphs are on, with the garbage
        collector paused (:func:`~roseinfer.executor.gc_watch.collector_paused`).

        Raises:
            GraphCaptureError: when CUDA refuses the capture (one line naming the
                pass and the flag that avoids it).
        """
        batch = self._static_batch(family, size)
        meta = self.backend.build_metadata(batch)
        family.out[:size].copy_(self.body(batch, meta))
        if not self.use_cuda_graphs or pool is None:
            return _Captured(None, meta, batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with collector_paused(), torch.cuda.graph(graph, pool=pool):
                family.out[:size].copy_(self.body(batch, meta))
        except torch.cuda.OutOfMemoryError:
            raise  # the memory planner names the flags for this one
        except RuntimeError as err:
            raise GraphCaptureError.of(family.mixed, size, err) from err
        return _Captured(graph, meta, batch)

    def _decode_fields(self, max_bs: int) -> dict[str, np.ndarray]:
        """Static 1-d fields holding an all-padding batch of ``max_bs`` rows, so a
        warm-up or capture run writes no cache slot and reads no key."""
        rows = np.arange(max_bs + 1, dtype=np.int64)
        return {
            "token_ids": np.zeros(max_bs, np.int64),
            "positions": np.zeros(max_bs, np.int64),
            "slot_mapping": np.full(max_bs, PAD_SLOT, np.int64),
            "query_start_loc": rows,
            "seq_lens": np.zeros(max_bs, np.int64),
            "last_token_indices": rows[:-1].copy(),
            **_decode_host_fields(self.backend, max_bs),
        }

    def _mixed_fields(self, max_tokens: int) -> dict[str, np.ndarray]:
        """Static 1-d fields of an all-padding mixed pass of ``max_tokens``: no
        slot written, every sequence empty and keyless."""
        rows = self.mixed_seq_rows(max_tokens)
        return {
            "token_ids": np.zeros(max_tokens, np.int64),
            "positions": np.zeros(max_tokens, np.int64),
            "slot_mapping": np.full(max_tokens, PAD_SLOT, np.int64),
            "query_start_loc": np.zeros(rows + 1, np.int64),
            "seq_lens": np.zeros(rows, np.int64),
            "last_token_indices": np.zeros(rows, np.int64),
            **_mixed_host_fields(self.backend, self.mixed_seq_rows, max_tokens),
        }
