"""Which steps an executor replays from CUDA graphs: the one rule the simulator,
the step model, the step jitter and the executor's capture lists share.

A step replayed from a CUDA graph costs its GPU time; a step launched from the
host costs at least the launch loop (on an H100, ~10-14 ms for a 32-layer model
whatever its length), and it is the kind whose time stretches at random. So a
cost model must know which steps are which, and for the same run the executor
made:

* decode batches of up to the largest captured batch size run from graphs
  (vLLM v1's capture sizes: 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``,
  at most 512; ``_BATCH_SIZES_TO_CAPTURE`` in ``vllm/config.py``, 512 in v1's
  ``CompilationConfig``); a larger batch runs eagerly;
* a pass with prefill tokens runs eagerly under vLLM's ``FULL_DECODE_ONLY``
  cudagraph mode (rose-run's default), and from a graph captured per token count
  under ``FULL`` when it has at most the largest captured token count (the same
  capture sizes from 2, up to :data:`MIXED_GRAPH_MAX_TOKENS` and the pass limit);
* with ``--enforce-eager`` (or on a CPU) every step runs eagerly.

Pure Python: the simulator and the CLIs read it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CUDAGRAPH_MODES",
    "DECODE_GRAPHS",
    "DEFAULT_CUDAGRAPH_MODE",
    "MAX_GRAPH_BATCH_SIZE",
    "MIXED_GRAPH_MAX_TOKENS",
    "NO_GRAPHS",
    "GraphReplay",
    "cuda_graph_batch_sizes",
    "mixed_graph_token_sizes",
    "runs_eagerly",
]

CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL")
"""Which passes replay CUDA graphs, by vLLM's ``CUDAGraphMode`` names: decode
batches only (the default), or also prefill and mixed passes up to the attention
backend's limit (``--enforce-eager`` turns both off; see
:mod:`roseinfer.executor.graph_runner`)."""
DEFAULT_CUDAGRAPH_MODE = "FULL_DECODE_ONLY"
"""``--cudagraph-mode`` when none is given: rose-run's runners, and the rule rose-sim
prices a roofline by (one constant, so the two never disagree)."""

MAX_GRAPH_BATCH_SIZE = 512
"""Largest decode batch an executor replays from a CUDA graph: vLLM v1's largest
default capture size (``vllm/config.py``, ``_BATCH_SIZES_TO_CAPTURE``); larger
batches run eagerly."""

MIXED_GRAPH_MAX_TOKENS = 511
"""Most new tokens of a prefill or mixed pass the Triton attention backend replays
from a graph under ``FULL``: its short-prefill launch shape ends below 512 query
tokens (``executor/attn_triton.py``, ``LONG_QUERY_TOKENS - 1``; a test holds the
two equal). Other backends capture no such passes."""


def cuda_graph_batch_sizes(
    max_num_seqs: int, max_size: int = MAX_GRAPH_BATCH_SIZE
) -> tuple[int, ...]:
    """Decode batch sizes captured as CUDA graphs: 1, 2, 4, 8, 16, 24, ... (steps of
    8) up to ``min(max_num_seqs, max_size)`` (vLLM v1's default capture list, cut
    at the largest batch the scheduler can form; larger batches run eager).

    Raises:
        ValueError: if ``max_num_seqs < 1``.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    top = min(max_num_seqs, max_size)
    return tuple(s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top)


