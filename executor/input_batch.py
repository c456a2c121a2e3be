"""Input batch: one pass's metadata, built on the host with numpy, sent in one copy.

Per pass the runner turns its sequences into integer arrays (vLLM's names):
token ids, positions, slot mapping (``[num_tokens]``), query start locations
(``[num_seqs + 1]``), sequence lengths (context tokens, ``[num_seqs]``), the
index of each sequence's last token, block tables (``[num_seqs, max_blocks]``,
padded with block 0) and whatever the attention backend adds
(:meth:`~roseinfer.executor.attention.AttentionBackend.host_fields`). They are
written into one persistent host buffer (pinned on CUDA) and copied to one
persistent device buffer with a single asynchronous copy; every field is then a
view of that device buffer. Nothing here waits for the device: on CUDA two
host buffers alternate, and a buffer is rewritten only once the copy that last
read it is done (an event, normally long finished by then). On CPU the host
buffer *is* the device buffer. A pass replayed from a CUDA graph takes neither:
its host arrays (:class:`HostBatch`) are written into the graph runner's static
buffers with one copy (:meth:`~roseinfer.executor.graph_runner.GraphRunner.run`),
where a packed device batch used to be copied field by field into them again
(about a dozen small device copies per decode step).

Every field starts at a multiple of :data:`FIELD_ALIGN` elements (128 bytes).
Triton compiles a kernel once per pattern of 16-byte-aligned pointer arguments;
fields packed end to end start wherever the previous one ended, so each new
mix of field sizes could compile the attention kernels afresh in the middle of
a timed run (on one H200, single-prompt prefill steps of a Llama-3.1-8B fifo
run took 0.6-0.8 s instead of about 15 ms while the disk cache was cold).

A decode batch for a CUDA graph is padded up to its captured size with rows
that compute nothing: token 0 at position 0, slot -1 (the store skips it),
sequence length 0 (attention sees no key). A prefill or mixed pass for a graph
is padded up to its captured token count with the same tokens, all owned by one
extra sequence of length 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .model_runner import SeqInput

PAD_SLOT = -1
_BASE_FIELDS = frozenset(
    ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "last_token_indices")
)  # every pass's one-dimensional fields; the backend's come on top
HostFields = Callable[[np.ndarray, int, np.ndarray], dict[str, np.ndarray]]
FIELD_ALIGN = 16  # int64 elements: every field starts 128-byte aligned (see the module doc)


def aligned(num_elements: int) -> int:
    """``num_elements`` rounded up to a multiple of :data:`FIELD_ALIGN`."""
    return -(-num_elements // FIELD_ALIGN) * FIELD_ALIGN


@dataclass(slots=True)
class HostStep:
    """The host copies of the fields the SDPA paths read per sequence.

    Attributes:
        query_lens, seq_lens: ``[num_seqs]`` int64.
        query_start_loc: ``[num_seqs + 1]`` int64.
        block_tables: ``[num_seqs, max_blocks]`` int64, zero-padded.
    """

    query_lens: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    block_tables: np.ndarray


@dataclass(slots=True)
class StepBatch:
    """One pass's metadata on the device (views of the persistent buffer).

    Attributes:
        num_tokens, num_seqs: sizes (padding included); num_real_seqs: without it.
        max_query_len, max_seq_len: host ints (no device read).
        block_size, num_kv_blocks: the pool's.
        token_ids, positions, slot_mapping: ``[num_tokens]`` int64.
        query_start_loc: ``[num_seqs + 1]``; seq_lens, last_token_indices: ``[num_seqs]``.
        block_tables: ``[num_seqs, max_blocks]`` int64.
        extra: the backend's fields by name.
        host: host copies (see :class:`HostStep`).
    """

    num_tokens: int
    num_seqs: int
    num_real_seqs: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    last_token_indices: torch.Tensor
    block_tables: torch.Tensor
    host: HostStep
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def flat_fields(self) -> dict[str, torch.Tensor]:
        """The one-dimensional fields by name (the graph runner copies these)."""
        return {
            "token_ids": self.token_ids,
            "positions": self.positions,
            "slot_mapping": self.slot_mapping,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "last_token_indices": self.last_token_indices,
            **self.extra,
        }


@dataclass(slots=True)
class HostBatch:
    """One pass's metadata on the host, before any copy: what a CUDA-graph pass
    writes straight into the graph runner's static buffers
    (:meth:`~roseinfer.executor.graph_runner.GraphRunner.run`), where an eager pass
    gets a :class:`StepBatch` of device views (:meth:`InputBatch.build`).

    Attributes:
        fields: the one-dimensional int64 fields by name, the backend's included.
        host: query lengths, sequence lengths, query starts and the block tables
            ``[num_seqs, max_blocks]`` (:class:`HostStep`).
    """

    fields: dict[str, np.ndarray]
    host: HostStep

    @property
    def num_tokens(self) -> int:
        """Tokens of the pass, padding included."""
        return len(self.fields["token_ids"])

    @property
    def num_seqs(self) -> int:
        """Sequences of the pass, padding included."""
        return len(self.host.query_lens)


def used_block_ids(seqs: Sequence[SeqInput], num_blocks: np.ndarray) -> np.ndarray:
    """``[sum(num_blocks)]`` int64: each sequence's first ``num_blocks[i]`` block ids,
    in sequence order. Tables held as ``array('i')`` (the block manager's own,
    ``BlockManager.block_ids``) are joined as bytes and read in one numpy call, with
    no Python int per id and no numpy call per sequence (the per-id reads were the
    largest part of a 256-sequence decode step's host work; ``benchmarks/decode_host.py``).

    Raises:
        ValueError: if a table is shorter than its count (the runner checks first).
    """
    counts = num_blocks.tolist()
    total = sum(counts)
    tables = [s.block_table for s in seqs]
    try:  # array('i') tables, whose bytes are C ints; a list raises TypeError here
        joined = b"".join([t[:k] for t, k in zip(tables, counts)])  # type: ignore[misc]
    except TypeError:
        joined = b""
    if len(joined) == total * np.intc().itemsize:
        return np.frombuffer(joined, np.intc).astype(np.int64)
    # lists, tuples, wider integer arrays, or a short table: one read per table
    parts = [np.asarray(t[:k], np.int64) for t, k in zip(tables, counts)]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if ids.size != total:
        raise ValueError("a block table is shorter than its sequence's blocks")
    return ids


@dataclass(frozen=True, slots=True)
class SeqArrays:
    """What a pass's runner inputs say per sequence, read from them once.

    ``ModelRunner.forward`` reads these while it checks the inputs and hands them
    on, so choosing the CUDA graph and building the batch do not walk the
    sequences again.

    Attributes:
        query_lens: ``[num_seqs]`` int64, new tokens of each sequence.
        starts: ``[num_seqs]`` int64, tokens of each already in the KV cache.
        block_ids: ``[sum(num_blocks)]`` int64, the blocks each uses, in sequence
            order (:func:`used_block_ids`).
    """

    query_lens: np.ndarray
    starts: np.ndarray
    block_ids: np.ndarray

    @property
    def seq_lens(self) -> np.ndarray:
        """``[num_seqs]`` int64: context tokens after the pass."""
        return self.starts + self.query_lens


def seq_lengths(seqs: Sequence[SeqInput]) -> tuple[np.ndarray, np.ndarray]:
    """``(query_lens, starts)``, ``[len(seqs)]`` int64 each."""
    n = len(seqs)
    query_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
    return query_lens, np.fromiter((s.start_pos for s in seqs), np.int64, n)


def seq_arrays(seqs: Sequence[SeqInput], block_size: int) -> SeqArrays:
    """:class:`SeqArrays` of checked runner inputs.

    Raises:
        ValueError: if a block table is shorter than its context needs.
    """
    query_lens, starts = seq_lengths(seqs)
    needed = -(-(starts + query_lens) // block_size)
    return SeqArrays(query_lens, starts, used_block_ids(seqs, needed))


def host_arrays(
    seqs: Sequence[SeqInput],
    block_size: int,
    pad_to: int | None = None,
    pad_tokens_to: int | None = None,
    arrays: SeqArrays | None = None,
) -> tuple[dict[str, np.ndarray], HostStep]:
    """The pass's fields as int64 numpy arrays (see the module doc).

    Args:
        seqs: checked runner inputs (``ModelRunner`` checks them).
        arrays: :func:`seq_arrays` of ``seqs`` when the caller read them already
            (None: read here).
        pad_to: for a decode batch (one token each), the row count to pad to.
        pad_tokens_to: for a prefill or mixed pass (a CUDA graph of this many
            tokens), the token count to pad to: one more sequence owns the
            padding tokens (slot -1, position 0) and has no key (length 0).

    Returns:
        the one-dimensional fields by name, and the :class:`HostStep`.
    """
    if arrays is None:
        arrays = seq_arrays(seqs, block_size)
    num_seqs = len(seqs)
    query_lens, starts = arrays.query_lens, arrays.starts
    if pad_tokens_to is None and bool((query_lens == 1).all()):  # a decode batch
        return _decode_arrays(seqs, block_size, arrays, max(pad_to or 0, num_seqs))
    if pad_to is not None and pad_to > num_seqs:
        raise ValueError("only a decode batch (one token per sequence) is padded")
    seq_lens = arrays.seq_lens
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    token_ids = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in seqs), np.int64, num_tokens
    )
    positions = np.arange(num_tokens, dtype=np.int64)
    positions += np.repeat(starts - query_start_loc[:-1], query_lens)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    num_blocks = -(-seq_lens // block_size)
    block_tables = _block_tables(arrays.block_ids, num_blocks, num_seqs)
    slots = block_tables[seq_of_token, positions // block_size] * block_size
    slots += positions % block_size
    fields = {
        "token_ids": token_ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": seq_lens,
    }
    if pad_tokens_to is not None:
        fields, query_lens, block_tables = _pad_tokens(
            fields, query_lens, block_tables, pad_tokens_to
        )
        query_start_loc = np.append(query_start_loc, pad_tokens_to)
    fields["query_start_loc"] = query_start_loc
    fields["last_token_indices"] = query_start_loc[1:] - 1
    host = HostStep(query_lens, fields["seq_lens"], query_start_loc, block_tables)
    return fields, host


def _block_tables(block_ids: np.ndarray, num_blocks: np.ndarray, rows: int) -> np.ndarray:
    """``[rows, max(num_blocks)]`` int64: the first ``len(num_blocks)`` rows hold each
    sequence's ``block_ids`` (in order, zero-padded), the rest zeros."""
    width = int(num_blocks.max())
    tables = np.zeros((rows, width), np.int64)
    tables[: len(num_blocks)][np.arange(width) < num_blocks[:, None]] = block_ids
    return tables


def _decode_arrays(
    seqs: Sequence[SeqInput], block_size: int, arrays: SeqArrays, rows: int
) -> tuple[dict[str, np.ndarray], HostStep]:
    """:func:`host_arrays` of a decode batch (one token each) padded to ``rows``
    with rows that compute nothing (module doc): each token is its sequence's
    last, in its last used block."""
    num_seqs = len(seqs)
    starts = arrays.starts
    token_ids = np.fromiter((s.token_ids[0] for s in seqs), np.int64, num_seqs)
    num_blocks = starts // block_size + 1
    slots = arrays.block_ids[np.cumsum(num_blocks) - 1] * block_size
    slots += starts % block_size
    positions, seq_lens = starts, starts + 1
    if rows > num_seqs:
        zeros = np.zeros(rows - num_seqs, np.int64)
        token_ids, positions, seq_lens = (
            np.concatenate((a, zeros)) for a in (token_ids, positions, seq_lens)
        )
        slots = np.concatenate((slots, np.full(rows - num_seqs, PAD_SLOT, np.int64)))
    query_start_loc = np.arange(rows + 1, dtype=np.int64)
    fields = {
        "token_ids": token_ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": seq_lens,
        "query_start_loc": query_start_loc,
        "last_token_indices": query_start_loc[:-1],
    }
    tables = _block_tables(arrays.block_ids, num_blocks, rows)
    return fields, HostStep(np.ones(rows, np.int64), seq_lens, query_start_loc, tables)


def _pad_tokens(
    fields: dict[str, np.ndarray], query_lens: np.ndarray, block_tables: np.ndarray, tokens: int
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Append one sequence holding ``tokens - len(token_ids)`` padding tokens
    (token 0, position 0, slot -1) and no key (length 0) (module doc)."""
    num_pad = tokens - len(fields["token_ids"])
    if num_pad < 0:
        raise ValueError(f"a pass of {len(fields['token_ids'])} tokens cannot pad to {tokens}")
    pad_values = {"token_ids": 0, "positions": 0, "slot_mapping": PAD_SLOT}
    padded = {
        name: np.concatenate([a, np.full(num_pad, pad_values[name], np.int64)])
        for name, a in fields.items()
        if name in pad_values
    }
    padded["seq_lens"] = np.append(fields["seq_lens"], 0)
    tables = np.concatenate([block_tables, np.zeros((1, block_tables.shape[1]), np.int64)])
    return padded, np.append(query_lens, num_pad), tables


@dataclass(slots=True)
class _Buffer:
    host: torch.Tensor
    device: torch.Tensor
    copied: torch.cuda.Event | None = None


class InputBatch:
    """Persistent buffers for one pass's metadata (see the module doc).

    Args:
        device: where the model runs.
        block_size: tokens per KV block.
        initial_capacity: int64 elements per buffer at first (grown by doubling).
    """

    def __init__(
        self, device: torch.device, block_size: int, initial_capacity: int = 1 << 14
    ) -> None:
        self.device = device
        self.block_size = block_size
        self._cuda = device.type == "cuda"
        self._buffers = [self._allocate(initial_capacity) for _ in range(2 if self._cuda else 1)]
        self._turn = 0

    def build(
        self,
        seqs: Sequence[SeqInput],
        host_fields: HostFields,
        num_kv_blocks: int,
        pad_to: int | None = None,
        pad_tokens_to: int | None = None,
        arrays: SeqArrays | None = None,
    ) -> StepBatch:
        """The pass's :class:`StepBatch` (one host-to-device copy on CUDA).

        Args:
            seqs: checked runner inputs.
            host_fields: the backend's extra fields (query lens, max query len, sequence
                lens -> arrays).
            num_kv_blocks: blocks in the pool (carried for the backends).
            pad_to: pad a decode batch to this many rows (CUDA graphs).
            pad_tokens_to: pad a prefill or mixed pass to this many tokens, plus
                one padding sequence (CUDA graphs; :func:`host_arrays`).
            arrays: the pass's :func:`seq_arrays`, when already read.
        """
        batch = self.host_batch(seqs, host_fields, pad_to, pad_tokens_to, arrays)
        host = batch.host
        packed = [*batch.fields.items(), ("block_tables", host.block_tables.reshape(-1))]
        views = self._copy(packed)
        num_seqs = batch.num_seqs
        return StepBatch(
            num_tokens=batch.num_tokens,
            num_seqs=num_seqs,
            num_real_seqs=len(seqs),
            max_query_len=int(host.query_lens.max()),
            max_seq_len=int(host.seq_lens.max()),
            block_size=self.block_size,
            num_kv_blocks=num_kv_blocks,
            token_ids=views["token_ids"],
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            last_token_indices=views["last_token_indices"],
            block_tables=views["block_tables"].view(num_seqs, -1),
            host=host,
            extra={name: views[name] for name in batch.fields if name not in _BASE_FIELDS},
        )

    def host_batch(
        self,
        seqs: Sequence[SeqInput],
        host_fields: HostFields,
        pad_to: int | None = None,
        pad_tokens_to: int | None = None,
        arrays: SeqArrays | None = None,
    ) -> HostBatch:
        """The pass's metadata as host arrays, copied nowhere (arguments as
        :meth:`build`'s): a CUDA-graph pass writes them into the static buffers."""
        fields, host = host_arrays(seqs, self.block_size, pad_to, pad_tokens_to, arrays)
        fields.update(host_fields(host.query_lens, int(host.query_lens.max()), host.seq_lens))
        return HostBatch(fields, host)

    def _copy(self, arrays: list[tuple[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Pack ``arrays`` into the next host buffer, each at a multiple of
        :data:`FIELD_ALIGN`, copy it once, return device views."""
        total = sum(aligned(a.size) for _, a in arrays)
        buf = self._next_buffer(total)
        packed = buf.host.numpy()
        offsets, start = {}, 0
        for name, a in arrays:
            packed[start : start + a.size] = a
            offsets[name] = (start, a.size)
            start += aligned(a.size)
        if self._cuda:
            buf.device[:total].copy_(buf.host[:total], non_blocking=True)
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        return {name: buf.device[s : s + n] for name, (s, n) in offsets.items()}

    def _next_buffer(self, num_elements: int) -> _Buffer:
        """The buffer to write now, grown if too small; waits (on CUDA) only for
        the copy that last read it."""
        self._turn = (self._turn + 1) % len(self._buffers)
        buf = self._buffers[self._turn]
        if buf.copied is not None:
            buf.copied.synchronize()
        if buf.host.numel() < num_elements:
            capacity = 1 << max(0, num_elements - 1).bit_length()
            buf = self._buffers[self._turn] = self._allocate(capacity)
        return buf

    def _allocate(self, capacity: int) -> _Buffer:
        host = torch.zeros(capacity, dtype=torch.int64, pin_memory=self._cuda)
        device = (
            torch.zeros(capacity, dtype=torch.int64, device=self.device) if self._cuda else host
        )
        return _Buffer(host, device)
