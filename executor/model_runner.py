"""The model runner: tensors in, tokens out, over a paged KV cache.

Per iteration the engine hands the runner one :class:`SeqInput` per scheduled
sequence (prefills, prefill chunks and decodes alike); :meth:`ModelRunner.forward`
packs their new tokens into ``[num_tokens, ...]`` batches (varlen, no padding),
runs every layer, and returns the logits of each sequence's last token.

Its parts, one file each:

* the attention backend (:mod:`~roseinfer.executor.attention`): an object chosen
  once (``sdpa``, ``flex``, ``triton``, ``flash_attn``), called by every layer;
* the KV cache (:mod:`~roseinfer.executor.kv_cache`): the pool, the host tier
  and the copies between them;
* the input batch (:mod:`~roseinfer.executor.input_batch`): each pass's
  metadata built with numpy in persistent buffers and sent in one copy;
* the graph runner (:mod:`~roseinfer.executor.graph_runner`): decode passes
  replayed from CUDA graphs (:meth:`ModelRunner.capture_cuda_graphs`).

Passes: a step with more than ``max_tokens_per_pass`` new tokens is run as
several passes through the whole model, in sequence order; a sequence that
does not fit what is left of a pass opens the next one, and only one longer
than a whole pass is cut (its later chunk attends over the cached earlier one,
as chunked prefill does). On CUDA this bounds a step's activations by what the
memory planner profiled (:mod:`~roseinfer.executor.memory`), so no step can run
out of memory however many tokens a policy packs. On CPU it keeps GPT-2's
``[tokens, 3072]`` float32 MLP activations under glibc's 32 MB mmap threshold,
so they are reused from the heap instead of being page-faulted in afresh for
every layer (W2-32's 8,032 prompt tokens in one step: prefill about 5% faster
on 2 cores). Only the last token of each sequence goes through the LM head.

Each layer first writes the K/V of *all* new tokens by slot mapping and only
then attends: two sequences admitted in one step may share prefix blocks that
the first writes in this very forward while the second reads them as its
cached prefix (passes keep the sequence order, so this still holds).

Nothing in the layer loop reads the device: every launch parameter comes from
host integers the input batch computed with numpy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from roseinfer.calibration.graph_replay import CUDAGRAPH_MODES, DEFAULT_CUDAGRAPH_MODE
from roseinfer.request import SamplingParams

from . import attention as attn
from .adapters import ModelAdapter
from .attention import ATTENTION_BACKENDS
from .attn_base import AttentionBackend, BackendUnavailable
from .graph_runner import GraphRunner
from .input_batch import InputBatch, SeqArrays, StepBatch, seq_arrays, seq_lengths, used_block_ids
from .kv_cache import KVCache, block_bytes
from .kv_cache import copy_batches as _copy_batches  # noqa: F401 - re-exported for tests
from .models import make_adapter
from .sampler import sample as sample_tokens
from .tune_cache import load_tuned, store_tuned, tune_cache_path, tune_key

__all__ = ["ATTENTION_BACKENDS", "ModelRunner", "SeqInput", "split_passes"]

# Tokens per pass through the model on CPU (see the module doc): GPT-2's
# [2048, 3072] float32 MLP activation (25 MB) stays under glibc's 32 MB mmap
# threshold, so it is reused from the heap instead of page-faulted in afresh.
CPU_MAX_TOKENS_PER_PASS = 2048
# Tokens per pass on CUDA unless the memory planner says otherwise: vLLM's default
# max_num_batched_tokens for online serving on GPUs of >= 70 GiB (vllm/engine/
# arg_utils.py, EngineArgs.get_batch_defaults).
CUDA_MAX_TOKENS_PER_PASS = 8192
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqInput:
    """One sequence's share of an iteration (not frozen: a frozen dataclass takes
    about twice as long to build, and a decode step builds one per sequence).

    Attributes:
        token_ids: tokens to compute this step: a prefill's positions
            ``[start_pos, start_pos + len)``; a decode's single last token.
        start_pos: tokens of this sequence already in the KV cache (a prefix
            cache hit, or earlier steps).
        block_table: KV block ids covering positions ``[0, start_pos +
            len(token_ids))``; extra trailing blocks are ignored. A list, or the
            block manager's own ``array('i')`` (``BlockManager.block_ids``, read
            through its buffer during :meth:`ModelRunner.forward`).
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


