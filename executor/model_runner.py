"""The model runner: tensors in, tokens out, over a paged KV cache.

Per iteration the engine hands the runner one :class:`SeqInput` per scheduled
sequence (prefills and decodes alike); :meth:`ModelRunner.forward` packs all
their new tokens into one ``[num_tokens, ...]`` batch (varlen, no padding),
runs every layer once, and returns the logits of each sequence's last token.

KV cache layout (vLLM's): per layer, K and V are ``[num_blocks, block_size,
num_kv_heads, head_dim]``. The scheduler's ``BlockManager`` owns the block ids;
position ``p`` of a sequence lives in slot ``block_table[p // block_size] *
block_size + p % block_size`` of the flat ``[num_blocks * block_size, ...]``
view. Each layer first writes the K/V of *all* new tokens by slot mapping and
only then attends: two sequences admitted in one step may share prefix blocks
that the first writes in this very forward while the second reads them as its
cached prefix.

Attention backends:

* ``sdpa`` (any device): ``torch.nn.functional.scaled_dot_product_attention``.
  Each prefill attends alone over its gathered context (causal, offset by its
  cached prefix); all single-token queries (decodes) go in one call over
  contexts padded to the longest, with a padding mask.
* ``flash_attn`` (CUDA): one ``flash_attn_varlen_func`` call per layer reading
  the paged cache through a block table. flash-attn 2 requires a page size that
  is a multiple of 256, so ``auto`` picks it only for CUDA, fp16/bf16 and
  ``block_size % 256 == 0``; otherwise ``sdpa``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.request import SamplingParams

from .models import ModelAdapter, make_adapter
from .sampler import sample as sample_tokens

ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn")
# NOTE: SDPA grew ``enable_gqa`` in torch 2.5; before, K/V heads are repeated.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


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
class _Prefill:
    """A sequence with more than one query token (attended alone under SDPA)."""

    seq_idx: int
    query_start: int  # index of its first token in the packed batch
    num_query_tokens: int
    context_len: int  # start_pos + num_query_tokens
    mask: torch.Tensor | None  # [num_query, context] bool (True = attend); None = plain causal


@dataclass(slots=True)
class _DecodeGroup:
    """One SDPA call over decodes of similar context length.

    Attributes:
        token_indices: ``[n]`` packed index of each one-token query.
        slots: ``[n, max_context]`` slot of each context position (padding points
            at valid slots and is masked out).
        mask: ``[n, 1, 1, max_context]`` bool, True = attend.
    """

    token_indices: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class BatchMetadata:
    """Device tensors describing one packed batch (shared by all layers).

    Attributes:
        token_ids, positions, slot_mapping: ``[num_tokens]`` int64.
        last_token_indices: ``[num_seqs]`` int64, each sequence's last packed token.
        block_tables: ``[num_seqs, max_blocks]`` int64, padded with block 0.
        context_lens: context length (tokens) per sequence, on the host.
        prefills: sequences with several query tokens.
        decode_groups: one-token queries grouped by similar context length, so the
            padded context gather of each group wastes little (see ``_DecodeGroup``).
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
    prefills: list[_Prefill] = field(default_factory=list)
    decode_groups: list[_DecodeGroup] = field(default_factory=list)
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
        attention_backend: ``auto``, ``sdpa`` or ``flash_attn`` (see module doc).
            An explicit ``flash_attn`` is used whatever the block size; the
            kernel itself rejects page sizes it does not support.

    Raises:
        ValueError: on an unsupported model type, non-positive pool sizes, an
            unknown backend, or ``flash_attn`` asked for but not importable.
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
    ) -> None:
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_kv_blocks > 0 and block_size > 0, got {num_kv_blocks}, {block_size}"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = model.config
        self.adapter: ModelAdapter = make_adapter(self.model)
        self.shape = self.adapter.shape
        self.kv_cache = self._allocate_kv_cache()
        self.attention_backend = _choose_backend(attention_backend, self.device, dtype, block_size)
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

    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer K cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv_cache[layer_idx, 0]

    def v_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer V cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv_cache[layer_idx, 1]

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """One forward over all ``seqs``, writing their new K/V into the cache.

        Returns:
            logits of the last token of each sequence, ``[len(seqs), vocab]``
            float32, on ``self.device``, in the order of ``seqs``.

        Raises:
            ValueError: on an empty batch or sequence, a block table too short
                for its context, a block id outside the pool, or a context
                longer than the model allows (GPT-2 positions, sliding window).
        """
        meta = self.prepare(seqs)
        adapter = self.adapter
        hidden = adapter.embed(meta.token_ids, meta.positions)
        pos_ctx = adapter.position_context(meta.positions, hidden.dtype)
        for layer_idx in range(self.shape.num_layers):
            q, k, v = adapter.qkv(layer_idx, hidden, pos_ctx)
            self._write_kv(layer_idx, k, v, meta.slot_mapping)
            attn = self._attend(layer_idx, q, meta)
            hidden = adapter.finish_layer(layer_idx, hidden, attn.flatten(1))
        last = hidden.index_select(0, meta.last_token_indices)
        return adapter.logits(last).float()

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
        """Validate ``seqs`` and build the batch's device tensors (one host pass).

        Raises:
            ValueError: as :meth:`forward`.
        """
        host = _HostBatch.build(
            seqs, self.block_size, self.num_kv_blocks, self.shape.max_context_tokens
        )
        meta = host.to_device(self.device, self.block_size)
        if self.attention_backend == "flash_attn":
            host.add_flash_tensors(meta, self.device)
        else:
            host.add_sdpa_tensors(meta, self.device, self.block_size)
        return meta

    # ------------------------------------------------------------ private
    def _allocate_kv_cache(self) -> torch.Tensor:
        """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` zeros.

        NOTE: zeros, not empty: padded context slots are masked to weight 0, and
        0 * NaN from uninitialised memory would still poison the output.
        """
        s = self.shape
        dims = (s.num_layers, 2, self.num_kv_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return torch.zeros(dims, dtype=self.dtype, device=self.device)

    def _write_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Store ``[num_tokens, num_kv_heads, head_dim]`` K/V at their slots."""
        heads = (-1, self.shape.num_kv_heads, self.shape.head_dim)
        self.k_cache(layer_idx).view(heads).index_copy_(0, slots, k)
        self.v_cache(layer_idx).view(heads).index_copy_(0, slots, v)

    def _attend(self, layer_idx: int, q: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Queries ``[num_tokens, num_heads, head_dim]`` -> outputs of the same shape."""
        scale = self.adapter.attn_scale(layer_idx)
        k_cache, v_cache = self.k_cache(layer_idx), self.v_cache(layer_idx)
        if self._flash_varlen is not None:
            return _flash_attention(self._flash_varlen, q, k_cache, v_cache, meta, scale)
        return _sdpa_attention(q, k_cache, v_cache, meta, scale)


# ------------------------------------------------------------------ metadata


@dataclass(slots=True)
class _HostBatch:
    """The batch as host lists, before one copy of each to the device."""

    token_ids: list[int]
    positions: list[int]
    seq_of_token: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]  # each cut to the blocks its context needs

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        block_size: int,
        num_kv_blocks: int,
        max_context_tokens: int | None,
    ) -> _HostBatch:
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        batch = cls([], [], [], [], [], [])
        for seq_idx, seq in enumerate(seqs):
            batch._add(seq_idx, seq, block_size, num_kv_blocks, max_context_tokens)
        return batch

    def _add(
        self, seq_idx: int, seq: SeqInput, block_size: int, num_kv_blocks: int, max_ctx: int | None
    ):
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
        table = list(seq.block_table[:num_blocks])
        if min(table) < 0 or max(table) >= num_kv_blocks:
            raise ValueError(f"sequence {seq_idx}: block ids {table} outside [0, {num_kv_blocks})")
        if max_ctx is not None and context_len > max_ctx:
            raise ValueError(
                f"sequence {seq_idx}: context {context_len} exceeds the model's {max_ctx} tokens"
            )
        self.token_ids.extend(seq.token_ids)
        self.positions.extend(range(start, context_len))
        self.seq_of_token.extend([seq_idx] * num_query)
        self.query_lens.append(num_query)
        self.context_lens.append(context_len)
        self.block_tables.append(table)

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
            max_query_len=max(self.query_lens),
        )

    def add_sdpa_tensors(self, meta: BatchMetadata, device: torch.device, block_size: int) -> None:
        """Split into prefills (own causal mask) and one padded decode group."""
        starts = _prefix_sums(self.query_lens)
        decode_rows = [i for i, n in enumerate(self.query_lens) if n == 1]
        for seq_idx, num_query in enumerate(self.query_lens):
            if num_query > 1:
                ctx = self.context_lens[seq_idx]
                mask = None if ctx == num_query else _offset_causal_mask(num_query, ctx, device)
                meta.prefills.append(_Prefill(seq_idx, starts[seq_idx], num_query, ctx, mask))
        if decode_rows:
            _add_decode_tensors(
                meta, decode_rows, [starts[i] for i in decode_rows], device, block_size
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


MAX_DECODE_PADDING = 1.5  # a decode group's longest context vs its shortest


def _add_decode_tensors(
    meta: BatchMetadata,
    rows: list[int],
    token_indices: list[int],
    device: torch.device,
    block_size: int,
) -> None:
    """Group the decodes by context length (sorted, a new group once the longest
    would exceed ``MAX_DECODE_PADDING`` x the shortest) so the padded gather of
    each group reads little more than its real contexts."""
    order = sorted(range(len(rows)), key=lambda j: meta.context_lens[rows[j]])
    group: list[int] = []
    for j in order:
        if (
            group
            and meta.context_lens[rows[j]] > MAX_DECODE_PADDING * meta.context_lens[rows[group[0]]]
        ):
            meta.decode_groups.append(
                _decode_group(meta, rows, token_indices, group, device, block_size)
            )
            group = []
        group.append(j)
    meta.decode_groups.append(_decode_group(meta, rows, token_indices, group, device, block_size))


def _decode_group(
    meta: BatchMetadata,
    rows: list[int],
    token_indices: list[int],
    members: list[int],
    device: torch.device,
    block_size: int,
) -> _DecodeGroup:
    """Context slots ``[n, max_ctx]`` and padding mask of one decode group."""
    context_lens = [meta.context_lens[rows[j]] for j in members]
    max_ctx = max(context_lens)
    offsets = torch.arange(max_ctx, device=device)
    seq_rows = torch.tensor([rows[j] for j in members], dtype=torch.long, device=device)
    tables = meta.block_tables[seq_rows]
    # Padded offsets read block 0 (padding of the table) or a real block: valid slots, masked.
    block_ids = tables[:, (offsets // block_size).clamp_max(tables.shape[1] - 1)]
    lens = torch.tensor(context_lens, device=device)
    return _DecodeGroup(
        token_indices=torch.tensor(
            [token_indices[j] for j in members], dtype=torch.long, device=device
        ),
        slots=block_ids * block_size + offsets % block_size,
        mask=(offsets[None, :] < lens[:, None])[:, None, None, :],
    )


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


# ----------------------------------------------------------------- attention


def _sdpa_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMetadata, scale: float
) -> torch.Tensor:
    """SDPA over the paged cache: a call per prefill, one for all decodes.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    k_flat = k_cache.flatten(0, 1)  # [num_slots, num_kv_heads, head_dim]
    v_flat = v_cache.flatten(0, 1)
    for p in meta.prefills:
        blocks = meta.block_tables[p.seq_idx]  # gather whole blocks, then cut
        k = k_cache[blocks].flatten(0, 1)[: p.context_len]
        v = v_cache[blocks].flatten(0, 1)[: p.context_len]
        rows = slice(p.query_start, p.query_start + p.num_query_tokens)
        out[rows] = _sdpa(q[rows].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), p.mask, scale)[0]
    for group in meta.decode_groups:
        q_dec = q.index_select(0, group.token_indices).unsqueeze(1)  # [B, 1, H, D]
        k, v = k_flat[group.slots], v_flat[group.slots]  # [B, ctx, Hkv, D]
        o = _sdpa(q_dec, k, v, group.mask, scale)  # [B, 1, H, D]
        out.index_copy_(0, group.token_indices, o[:, 0])
    return out


def _sdpa(
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


def _flash_attention(
    flash_varlen: Callable,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: BatchMetadata,
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
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=meta.cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=max(meta.context_lens),
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables,
    )


def _choose_backend(
    requested: str, device: torch.device, dtype: torch.dtype, block_size: int
) -> str:
    """Resolve ``auto``; check an explicit ``flash_attn`` is importable."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested == "flash_attn" and _load_flash_varlen() is None:
        raise ValueError("attention_backend='flash_attn' but flash_attn (>= 2.5) is not importable")
    if requested != "auto":
        return requested
    fits = (
        device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and block_size % 256 == 0
    )
    return "flash_attn" if fits and _load_flash_varlen() is not None else "sdpa"


def _load_flash_varlen() -> Callable | None:
    """``flash_attn.flash_attn_varlen_func`` if installed with paged-KV support."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    import inspect

    params = inspect.signature(flash_attn_varlen_func).parameters
    return flash_attn_varlen_func if "block_table" in params else None