def mixed_graph_token_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts prefill/mixed passes are captured at under ``FULL``: the capture
    sizes from 2 (a one-token pass is a decode) up to ``max_tokens``; none below 2."""
    if max_tokens < 2:
        return ()
    return tuple(t for t in cuda_graph_batch_sizes(max_tokens) if t >= 2)


@dataclass(frozen=True, slots=True)
class GraphReplay:
    """Which steps replay a CUDA graph (the rest launch their kernels from the host).

    Attributes:
        max_decode_seqs: the largest decode batch replayed (sequences; 0: decodes
            run eagerly).
        max_mixed_tokens: the largest pass with prefill tokens replayed (new
            tokens; 0: every such pass runs eagerly, vLLM's ``FULL_DECODE_ONLY``).

    Raises:
        ValueError: on a negative size.
    """

    max_decode_seqs: int = MAX_GRAPH_BATCH_SIZE
    max_mixed_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_decode_seqs < 0 or self.max_mixed_tokens < 0:
            raise ValueError(f"graph sizes must be >= 0, got {self}")

    @classmethod
    def of_mode(cls, mode: str) -> GraphReplay:
        """What rose-run replays under ``--cudagraph-mode mode``: decode batches up to
        :data:`MAX_GRAPH_BATCH_SIZE`, and under ``FULL`` passes up to the largest
        capture size of :data:`MIXED_GRAPH_MAX_TOKENS` (504). A run's limits cut the
        captured sizes (``--max-num-seqs``, a pass of ``--max-num-batched-tokens``),
        but its scheduler forms no larger step either, so the rule is theirs too
        (a batch between the last capture size and a limit that is not one, 97-100
        of 100 sequences, replays here and runs eagerly in rose-run).

        Raises:
            ValueError: on an unknown mode (lists the known ones).
        """
        if mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph mode must be one of {', '.join(CUDAGRAPH_MODES)}, "
                             f"got {mode!r}")  # fmt: skip
        if mode != "FULL":
            return DECODE_GRAPHS
        return cls(MAX_GRAPH_BATCH_SIZE, max(mixed_graph_token_sizes(MIXED_GRAPH_MAX_TOKENS)))

    @classmethod
    def of_executor(cls, executor: Mapping[str, Any]) -> GraphReplay:
        """What a profile's or step log's ``executor`` section says was replayed:
        decodes (as :meth:`of_mode`) when it captured decode graphs
        (``cuda_graph_batch_sizes``), and passes of up to its largest captured token
        count (``cuda_graph_token_sizes``, ``FULL``); every step eager when it
        captured none (a CPU run, ``enforce_eager``)."""
        if executor.get("enforce_eager") or not executor.get("cuda_graph_batch_sizes"):
            return NO_GRAPHS
        tokens = executor.get("cuda_graph_token_sizes") or ()
        return cls(MAX_GRAPH_BATCH_SIZE, int(max(tokens, default=0)))

    @property
    def any(self) -> bool:
        """Whether any step replays a graph."""
        return self.max_decode_seqs > 0 or self.max_mixed_tokens > 0

    @property
    def mode(self) -> str:
        """vLLM's name for it: ``FULL`` when passes with prefill tokens replay,
        ``FULL_DECODE_ONLY`` when decodes do, ``NONE`` when nothing does."""
        if self.max_mixed_tokens:
            return "FULL"
        return "FULL_DECODE_ONLY" if self.max_decode_seqs else "NONE"

    def runs_eagerly(self, num_tokens: Any, num_seqs: Any) -> Any:
        """Whether a step of ``num_tokens`` new tokens over ``num_seqs`` sequences
        launches its kernels from the host: a pass with prefill tokens (more tokens
        than sequences) over :attr:`max_mixed_tokens`, or a decode batch over
        :attr:`max_decode_seqs`. Takes numbers (returns a bool) or float arrays
        (a bool array, per step). The compiled core inlines the same rule."""
        prefill = num_tokens > num_seqs
        return (prefill & (num_tokens > self.max_mixed_tokens)) | (
            (num_tokens <= num_seqs) & (num_seqs > self.max_decode_seqs)
        )

    def describe(self) -> str:
        """``decodes of <= 256 sequences and passes of <= 504 tokens from CUDA graphs``."""
        if not self.any:
            return "every step launched eagerly"
        parts = [f"decodes of <= {self.max_decode_seqs} sequences"] if self.max_decode_seqs else []
        if self.max_mixed_tokens:
            parts.append(f"passes of <= {self.max_mixed_tokens} new tokens")
        return " and ".join(parts) + " from CUDA graphs"


DECODE_GRAPHS = GraphReplay()
"""rose-run's default on CUDA (``FULL_DECODE_ONLY``, decodes up to 512)."""
NO_GRAPHS = GraphReplay(0, 0)
"""Every step eager (``--enforce-eager``, a CPU)."""


def runs_eagerly(num_tokens: Any, num_seqs: Any, graphs: GraphReplay = DECODE_GRAPHS) -> Any:
    """:meth:`GraphReplay.runs_eagerly` of ``graphs`` (default: rose-run's CUDA
    default, decodes of up to :data:`MAX_GRAPH_BATCH_SIZE` from graphs)."""
    return graphs.runs_eagerly(num_tokens, num_seqs)