class ModelRunner:
    """Runs a transformers causal LM over a paged KV cache.

    Args:
        model: a ``GPT2LMHeadModel`` or Llama-family ``*ForCausalLM`` (Llama,
            Mistral, Qwen2). It is moved to ``device``/``dtype`` and set to eval.
            Only its weights and leaf modules are used; the attention is ours.
        num_kv_blocks: KV blocks in the pool (the scheduler's ``num_kv_blocks``);
            :meth:`allocate_kv_cache` changes it later (the memory planner does).
        block_size: tokens per KV block.
        device: where the weights, the cache and all compute live.
        dtype: weight, activation and KV-cache dtype (logits come out float32).
        attention_backend: ``auto``, ``sdpa``, ``flex``, ``triton`` or
            ``flash_attn`` (see :mod:`~roseinfer.executor.attention`). ``flex``
            is compiled here, at construction (seconds; cached by inductor on
            disk for later processes); ``triton`` on CUDA runs a probe launch.
        max_tokens_per_pass: new tokens per pass through the model (see module
            doc); None = :data:`CPU_MAX_TOKENS_PER_PASS` on CPU,
            :data:`CUDA_MAX_TOKENS_PER_PASS` on CUDA; 0 = unlimited.
        num_tier_blocks: blocks of a host KV tier (the scheduler's first KV tier;
            0 = none): a host-memory pool with the device pool's layout (pinned
            when the device is CUDA) that :meth:`apply_kv_transfers` copies into
            and out of.
        enforce_eager: never capture CUDA graphs (vLLM's ``--enforce-eager``).
        cudagraph_mode: which passes replay CUDA graphs (vLLM's names):
            ``FULL_DECODE_ONLY`` (default) decode batches; ``FULL`` also prefill
            and mixed passes of up to :attr:`mixed_graph_max_tokens` new tokens
            (see :mod:`~roseinfer.executor.graph_runner`).
        adapter: ``make_adapter(model)`` already built on ``model`` where it is
            (on ``device`` in ``dtype``), so a run builds it once; None builds it.

    Raises:
        ValueError: on an unsupported model type, non-positive pool sizes, an
            unknown backend, or an explicit backend that cannot run here
            (``flash_attn`` not importable, ``flex`` on CUDA or not compilable,
            ``triton`` not installed or failing its probe), or an ``adapter``
            given with a model not yet on ``device`` in ``dtype``.
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
        enforce_eager: bool = False,
        adapter: ModelAdapter | None = None,
        cudagraph_mode: str = DEFAULT_CUDAGRAPH_MODE,
    ) -> None:
        if max_tokens_per_pass is not None and max_tokens_per_pass < 0:
            raise ValueError(f"max_tokens_per_pass must be >= 0, got {max_tokens_per_pass}")
        if cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(
                f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}, got {cudagraph_mode!r}"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        if adapter is not None and not _placed(model, self.device, dtype):
            # NOTE: moving the model replaces tensors the adapter holds (RoPE's inv_freq)
            raise ValueError("an adapter needs its model on the runner's device and dtype first")
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.config = model.config
        self.adapter: ModelAdapter = adapter if adapter is not None else make_adapter(self.model)
        self.shape = self.adapter.shape
        self.kv = KVCache(
            self.shape, num_blocks=num_kv_blocks, block_size=block_size, dtype=dtype,
            device=self.device, num_tier_blocks=num_tier_blocks,
        )  # fmt: skip
        if max_tokens_per_pass is None:
            cpu = self.device.type == "cpu"
            max_tokens_per_pass = CPU_MAX_TOKENS_PER_PASS if cpu else CUDA_MAX_TOKENS_PER_PASS
        self.max_tokens_per_pass = max_tokens_per_pass
        self.enforce_eager = enforce_eager
        self.cudagraph_mode = cudagraph_mode
        self.input_batch = InputBatch(self.device, block_size)
        self.graphs: GraphRunner | None = None
        self.cuda_graph_capture_s = 0.0
        self.attention_tune_s = 0.0
        self.attention_tune_source = "none"  # where the attention launches came from
        self._tuned_key: str | None = None  # the tune cache key of the launches held
        self.host_times_s: list[float] | None = None
        self.backend = self._choose_backend(attention_backend)

    # ------------------------------------------------------------- public
    @property
    def attention_backend(self) -> str:
        """The backend in use (``auto`` resolved)."""
        return self.backend.name

    @property
    def vocab_size(self) -> int:
        """Logits width."""
        return self.shape.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks in the device pool."""
        return self.kv.num_blocks

    @property
    def num_tier_blocks(self) -> int:
        """Blocks of the host tier (0 = none)."""
        return self.kv.num_tier_blocks

    @property
    def kv_cache(self) -> torch.Tensor:
        """The pool ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.kv.pool

    @property
    def tier_kv_cache(self) -> torch.Tensor | None:
        """The host tier (the pool's layout), or None."""
        return self.kv.tier

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of the whole KV pool (all layers, K and V)."""
        return self.kv.num_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block (all layers, K and V)."""
        return block_bytes(self.shape, self.block_size, self.dtype)

    def k_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer K cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv.k(layer_idx)

    def v_cache(self, layer_idx: int) -> torch.Tensor:
        """Layer V cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a view)."""
        return self.kv.v(layer_idx)

    def apply_kv_transfers(self, ops: Sequence[tuple[int, int, int, int]]) -> None:
        """Block copies between the pool and the host tier; see
        :meth:`roseinfer.executor.kv_cache.KVCache.apply_transfers`."""
        self.kv.apply_transfers(ops)

    def allocate_kv_cache(self, num_kv_blocks: int) -> None:
        """Re-allocate the pool with ``num_kv_blocks`` (zeroed; contents lost).
        Captured CUDA graphs read the old pool, so they are dropped: capture again.

        Raises:
            ValueError: if ``num_kv_blocks`` < 1.
        """
        self.release_cuda_graphs()
        self.kv.reallocate(num_kv_blocks)

    @property
    def cuda_graphs_possible(self) -> bool:
        """Whether :meth:`capture_cuda_graphs` would capture (or, off CUDA, set up
        the static decode path): not eager, and a backend that supports graphs."""
        return not self.enforce_eager and self.backend.supports_cuda_graphs

    def capture_cuda_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        sizes: Sequence[int] | None = None,
        mixed_sizes: Sequence[int] | None = None,
    ) -> float:
        """Capture the decode body at every capture size up to ``max_num_seqs``
        (see :mod:`~roseinfer.executor.graph_runner`); decode passes then replay
        them. Off CUDA (the Triton interpreter) the same static path runs eagerly.

        Args:
            max_num_seqs: the largest decode batch.
            max_model_len: the longest sequence (sizes the static block tables).
            sizes: capture only these capture sizes (the memory planner measures
                two); a decode batch of another size runs the same static path
                eagerly.
            mixed_sizes: the same for prefill/mixed passes (token counts), with
                ``cudagraph_mode`` ``FULL`` (default: all of them, or none when
                ``sizes`` is given).

        Returns:
            seconds spent (also :attr:`cuda_graph_capture_s`); 0.0 when graphs
            are off (``enforce_eager``, or a backend without graph support).
        """
        self.release_cuda_graphs()
        if not self.cuda_graphs_possible:
            return 0.0
        max_blocks = min(-(-max_model_len // self.block_size), self.num_kv_blocks)
        self.graphs = GraphRunner(
            self._body, self.backend, device=self.device, dtype=self.dtype,
            hidden_size=self._hidden_size(), max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, use_cuda_graphs=True,
            mixed_max_tokens=self.mixed_graph_max_tokens,
        )  # fmt: skip
        if sizes is not None and mixed_sizes is None:
            mixed_sizes = []
        with torch.inference_mode():
            self.cuda_graph_capture_s = self.graphs.capture(sizes, mixed_sizes)
        logger.info(
            "captured graphs at %d decode sizes and %d mixed token counts in %.1f s",
            len(self.graphs.sizes),
            len(self.graphs.mixed_sizes),
            self.cuda_graph_capture_s,
        )
        return self.cuda_graph_capture_s

    @property
    def mixed_graph_max_tokens(self) -> int:
        """The largest prefill or mixed pass replayed from a CUDA graph (new tokens;
        0: none): with ``cudagraph_mode`` ``FULL``, the backend's limit, at most
        one pass (:attr:`max_tokens_per_pass`)."""
        if self.cudagraph_mode != "FULL" or not self.cuda_graphs_possible:
            return 0
        limit = self.backend.mixed_graph_max_tokens
        return min(limit, self.max_tokens_per_pass) if self.max_tokens_per_pass else limit

    def tune_attention(self, max_num_seqs: int, max_model_len: int) -> float:
        """Let the attention backend time its launch options on this pool
        (:meth:`~roseinfer.executor.attn_base.AttentionBackend.tune`), or adopt the
        ones an earlier process chose for the same GPU, software, model shape and
        limits (:mod:`~roseinfer.executor.tune_cache`); before capturing CUDA
        graphs, so they replay the chosen launches. Returns the seconds spent (also
        :attr:`attention_tune_s`; 0 off CUDA). :attr:`attention_tune_source` says
        where the launches came from."""
        if self.device.type != "cuda":
            return 0.0
        path = tune_cache_path()
        key = tune_key(self._tune_facts(max_num_seqs, max_model_len))
        if key == self._tuned_key:  # the warm-up's second call: nothing new to time
            return 0.0
        self._tuned_key = key
        cached = load_tuned(path, key) if path is not None else None
        if cached is not None and self.backend.adopt_launches(cached):
            self.attention_tune_source = f"cache {path}"
            return 0.0
        with torch.inference_mode():
            spent = self.backend.tune(
                self.k_cache(0), self.v_cache(0), max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, max_pass_tokens=self.max_tokens_per_pass,
            )  # fmt: skip
        self.attention_tune_s += spent
        launches = self.backend.tuned_launches()
        if launches:
            self.attention_tune_source = "tuned"
            if path is not None and store_tuned(path, key, launches):
                self.attention_tune_source = f"tuned, stored in {path}"
        return spent

    def _tune_facts(self, max_num_seqs: int, max_model_len: int) -> dict[str, Any]:
        """What the attention tuning depends on (the shared cache's key)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            triton = version("triton")
        except PackageNotFoundError:  # a backend without Triton (sdpa) tunes nothing
            triton = None
        s = self.shape
        return {
            "gpu": torch.cuda.get_device_name(self.device), "torch": torch.__version__,
            "triton": triton, "num_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads, "head_dim": s.head_dim,
            "dtype": str(self.dtype), "block_size": self.block_size,
            "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "max_tokens_per_pass": self.max_tokens_per_pass, **self.backend.tune_facts(),
        }  # fmt: skip

    @property
    def graph_token_sizes(self) -> tuple[int, ...]:
        """Prefill/mixed passes (new tokens) replayed from CUDA graphs: the captured
        token counts (``()`` when none are, or off CUDA)."""
        if self.graphs is None or not self.graphs.use_cuda_graphs:
            return ()
        return tuple(self.graphs.captured_mixed_sizes)

    @property
    def graph_batch_sizes(self) -> tuple[int, ...] | None:
        """Decode batch sizes replayed from CUDA graphs: the captured ones; ``()``
        when the runner never captures here (eager, a backend without graphs, no
        CUDA); None before a capture that will happen (the warm-up's)."""
        if self.graphs is not None:
            return tuple(self.graphs.captured_sizes) if self.graphs.use_cuda_graphs else ()
        if self.cuda_graphs_possible and self.device.type == "cuda":
            return None
        return ()

    def release_cuda_graphs(self) -> None:
        """Destroy captured graphs now (:meth:`GraphRunner.release`) and drop them."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.cuda_graph_capture_s = 0.0

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqInput]) -> torch.Tensor:
        """One step over all ``seqs``, writing their new K/V into the cache.

        With :attr:`host_times_s` set to a list, appends the host seconds of the
        call (inputs, launches; no wait for the device) to it.

        Returns:
            logits of the last token of each sequence, ``[len(seqs), vocab]``
            float32, on ``self.device``, in the order of ``seqs``.

        Raises:
            ValueError: on an empty batch or sequence, a block table too short
                for its context, a block id outside the pool, or a context
                longer than the model allows (GPT-2 positions, sliding window).
        """
        start = time.perf_counter()
        checked = self._check(seqs)
        passes = split_passes(seqs, self.max_tokens_per_pass, int(checked.query_lens.sum()))
        # what the check read is the whole step's: a step of several passes reads each pass's
        arrays = checked if len(passes) == 1 else None
        try:
            last = [self._run_pass(pieces, emit, arrays) for pieces, emit in passes]
        except BackendUnavailable as e:
            # Re-running is safe: the K/V already written are written again, same bits.
            logger.warning("%s attention failed (%s); using sdpa from now on", self.backend.name, e)
            self.backend = attn.make_backend("sdpa")
            self.release_cuda_graphs()
            last = [self._run_pass(pieces, emit, arrays) for pieces, emit in passes]
        hidden = last[0] if len(last) == 1 else torch.cat(last)
        logits = self.adapter.logits(hidden).float()
        if self.host_times_s is not None:
            self.host_times_s.append(time.perf_counter() - start)
        return logits

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """Pick one token per row of ``logits`` ``[B, vocab]``; see
        :func:`roseinfer.executor.sampler.sample`."""
        return sample_tokens(logits, params, generators)

    # ------------------------------------------------------------ private
    def _check(self, seqs: Sequence[SeqInput]) -> SeqArrays:
        """Every rule of :func:`_check_seq` over all ``seqs`` at once with numpy; when
        one fails, the per-sequence check names the first sequence that breaks it.

        Returns:
            what the inputs say per sequence (:class:`~roseinfer.executor.input_batch.
            SeqArrays`), which a one-pass step's graph choice and input batch reuse.
        """
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        num_blocks, max_ctx = self.num_kv_blocks, self.shape.max_context_tokens
        queries, starts = seq_lengths(seqs)
        tables = np.fromiter((len(s.block_table) for s in seqs), np.int64, len(seqs))
        contexts = starts + queries
        needed = -(-contexts // self.block_size)
        bad = (queries < 1) | (starts < 0) | (tables < needed)
        if max_ctx is not None:
            bad |= contexts > max_ctx
        if not bad.any():
            ids = used_block_ids(seqs, needed)
            if not ids.size or (ids.min() >= 0 and ids.max() < num_blocks):
                return SeqArrays(queries, starts, ids)
        for seq_idx, seq in enumerate(seqs):
            _check_seq(seq_idx, seq, self.block_size, num_blocks, max_ctx)
        raise AssertionError("the vectorized check and the per-sequence one disagree")

    def _run_pass(
        self, seqs: Sequence[SeqInput], emit: list[bool], arrays: SeqArrays | None = None
    ) -> torch.Tensor:
        """All layers over one pass; hidden states ``[sum(emit), hidden]`` of the
        last token of each sequence with ``emit`` set (``arrays``: the pass's
        :class:`~roseinfer.executor.input_batch.SeqArrays` when :meth:`_check` read
        them already)."""
        inputs, graphs = self.input_batch, self.graphs
        if arrays is None:
            arrays = seq_arrays(seqs, self.block_size)
        padded = self._graph_size(arrays)
        if padded is not None:  # into the static buffers in one copy (no device views)
            assert graphs is not None
            host = inputs.host_batch(seqs, self.backend.host_fields, pad_to=padded, arrays=arrays)
            return graphs.run(host)[: len(seqs)]  # decodes: every row emits
        tokens = self._graph_tokens(arrays)
        if tokens is not None:
            assert graphs is not None
            fields = graphs.graph_host_fields(tokens)
            host = inputs.host_batch(seqs, fields, pad_tokens_to=tokens, arrays=arrays)
            hidden = graphs.run_mixed(host)
            last = graphs.mixed_last_tokens(len(seqs))  # not the padding sequence's
        else:
            batch = inputs.build(seqs, self.backend.host_fields, self.num_kv_blocks, arrays=arrays)
            hidden = self._body(batch, self.backend.build_metadata(batch))
            last = batch.last_token_indices[: len(seqs)]
        if not all(emit):
            last = last[torch.tensor(emit, device=last.device)]
        return hidden.index_select(0, last)

    def _graph_size(self, arrays: SeqArrays) -> int | None:
        """The captured size to run this pass at, or None to run it eagerly."""
        graphs = self.graphs
        if graphs is None or int(arrays.query_lens.max()) != 1:
            return None
        longest = int(arrays.starts.max()) + 1
        return graphs.padded_size(len(arrays.starts), -(-longest // self.block_size))

    def _graph_tokens(self, arrays: SeqArrays) -> int | None:
        """The captured token count to run this prefill/mixed pass at, or None."""
        graphs = self.graphs
        if graphs is None or graphs.mixed is None:
            return None
        num_tokens = int(arrays.query_lens.sum())
        longest = int(arrays.seq_lens.max())
        return graphs.padded_tokens(num_tokens, len(arrays.starts), -(-longest // self.block_size))

    def _body(self, batch: StepBatch, meta: Any) -> torch.Tensor:
        """Embedding and every layer over a pass: hidden ``[num_tokens, hidden]``.
        What CUDA graphs capture: no host read of device data."""
        adapter, backend = self.adapter, self.backend
        hidden = adapter.embed(batch.token_ids, batch.positions)
        pos_ctx = adapter.position_context(batch.positions, hidden.dtype)
        stores_kv = adapter.stores_kv
        for layer_idx in range(self.shape.num_layers):
            k_cache, v_cache = self.kv.k(layer_idx), self.kv.v(layer_idx)
            if stores_kv:  # the K/V are in the cache already (one launch fewer)
                q, k, v = adapter.qkv_stored(
                    layer_idx, hidden, pos_ctx, k_cache, v_cache, batch.slot_mapping
                )
            else:
                q, k, v = adapter.qkv(layer_idx, hidden, pos_ctx)
                backend.write_kv(k, v, k_cache, v_cache, batch)
            scale = adapter.attn_scale(layer_idx)
            out = backend.forward(q, k, v, k_cache, v_cache, meta, batch, scale)
            hidden = adapter.finish_layer(layer_idx, hidden, out.flatten(1))
        return hidden

    def _hidden_size(self) -> int:
        config: Any = self.config  # GPT-2's n_embd is hidden_size in transformers
        return int(config.hidden_size)

    def _choose_backend(self, requested: str) -> AttentionBackend:
        """Resolve ``requested`` and build it; probe ``flex`` (compile) and
        ``triton`` on CUDA (one launch). A failing probe falls back to ``sdpa``
        under ``auto`` and raises ValueError when the backend was asked for."""
        name, reason = attn.resolve_backend(requested, self.device, self.dtype, self.block_size)
        s = self.shape
        try:
            backend = attn.make_backend(
                name, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, device=self.device
            )
            self._probe(backend)
        except BackendUnavailable as e:
            if requested != "auto":
                raise ValueError(
                    f"attention_backend={name!r} does not compile here ({e}); use 'sdpa'"
                ) from None
            logger.warning("%s attention unavailable (%s); using sdpa", name, e)
            return attn.make_backend("sdpa")
        logger.info("attention backend: %s (%s)", name, reason)
        return backend

    def _probe(self, backend: AttentionBackend) -> None:
        """Build the backend's kernels now, touching no cache slot.

        Raises:
            BackendUnavailable: if they do not build or run here.
        """
        from .attn_flex import FlexBackend

        if isinstance(backend, FlexBackend):
            backend.probe(self.k_cache(0), self.v_cache(0), self.shape.num_heads)
        elif backend.name == "triton" and self.device.type == "cuda":
            self._probe_triton(backend)

    @torch.inference_mode()
    def _probe_triton(self, backend: AttentionBackend) -> None:
        """One decode and one two-token prefill through layer 0's attention, with
        padded slots (-1: nothing stored) and no key visible but their own."""
        s = self.shape
        try:
            for seqs in ([SeqInput([0], 0, [0])], [SeqInput([0, 0], 0, [0])]):
                batch = self.input_batch.build(seqs, backend.host_fields, self.num_kv_blocks)
                batch.slot_mapping.fill_(-1)
                q = torch.zeros(
                    (batch.num_tokens, s.num_heads, s.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
                kv = torch.zeros(
                    (batch.num_tokens, s.num_kv_heads, s.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
                backend.write_kv(kv, kv, self.k_cache(0), self.v_cache(0), batch)
                meta = backend.build_metadata(batch)
                backend.forward(q, kv, kv, self.k_cache(0), self.v_cache(0), meta, batch, 1.0)
            torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - compiler failures come in many types
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise BackendUnavailable(f"{type(e).__name__}: {first_line}") from e


def _placed(model: nn.Module, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``model``'s first parameter is on ``device`` in ``dtype`` (a loaded
    model's parameters move together)."""
    param = next(model.parameters(), None)
    if param is None:
        return True
    index = device.index if device.index is not None else param.device.index
    return (param.device.type, param.device.index, param.dtype) == (device.type, index, dtype)


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


def split_passes(
    seqs: Sequence[SeqInput], max_tokens: int, total: int | None = None
) -> list[tuple[list[SeqInput], list[bool]]]:
    """Cut a step into passes of at most ``max_tokens`` new tokens, in order.

    A sequence that does not fit in what is left of a pass opens the next pass
    when it fits in a whole one; a longer one is cut: its first piece ends the
    pass, the rest (``start_pos`` moved on) opens the next.

    Args:
        total: the step's new tokens when the caller counted them already.

    Returns:
        per pass, its pieces and, per piece, whether it holds its sequence's
        last token (whose logits the step returns). ``max_tokens = 0``: one pass.
    """
    if total is None:
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
