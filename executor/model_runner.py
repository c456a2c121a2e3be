"""The model runner: tensors in, tokens out, over a paged KV cache.

Per iteration the engine hands the runner one :class:`SeqInput` per scheduled
sequence (prefills, prefill chunks and decodes alike); :meth:`ModelRunner.forward`
packs their new tokens into ``[num_tokens, ...]`` batches (varlen, no padding),
runs every layer, and returns the logits of each sequence's last token.

Passes: a step with more than ``max_tokens_per_pass`` new tokens is run as
several passes through the whole model, in sequence order; a sequence that
does not fit what is left of a pass opens the next one, and only one longer
than a whole pass is cut (its later chunk attends over the cached earlier one,
as chunked prefill does). On CPU this keeps GPT-2's ``[tokens, 3072]`` float32
MLP activations under glibc's 32 MB mmap threshold, so they are reused from the
heap instead of being page-faulted in afresh for every layer (W2-32's 8,032
prompt tokens in one step: prefill about 5% faster on 2 cores). Only the last
token of each sequence goes through the LM head.

KV cache layout (vLLM's): per layer, K and V are ``[num_blocks, block_size,
num_kv_heads, head_dim]``. The scheduler's ``BlockManager`` owns the block ids;
position ``p`` of a sequence lives in slot ``block_table[p // block_size] *
block_size + p % block_size`` of the flat ``[num_blocks * block_size, ...]``
view. Each layer first writes the K/V of *all* new tokens by slot mapping and
only then attends: two sequences admitted in one step may share prefix blocks
that the first writes in this very forward while the second reads them as its
cached prefix (passes keep the sequence order, so this still holds).

Attention backends (:mod:`roseinfer.executor.attention`): ``sdpa`` (any
device), ``flex`` (single-token queries read the paged cache in place through a
block mask; needs ``torch.compile``) and ``flash_attn`` (CUDA). ``auto`` picks
``flash_attn`` for CUDA with fp16/bf16 and ``block_size % 256 == 0`` (flash-attn
2's page size rule), ``flex`` on CPU when it compiles here, else ``sdpa``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from roseinfer.request import SamplingParams

from . import attention as attn
from .models import ModelAdapter, make_adapter
from .sampler import sample as sample_tokens

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "flash_attn")
# Tokens per pass through the model on CPU (see the module doc): GPT-2's
# [2048, 3072] float32 MLP activation (25 MB) stays under glibc's 32 MB mmap
# threshold, so it is reused from the heap instead of page-faulted in afresh.
CPU_MAX_TOKENS_PER_PASS = 2048
MAX_DECODE_PADDING = 1.5  # sdpa: a decode group's longest context vs its shortest
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SeqInput:
    """One sequence's share of an iteration.

    Attributes:
        token_ids: tokens to compute this step: a prefill's positions
            ``[start_pos, start_pos + len)``; a decode's single last token.
        start_pos: tokens of this sequence already in the KV cache (a prefix
            cache hit, or earlier steps).
        block_table: KV block ids covering positions ``[0, start_pos +
            len(token_ids))``; extra trailing blocks are ignored.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


