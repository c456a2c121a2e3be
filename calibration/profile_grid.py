"""The step shapes ``rose-run profile`` times: what real runs under given limits execute.

A profile predicts runs only where it sampled the shapes those runs take. Under
the limits of an executor (``max_num_batched_tokens``, ``max_num_seqs``,
``max_model_len``, ``block_size``, the KV pool and, on CUDA, the decode batch
sizes captured as graphs) the scheduler produces:

* prefills of one prompt, from 2 tokens to the whole token budget (chunked
  prefill cuts longer prompts at the budget), each with no cached context, half
  the room left and all of it cached: a prefix-cache hit or earlier chunks are
  whole blocks, so cached contexts are multiples of ``block_size``. The counts
  are the powers of two and, on a GPU (where decode graphs exist), odd counts
  between them (x 1.41, | 1): a GEMM computes whole tiles of 64-256 rows, so a
  served prompt of 1,035 tokens costs more per token than one of 1,024 (on an
  H100, real prefills of 300-1,100 tokens took 3-15% longer than a grid of
  powers of two predicted);
* batches of several prompts, with and without a shared cached prefix (a burst
  of one system prompt: the first prompt computes it, the others hit it);
* decode batches x context lengths up to ``max_model_len``, with every sequence
  at one context, with contexts spread evenly, and on a GPU skewed as served
  contexts are (log-normal: a few long ones among many short ones; a batch's
  attention ends with its longest context, which an even spread does not
  show). A decode batch runs as the next
  captured CUDA graph's size (padded), so where graphs exist the grid samples
  exactly those sizes (plus ``max_num_seqs``, which may run eager); without
  graphs it samples 1, 2, 4, ... ``max_num_seqs``;
* mixed steps: a prefill chunk beside decodes, at the token budget and below
  it, on a fresh prompt and on a cached context (a later chunk).

Token counts are geometric, then every shape is checked against the limits,
as Vidur's profiling does (Agrawal et al., MLSys 2024). The graph sizes are
those vLLM v1 captured by default: 1, 2, 4, 8, then steps of 8 up to
``max_num_seqs``, at most 512 (``vllm/config.py``, ``_BATCH_SIZES_TO_CAPTURE``).

Pure Python and numpy: no torch. The executor's profiler
(``roseinfer.executor.profiler``) times these shapes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "GridLimits",
    "Shape",
    "decode_batch_sizes",
    "grid_counts",
    "profile_grid",
]

Shape = tuple[str, list[tuple[int, int]]]
"""``(kind, [(num_new_tokens, context_tokens), ...])``: ``kind`` is ``prefill``,
``decode`` or ``mixed``; a decode is ``(1, context)``; a prefill's context
includes its new tokens."""

MIN_PREFILL_TOKENS = 2  # a 1-token chunk runs as a decode in the runner
MULTI_PREFILL_TOKENS = (16, 64, 256)  # mean prompt lengths of multi-prompt prefill steps
SHARED_PREFIX_BLOCKS = 3  # cached blocks in front of each prompt of a shared-prefix burst
MIXED_DECODES = (4, 16, 64)  # decode counts beside a prefill chunk (and half max_num_seqs)
DECODE_CONTEXT_FACTOR = 4.0  # decode contexts 16, 64, 256, ... up to the longest
OFF_GRID_FACTOR = 2.0**0.5  # prefill counts between the powers of two (odd: off the tiles)
SKEW_SIGMA = 1.0  # log-normal spread of a skewed decode batch (median: the context)


@dataclass(frozen=True, slots=True)
class GridLimits:
    """What the profiled scheduler can put in one step.

    Attributes:
        max_num_batched_tokens: most tokens one step computes.
        max_num_seqs: most sequences in one step (the decode batch).
        max_model_len: longest context of one sequence (tokens).
        kv_capacity_tokens: tokens the KV pool holds (every step fits in it).
        block_size: tokens per KV block: cached contexts are whole blocks.
        graph_batch_sizes: decode batch sizes captured as CUDA graphs (a batch
            runs padded to the next one); empty when decodes run eager.

    Raises:
        ValueError: on a count < 1 or a graph size < 1.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_capacity_tokens: int
    block_size: int = 16
    graph_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "kv_capacity_tokens", "block_size"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"GridLimits.{name} must be >= 1, got {getattr(self, name)}")
        if any(size < 1 for size in self.graph_batch_sizes):
            raise ValueError(f"graph batch sizes must be >= 1, got {self.graph_batch_sizes}")

    @property
    def max_context(self) -> int:
        """Longest context one sequence can have: the model's, or the whole pool."""
        return min(self.max_model_len, self.kv_capacity_tokens)

    @property
    def max_decode_batch(self) -> int:
        """Largest decode batch: sequences, and one token each within the budget."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)


def _geometric(low: int, high: int, factor: float = 2.0) -> list[int]:
    """``low, low * factor, ...`` below ``high``, and ``high`` itself (sorted, unique)."""
    values, x = set(), float(low)
    while x < high:
        values.add(int(round(x)))
        x *= factor
    values.add(high)
    return sorted(v for v in values if low <= v <= high)


def _blocks_below(tokens: int, block_size: int) -> int:
    """``tokens`` rounded down to whole blocks (a cached context is whole blocks)."""
    return max(0, tokens) // block_size * block_size


def decode_batch_sizes(limits: GridLimits) -> list[int]:
    """The decode batch sizes to time: the captured graph sizes that fit, plus the
    largest batch; without graphs 1, 2, 4, ... up to the largest batch."""
    top = limits.max_decode_batch
    if not limits.graph_batch_sizes:
        return _geometric(1, top, 2.0)
    return sorted({s for s in limits.graph_batch_sizes if s <= top} | {top})


def _prefill_shapes(limits: GridLimits) -> list[Shape]:
    """Single prompts or chunks: new tokens x cached context (none, half, all the room)."""
    top = min(limits.max_num_batched_tokens, limits.max_context)
    counts = set(_geometric(MIN_PREFILL_TOKENS, top))
    if limits.graph_batch_sizes:  # a GPU: odd counts between two powers, off the tiles
        counts |= {int(n * OFF_GRID_FACTOR) | 1 for n in counts if int(n * OFF_GRID_FACTOR) < top}
    shapes: list[Shape] = []
    for new in sorted(counts):
        room = limits.max_context - new
        cached = {0, _blocks_below(room // 2, limits.block_size),
                  _blocks_below(room, limits.block_size)}  # fmt: skip
        shapes += [("prefill", [(new, new + c)]) for c in sorted(cached)]
    return shapes


def _multi_prefill_shapes(limits: GridLimits, rng: np.random.Generator) -> list[Shape]:
    """Several prompts in one step (lengths spread +-50% around a mean), each alone
    and each behind a shared cached prefix of :data:`SHARED_PREFIX_BLOCKS` blocks."""
    budget = min(limits.max_num_batched_tokens, limits.kv_capacity_tokens)
    prefix = SHARED_PREFIX_BLOCKS * limits.block_size
    shapes: list[Shape] = []
    for mean in MULTI_PREFILL_TOKENS:
        mean = min(mean, limits.max_model_len)
        top = max(2, min(limits.max_num_seqs, budget // mean))
        for count in _geometric(2, top, 4.0):
            lengths = rng.integers(max(1, mean // 2), mean + mean // 2 + 1, count)
            lengths = np.minimum(lengths, limits.max_model_len)
            if count > limits.max_num_seqs or lengths.sum() > budget:
                continue
            shapes.append(("prefill", [(int(n), int(n)) for n in lengths]))
            cached = [(int(n), int(n) + prefix) for n in lengths]
            if _fits(cached, limits):
                shapes.append(("prefill", cached))
    return shapes


def _fits(seqs: Sequence[tuple[int, int]], limits: GridLimits) -> bool:
    """True when a step of ``seqs`` is within every limit."""
    return (
        1 <= len(seqs) <= limits.max_num_seqs
        and sum(n for n, _ in seqs) <= limits.max_num_batched_tokens
        and all(1 <= n <= c <= limits.max_context for n, c in seqs)
        and sum(c for _, c in seqs) <= limits.kv_capacity_tokens
    )


def _decode_shapes(limits: GridLimits, rng: np.random.Generator) -> list[Shape]:
    """Decode batches x contexts: all equal, spread uniformly over [1, 2 x context],
    and on a GPU skewed (log-normal around ``context``, :data:`SKEW_SIGMA`)."""
    shapes: list[Shape] = []
    for batch in decode_batch_sizes(limits):
        for context in _geometric(16, limits.max_context, DECODE_CONTEXT_FACTOR):
            if batch * context > limits.kv_capacity_tokens:
                continue
            shapes.append(("decode", [(1, context)] * batch))
            if batch == 1:
                continue
            variants = [rng.integers(1, 2 * context + 1, batch)]
            if limits.graph_batch_sizes:
                skew = rng.lognormal(0.0, SKEW_SIGMA, batch)
                variants.append(np.rint(context * skew).astype(np.int64))
            for contexts in variants:
                contexts = np.clip(contexts, 1, limits.max_context)
                if contexts.sum() <= limits.kv_capacity_tokens:
                    shapes.append(("decode", [(1, int(c)) for c in contexts]))
    return shapes


def _mixed_shapes(limits: GridLimits) -> list[Shape]:
    """A prefill chunk beside decodes: a small chunk and one filling the token budget,
    on a fresh prompt and as a later chunk (on a cached context)."""
    max_ctx = limits.max_context
    counts = {*MIXED_DECODES, limits.max_decode_batch // 2}
    shapes: list[Shape] = []
    for num_decodes in sorted(n for n in counts if 1 <= n < limits.max_decode_batch):
        chunk_top = min(limits.max_num_batched_tokens - num_decodes, max_ctx)
        for context in sorted({min(64, max_ctx), max_ctx // 2}):
            decodes = [(1, context)] * num_decodes
            for chunk in sorted({min(64, chunk_top), chunk_top}):
                later = _blocks_below(max_ctx - chunk, limits.block_size) // 2
                for cached in sorted({0, later}):
                    seqs = [(chunk, chunk + cached), *decodes]
                    if chunk >= MIN_PREFILL_TOKENS and _fits(seqs, limits):
                        shapes.append(("mixed", seqs))
    return shapes


def profile_grid(limits: GridLimits, seed: int = 0) -> list[Shape]:
    """Every step shape to time under ``limits`` (see the module docstring).

    Deterministic for a ``seed`` (it draws the spread lengths). Every shape fits
    ``limits``: at most ``max_num_seqs`` sequences and ``max_num_batched_tokens``
    new tokens, contexts within ``max_model_len``, and the KV pool.
    """
    rng = np.random.default_rng(seed)
    return [
        *_prefill_shapes(limits),
        *_multi_prefill_shapes(limits, rng),
        *_decode_shapes(limits, rng),
        *_mixed_shapes(limits),
    ]


def grid_counts(shapes: Sequence[Shape]) -> dict[str, int]:
    """Shapes per kind, and prefills with a cached context (``prefill_cached``)."""
    counts = Counter(kind for kind, _ in shapes)
    counts["prefill_cached"] = sum(
        1 for kind, seqs in shapes if kind == "prefill" and any(c > n for n, c in seqs)
    )
    return dict(counts)