@dataclass(slots=True)
class BatchMetadata:
    """Device tensors describing one packed pass (shared by all layers).

    Attributes:
        token_ids, positions, slot_mapping: ``[num_tokens]`` int64.
        last_token_indices: ``[num_seqs]`` int64, each sequence's last packed token.
        block_tables: ``[num_seqs, max_blocks]`` int64, padded with block 0.
        context_lens: context length (tokens) per sequence, on the host.
        attention: prefills, decode groups or the flex decode call (sdpa/flex).
        cu_seqlens_q, cu_seqlens_k: ``[num_seqs + 1]`` int32 prefix sums of query
            and context lengths (flash-attn only; else None).
        max_query_len: longest query (new tokens) of any sequence.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_token_indices: torch.Tensor
    block_tables: torch.Tensor
    context_lens: list[int]
    attention: attn.AttentionMetadata
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_query_len: int = 0


class ModelRunner:
    """Runs a transformers causal LM over a paged KV cache.

    Args:
        model: a ``GPT2LMHeadModel`` or Llama-family ``*ForCausalLM`` (Llama,
            Mistral, Qwen2). It is moved to ``device``/``dtype`` and set to eval.
            Only its weights and leaf modules are used; the attention is ours.
        num_kv_blocks: KV blocks in the pool (the scheduler's ``num_kv_blocks``).
        block_size: tokens per KV block.
        device: where the weights, the cache and all compute live.
        dtype: weight, activation and KV-cache dtype (logits come out float32).
        attention_backend: ``auto``, ``sdpa``, ``flex`` or ``flash_attn`` (see
            module doc). An explicit ``flash_attn`` is used whatever the block
            size; the kernel itself rejects page sizes it does not support.
            ``flex`` is compiled here, at construction (seconds; cached by
            inductor on disk for later processes).
        max_tokens_per_pass: new tokens per pass through the model (see module
            doc); None = :data:`CPU_MAX_TOKENS_PER_PASS` on CPU, unlimited
            elsewhere; 0 = unlimited.
        num_tier_blocks: blocks of a host KV tier (the scheduler's first KV tier;
            0 = none): a host-memory pool with the device pool's layout (pinned
            when the device is CUDA) that :meth:`apply_kv_transfers` copies into
            and out of.

    Raises:
        ValueError: on an unsupported model type, non-positive pool sizes, an
            unknown backend, ``flash_attn`` asked for but not importable, or
            ``flex`` asked for but not compilable here.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        attention_backend: str = "auto",
        max_tokens_per_pass: int | None = None,
        num_tier_blocks: int = 0,
    ) -> None:
        if num_tier_blocks < 0:
            raise ValueError(f"num_tier_blocks must be >= 0, got {num_tier_blocks}")
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_kv_blocks > 0 and block_size > 0, got {num_kv_blocks}, {block_size}"
            )
        if max_tokens_per_pass is not None and max_tokens_per_pass < 0:
            raise ValueError(f"max_tokens_per_pass must be >= 0, got {max_tokens_per_pass}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = model.config
        self.adapter: ModelAdapter = make_adapter(self.model)
        self.shape = self.adapter.shape
        self.kv_cache = self._allocate_kv_cache()
        self.num_tier_blocks = num_tier_blocks
        self.tier_kv_cache = self._allocate_tier_cache() if num_tier_blocks else None
        self._copy_stream = (
            torch.cuda.Stream(self.device)
            if num_tier_blocks and self.device.type == "cuda"
            else None
        )
        if max_tokens_per_pass is None:
            max_tokens_per_pass = CPU_MAX_TOKENS_PER_PASS if self.device.type == "cpu" else 0
        self.max_tokens_per_pass = max_tokens_per_pass
        self.attention_backend = _choose_backend(attention_backend, self.device, dtype, block_size)
        if self.attention_backend == "flex":
            self._check_flex(explicit=attention_backend == "flex")
        self._flash_varlen = (
            _load_flash_varlen() if self.attention_backend == "flash_attn" else None
        )

    # ------------------------------------------------------------- public
    @property
    def vocab_size(self) -> int:
        """Logits width."""
        return self.shape.vocab_size

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole KV pool (all layers, K and V)."""
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def apply_kv_transfers(self, ops: Sequence[tuple[int, int, int, int]]) -> None:
        """Make the block copies the block manager decided for this step, in order,
        before the forward: ``(src_level, src_index, dst_level, dst_index)`` with
        level -1 the device pool and 0 the host tier (slots of
        :attr:`tier_kv_cache`). Consecutive copies between the same two pools go
        as one ``index_select`` + ``index_copy_`` over all layers, K and V, cut where
        a copy reads or writes a block an earlier copy of the batch wrote.

        On CUDA the copies run on a side stream that first waits for the device's
        queued work; host->device copies are asynchronous from pinned memory, the
        device->host ones wait for their data; the device stream waits on an
        event before the forward (vLLM's offloading worker does the same).

        Raises:
            ValueError: on a level other than -1 or 0, or with no host tier.
        """
        if not ops:
            return
        if self.tier_kv_cache is None:
            raise ValueError("KV tier copies asked for but the runner has no host tier")
        stream = self._copy_stream
        if stream is None:
            for src, dst, src_ids, dst_ids in _copy_batches(ops):
                self._copy_blocks(src, dst, src_ids, dst_ids)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for src, dst, src_ids, dst_ids in _copy_batches(ops):
                self._copy_blocks(src, dst, src_ids, dst_ids)
        torch.cuda.current_stream(self.device).wait_event(stream.record_event())

    @torch.inference_mode()
    def _copy_blocks(self, src: int, dst: int, src_ids: list[int], dst_ids: list[int]) -> None:
        pools = {-1: self.kv_cache, 0: self.tier_kv_cache}
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

    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer K cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv_cache[layer_idx, 0]

    def v_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer V cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv_cache[layer_idx, 1]

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """One step over all ``seqs``, writing their new K/V into the cache.

        Returns:
            logits of the last token of each sequence, ``[len(seqs), vocab]``
            float32, on ``self.device``, in the order of ``seqs``.

        Raises:
            ValueError: on an empty batch or sequence, a block table too short
                for its context, a block id outside the pool, or a context
                longer than the model allows (GPT-2 positions, sliding window).
        """
        self._check(seqs)
        passes = split_passes(seqs, self.max_tokens_per_pass)
        try:
            last = [self._run_pass(pieces, emit) for pieces, emit in passes]
        except attn.FlexUnavailable as e:
            # Re-running is safe: the K/V already written are written again, same bits.
            logger.warning("flex attention failed (%s); using sdpa from now on", e)
            self.attention_backend = "sdpa"
            last = [self._run_pass(pieces, emit) for pieces, emit in passes]
        hidden = last[0] if len(last) == 1 else torch.cat(last)
        return self.adapter.logits(hidden).float()

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Pick one token per row of ``logits`` ``[B, vocab]``; see
        :func:`roseinfer.executor.sampler.sample`."""
        return sample_tokens(logits, params, generators)

    def prepare(self, seqs: Sequence[SeqInput]) -> BatchMetadata:
        """Validate ``seqs`` and build one pass's device tensors (one host pass).

        Raises:
            ValueError: as :meth:`forward`.
        """
        self._check(seqs)
        return self._prepare(seqs)

    # ------------------------------------------------------------ private
    def _check(self, seqs: Sequence[SeqInput]) -> None:
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        for seq_idx, seq in enumerate(seqs):
            _check_seq(
                seq_idx, seq, self.block_size, self.num_kv_blocks, self.shape.max_context_tokens
            )

    def _prepare(self, seqs: Sequence[SeqInput]) -> BatchMetadata:
        host = _HostBatch.build(seqs, self.block_size)
        meta = host.to_device(self.device, self.block_size)
        if self.attention_backend == "flash_attn":
            host.add_flash_tensors(meta, self.device)
        else:
            host.add_attention(
                meta,
                self.device,
                self.block_size,
                self.num_kv_blocks,
                flex=self.attention_backend == "flex",
            )
        return meta

    def _run_pass(self, seqs: Sequence[SeqInput], emit: list[bool]) -> torch.Tensor:
        """All layers over one pass; hidden states ``[sum(emit), hidden]`` of the
        last token of each sequence with ``emit`` set."""
        meta = self._prepare(seqs)
        adapter = self.adapter
        hidden = adapter.embed(meta.token_ids, meta.positions)
        pos_ctx = adapter.position_context(meta.positions, hidden.dtype)
        for layer_idx in range(self.shape.num_layers):
            q, k, v = adapter.qkv(layer_idx, hidden, pos_ctx)
            self._write_kv(layer_idx, k, v, meta.slot_mapping)
            out = self._attend(layer_idx, q, k, v, meta)
            hidden = adapter.finish_layer(layer_idx, hidden, out.flatten(1))
        last = meta.last_token_indices
        if not all(emit):
            last = last[torch.tensor(emit, device=last.device)]
        return hidden.index_select(0, last)

    def _allocate_kv_cache(self) -> torch.Tensor:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` zeros.

        NOTE: zeros, not empty: padded context slots are masked to weight 0, and
        0 * NaN from uninitialised memory would still poison the output.
        """
        s = self.shape
        dims = (s.num_layers, 2, self.num_kv_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return torch.zeros(dims, dtype=self.dtype, device=self.device)

    def _allocate_tier_cache(self) -> torch.Tensor:
        """The host tier: the device pool's layout with ``num_tier_blocks`` blocks, in
        host memory (pinned for asynchronous copies when the device is CUDA)."""
        s = self.shape
        dims = (s.num_layers, 2, self.num_tier_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        pin = self.device.type == "cuda"
        return torch.zeros(dims, dtype=self.dtype, device="cpu", pin_memory=pin)

    def _write_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``[num_tokens, num_kv_heads, head_dim]`` K/V at their slots."""
        heads = (-1, self.shape.num_kv_heads, self.shape.head_dim)
        self.k_cache(layer_idx).view(heads).index_copy_(0, slots, k)
        self.v_cache(layer_idx).view(heads).index_copy_(0, slots, v)

    def _attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: BatchMetadata,
    ) -> torch.Tensor:
        """Queries ``[num_tokens, num_heads, head_dim]`` (and this pass's new K/V)
        -> outputs of the same shape as ``q``."""
        scale = self.adapter.attn_scale(layer_idx)
        k_cache, v_cache = self.k_cache(layer_idx), self.v_cache(layer_idx)
        if self._flash_varlen is not None:
            assert meta.cu_seqlens_q is not None and meta.cu_seqlens_k is not None
            return attn.flash_attention(
                self._flash_varlen,
                q,
                k_cache,
                v_cache,
                cu_seqlens_q=meta.cu_seqlens_q,
                cu_seqlens_k=meta.cu_seqlens_k,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=max(meta.context_lens),
                block_tables=meta.block_tables,
                scale=scale,
            )
        out = torch.empty_like(q)
        a = meta.attention
        attn.prefill_attention(out, q, k, v, k_cache, v_cache, meta.block_tables, a.prefills, scale)
        attn.grouped_decode_attention(out, q, k_cache, v_cache, a.decode_groups, scale)
        if a.flex_decodes is not None:
            attn.flex_decode_attention(out, q, k_cache, v_cache, a.flex_decodes, scale)
        return out

    def _check_flex(self, *, explicit: bool) -> None:
        """Compile the flex decode kernel now, on a probe whose row count equals no
        other size (see :func:`~roseinfer.executor.attention.flex_probe_rows`), so
        the first step does not stall; fall back to ``sdpa`` (``auto``) or raise
        (explicit ``flex``) if it does not compile here."""
        s = self.shape
        slots = self.num_kv_blocks * self.block_size
        rows = attn.flex_probe_rows(
            1, s.num_heads, s.num_kv_heads, s.head_dim, self.num_kv_blocks, slots
        )
        probe = [SeqInput([0], i % self.block_size, [0]) for i in range(rows)]
        try:
            self._flex_probe(probe)
        except attn.FlexUnavailable as e:
            if explicit:
                raise ValueError(
                    f"attention_backend='flex' does not compile here ({e}); use 'sdpa'"
                ) from None
            logger.warning("flex attention unavailable (%s); using sdpa", e)
            self.attention_backend = "sdpa"

    @torch.inference_mode()
    def _flex_probe(self, seqs: Sequence[SeqInput]) -> None:
        """Run the decode attention of layer 0 alone on ``seqs`` (single-token
        queries), touching no cache slot: compiles the kernel."""
        meta = self._prepare(seqs)
        s = self.shape
        q = torch.zeros((len(seqs), s.num_heads, s.head_dim), dtype=self.dtype, device=self.device)
        out = torch.empty_like(q)
        assert meta.attention.flex_decodes is not None
        attn.flex_decode_attention(
            out, q, self.k_cache(0), self.v_cache(0), meta.attention.flex_decodes, 1.0
        )


def _check_seq(
    seq_idx: int, seq: SeqInput, block_size: int, num_kv_blocks: int, max_ctx: int | None
) -> None:
    """Raise ValueError naming ``seq_idx`` if ``seq`` cannot run."""
    num_query, start = len(seq.token_ids), seq.start_pos
    context_len = start + num_query
    num_blocks = -(-context_len // block_size)
    if num_query == 0 or start < 0:
        raise ValueError(f"sequence {seq_idx}: needs >= 1 new token and start_pos >= 0")
    if len(seq.block_table) < num_blocks:
        raise ValueError(
            f"sequence {seq_idx}: {context_len} tokens need {num_blocks} blocks of "
            f"{block_size}, block table has {len(seq.block_table)}"
        )
    table = seq.block_table[:num_blocks]
    if min(table) < 0 or max(table) >= num_kv_blocks:
        raise ValueError(
            f"sequence {seq_idx}: block ids {list(table)} outside [0, {num_kv_blocks})"
        )
    if max_ctx is not None and context_len > max_ctx:
        raise ValueError(
            f"sequence {seq_idx}: context {context_len} exceeds the model's {max_ctx} tokens"
        )


def _copy_batches(
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


def split_passes(
    seqs: Sequence[SeqInput], max_tokens: int
) -> list[tuple[list[SeqInput], list[bool]]]:
    """Cut a step into passes of at most ``max_tokens`` new tokens, in order.

    A sequence that does not fit in what is left of a pass opens the next pass
    when it fits in a whole one; a longer one is cut: its first piece ends the
    pass, the rest (``start_pos`` moved on) opens the next.

    Returns:
        per pass, its pieces and, per piece, whether it holds its sequence's
        last token (whose logits the step returns). ``max_tokens = 0``: one pass.
    """
    total = sum(len(s.token_ids) for s in seqs)
    if max_tokens <= 0 or total <= max_tokens:
        return [(list(seqs), [True] * len(seqs))]
    passes: list[tuple[list[SeqInput], list[bool]]] = []
    pieces: list[SeqInput] = []
    emit: list[bool] = []
    room = max_tokens
    for seq in seqs:
        ids, done = seq.token_ids, 0
        if pieces and room < len(ids) <= max_tokens:  # fits a fresh pass whole: no cut
            passes.append((pieces, emit))
            pieces, emit, room = [], [], max_tokens
        while done < len(ids):
            take = min(room, len(ids) - done)
            pieces.append(SeqInput(ids[done : done + take], seq.start_pos + done, seq.block_table))
            done += take
            emit.append(done == len(ids))
            room -= take
            if room == 0:
                passes.append((pieces, emit))
                pieces, emit, room = [], [], max_tokens
    if pieces:
        passes.append((pieces, emit))
    return passes


# ------------------------------------------------------------------ metadata


@dataclass(slots=True)
class _HostBatch:
    """The pass as host lists, before one copy of each to the device."""

    token_ids: list[int]
    positions: list[int]
    seq_of_token: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # each cut to the blocks its context needs

    @classmethod
    def build(cls, seqs: Sequence[SeqInput], block_size: int) -> _HostBatch:
        """Pack checked ``seqs`` (see :func:`_check_seq`)."""
        batch = cls([], [], [], [], [], [])
        for seq_idx, seq in enumerate(seqs):
            num_query, start = len(seq.token_ids), seq.start_pos
            context_len = start + num_query
            batch.token_ids.extend(seq.token_ids)
            batch.positions.extend(range(start, context_len))
            batch.seq_of_token.extend([seq_idx] * num_query)
            batch.query_lens.append(num_query)
            batch.context_lens.append(context_len)
            batch.block_tables.append(list(seq.block_table[: -(-context_len // block_size)]))
        return batch

    def to_device(self, device: torch.device, block_size: int) -> BatchMetadata:
        """The tensors every backend needs; slot mapping computed on the device."""
        max_blocks = max(len(t) for t in self.block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in self.block_tables]
        block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        positions = torch.tensor(self.positions, dtype=torch.long, device=device)
        seq_of_token = torch.tensor(self.seq_of_token, dtype=torch.long, device=device)
        block_ids = block_tables[seq_of_token, positions // block_size]
        ends = _prefix_sums(self.query_lens)[1:]
        return BatchMetadata(
            token_ids=torch.tensor(self.token_ids, dtype=torch.long, device=device),
            positions=positions,
            slot_mapping=block_ids * block_size + positions % block_size,
            last_token_indices=torch.tensor([e - 1 for e in ends], dtype=torch.long, device=device),
            block_tables=block_tables,
            context_lens=self.context_lens,
            attention=attn.AttentionMetadata(),
            max_query_len=max(self.query_lens),
        )

    def add_attention(
        self,
        meta: BatchMetadata,
        device: torch.device,
        block_size: int,
        num_kv_blocks: int,
        *,
        flex: bool,
    ) -> None:
        """Prefills (each its own SDPA call); single-token queries as one flex call
        (``flex``) or as SDPA groups of similar context length."""
        starts = _prefix_sums(self.query_lens)
        decode_rows = [i for i, n in enumerate(self.query_lens) if n == 1]
        for seq_idx, num_query in enumerate(self.query_lens):
            if num_query > 1:
                ctx = self.context_lens[seq_idx]
                mask = None if ctx == num_query else _offset_causal_mask(num_query, ctx, device)
                meta.attention.prefills.append(
                    attn.Prefill(seq_idx, starts[seq_idx], num_query, ctx, mask)
                )
        if not decode_rows:
            return
        if flex:
            meta.attention.flex_decodes = attn.flex_decode_metadata(
                [starts[i] for i in decode_rows],
                [self.block_tables[i] for i in decode_rows],
                [self.context_lens[i] for i in decode_rows],
                num_kv_blocks,
                block_size,
                device,
            )
        else:
            meta.attention.decode_groups = self._decode_groups(
                decode_rows, starts, device, block_size
            )

    def _decode_groups(
        self, rows: list[int], starts: list[int], device: torch.device, block_size: int
    ) -> list[attn.DecodeGroup]:
        """Group the decodes by context length (sorted, a new group once the longest
        would exceed ``MAX_DECODE_PADDING`` x the shortest) so the padded gather of
        each group reads little more than its real contexts."""
        order = sorted(rows, key=lambda i: self.context_lens[i])
        groups: list[list[int]] = [[]]
        for i in order:
            if (
                groups[-1]
                and self.context_lens[i] > MAX_DECODE_PADDING * self.context_lens[groups[-1][0]]
            ):
                groups.append([])
            groups[-1].append(i)
        return [self._decode_group(g, starts, device, block_size) for g in groups]

    def _decode_group(
        self, members: list[int], starts: list[int], device: torch.device, block_size: int
    ) -> attn.DecodeGroup:
        """Block ids ``[n * max_blocks]`` and padding mask of one decode group."""
        max_blocks = max(len(self.block_tables[i]) for i in members)
        block_ids = [
            b
            for i in members
            for b in self.block_tables[i] + [0] * (max_blocks - len(self.block_tables[i]))
        ]
        lens = torch.tensor([self.context_lens[i] for i in members], device=device)
        offsets = torch.arange(max_blocks * block_size, device=device)
        return attn.DecodeGroup(
            token_indices=torch.tensor(
                [starts[i] for i in members], dtype=torch.long, device=device
            ),
            block_ids=torch.tensor(block_ids, dtype=torch.long, device=device),
            mask=(offsets[None, :] < lens[:, None])[:, None, None, :],
        )

    def add_flash_tensors(self, meta: BatchMetadata, device: torch.device) -> None:
        """Prefix sums for ``flash_attn_varlen_func``; block table as int32."""
        meta.cu_seqlens_q = torch.tensor(
            _prefix_sums(self.query_lens), dtype=torch.int32, device=device
        )
        meta.cu_seqlens_k = torch.tensor(
            _prefix_sums(self.context_lens), dtype=torch.int32, device=device
        )
        meta.block_tables = meta.block_tables.to(torch.int32)


def _offset_causal_mask(num_query: int, context_len: int, device: torch.device) -> torch.Tensor:
    """``[num_query, context_len]`` bool: query i (position ``context_len -
    num_query + i``) sees keys at positions up to its own (bottom-right causal)."""
    query_pos = torch.arange(context_len - num_query, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]


def _prefix_sums(lengths: list[int]) -> list[int]:
    """``[0, l0, l0 + l1, ...]`` (``len(lengths) + 1`` entries)."""
    sums = [0]
    for n in lengths:
        sums.append(sums[-1] + n)
    return sums


def _choose_backend(
    requested: str, device: torch.device, dtype: torch.dtype, block_size: int
) -> str:
    """Resolve ``auto``; check an explicit ``flash_attn`` / ``flex`` is importable
    (whether ``flex`` also compiles is checked by the runner)."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested == "flash_attn" and _load_flash_varlen() is None:
        raise ValueError("attention_backend='flash_attn' but flash_attn (>= 2.5) is not importable")
    if requested == "flex" and not attn.flex_available():
        raise ValueError(
            f"attention_backend='flex' needs torch.nn.attention.flex_attention with "
            f"BlockMask.from_kv_blocks (torch {torch.__version__} lacks it); use 'sdpa'"
        )
    if requested != "auto":
        return requested
    fits = (
        device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and block_size % 256 == 0
    )
    if fits and _load_flash_varlen() is not None:
        return "flash_attn"
    return "flex" if device.type == "cpu" and attn.flex_available() else "sdpa"


def _load_flash_varlen() -> Callable | None:
    """``flash_attn.flash_attn_varlen_func`` if installed with paged-KV support."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    import inspect

    params = inspect.signature(flash_attn_varlen_func).parameters
    return flash_attn_varlen_func if "block_table" in params else None
