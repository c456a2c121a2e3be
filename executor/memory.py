"""The memory planner: size the KV pool from a profile pass, as vLLM does.

Before the real pool exists, the runner runs the largest work it will ever do
on a small scratch pool and the peak is measured; the pool then gets what is
left of ``gpu_memory_utilization`` of the device (vLLM's rule,
``Worker.determine_available_memory`` in vllm/v1/worker/gpu_worker.py)::

    kv_cache_bytes = total x gpu_memory_utilization
                     - weights (and everything else this process holds)
                     - peak activations of the profile pass
                     - memory outside torch's allocator
                     - the CUDA-graph pool

NOTE: ``torch.cuda.mem_get_info`` cannot tell this process's memory outside
torch's allocator (CUDA context, cuBLAS workspaces) from other processes'
memory, so both are subtracted: memory another process holds is never taken
(where vLLM instead refuses to start), and a pool it leaves too small for one
``max_model_len`` sequence is the error.

The profile pass (:func:`profile_step_shapes`) is one pass of the runner's
``max_tokens_per_pass`` tokens (the runner cuts every step into passes of at
most that many, so no step can exceed it, whatever the policy packs), each
piece the last chunk of a ``max_model_len`` context (the longest attention a
pass of that many tokens can run: a backend that gathers the cached context,
``sdpa``, peaks there), then the sampler over ``max_num_seqs`` rows of logits
with top-k/top-p (its sort is the sampler's largest buffer). The CUDA-graph pool is estimated by capturing the
largest and the smallest decode graph on the scratch pool: the largest graph's
memory plus, per other size, the smallest one's (graphs share one pool for
their intermediate buffers; each adds its own small fixed cost); with
``--cudagraph-mode FULL`` the prefill/mixed graphs are estimated the same way and
added.

:func:`plan_kv_cache` does all of it and leaves the runner with the planned
pool; :mod:`roseinfer.executor.builder` calls it for every run on CUDA. Every device reading goes through a :class:`MemoryReader`, so the tests
run the planner on CPU with a scripted reader.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from roseinfer.request import SamplingParams

from .graph_runner import capture_sizes, mixed_capture_sizes
from .model_runner import ModelRunner
from .sampler import sample
from .warmup import scratch_inputs

GIB = 2**30
# vLLM's default max_num_batched_tokens for online serving: 8192 on GPUs of >= 70 GiB
# other than the A100, else 2048 (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults;
# the offline LLM class uses 16384 / 8192).
LARGE_GPU_BYTES = 70 * GIB
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192
SMALL_GPU_MAX_NUM_BATCHED_TOKENS = 2048


def default_max_num_batched_tokens(total_memory_bytes: int, device_name: str) -> int:
    """vLLM's default token budget per step for online serving on this GPU (see
    :data:`LARGE_GPU_MAX_NUM_BATCHED_TOKENS`)."""
    large = total_memory_bytes >= LARGE_GPU_BYTES and "a100" not in device_name.lower()
    return LARGE_GPU_MAX_NUM_BATCHED_TOKENS if large else SMALL_GPU_MAX_NUM_BATCHED_TOKENS


class MemoryReader(Protocol):
    """The device memory readings the planner takes (``torch.cuda``'s names)."""

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, all processes."""
        ...

    def memory_allocated(self) -> int:
        """Bytes of live tensors of this process."""
        ...

    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""
        ...

    def memory_reserved(self) -> int:
        """Bytes the caching allocator holds (live tensors and cached blocks)."""
        ...

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak."""
        ...

    def empty_cache(self) -> None:
        """Return cached, unused blocks to the device."""
        ...

    def synchronize(self) -> None:
        """Wait for queued work."""
        ...


class CudaMemoryReader:
    """:class:`MemoryReader` over ``torch.cuda`` for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def max_memory_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """How the KV pool was sized (bytes unless named otherwise).

    Attributes:
        total_bytes: the device's memory; gpu_memory_utilization: the share used.
        weights_bytes: what this process held before the pool (weights, buffers).
        activation_peak_bytes: peak of the profile pass over what was held.
        non_torch_bytes: device memory outside torch's allocator (this
            process's and other processes'; see the module doc).
        cuda_graph_bytes: the CUDA-graph pool estimate (0 without graphs).
        kv_cache_bytes: the pool: ``num_kv_blocks x block_bytes``.
        kv_budget_bytes: the rule's bytes in whole blocks, before the cap on
            blocks (what ``rose-sim`` sizes another model's pool from).
        block_bytes: one block, all layers, K and V; num_kv_blocks: the pool's blocks.
        profiled_tokens, profiled_seqs: the profile pass's tokens and the
            sampler's rows.
    """

    total_bytes: int
    gpu_memory_utilization: float
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    cuda_graph_bytes: int
    kv_cache_bytes: int
    kv_budget_bytes: int
    block_bytes: int
    num_kv_blocks: int
    profiled_tokens: int
    profiled_seqs: int

    def describe(self) -> str:
        """One line: the rule with its numbers, in GiB."""
        g = {k: v / GIB for k, v in asdict(self).items() if k.endswith("_bytes")}
        return (
            f"KV pool {g['kv_cache_bytes']:.2f} GiB ({self.num_kv_blocks} blocks) = "
            f"{g['total_bytes']:.2f} GiB x {self.gpu_memory_utilization:g} - weights "
            f"{g['weights_bytes']:.2f} - activations {g['activation_peak_bytes']:.2f} "
            f"(profiled: {self.profiled_tokens} tokens, sampler over {self.profiled_seqs} rows)"
            f" - non-torch {g['non_torch_bytes']:.2f} - CUDA graphs {g['cuda_graph_bytes']:.2f}"
        )


def profile_step_shapes(max_tokens: int, max_model_len: int) -> list[tuple[int, int]]:
    """The profile pass: ``max_tokens`` new tokens in pieces of at most
    ``max_model_len``, each ending a ``max_model_len`` context (``(new_tokens,
    context)`` per sequence; a whole piece is a prompt from position 0, a shorter
    one the last chunk of a prompt).

    Raises:
        ValueError: if either is < 1.
    """
    if max_tokens < 1 or max_model_len < 1:
        raise ValueError(
            f"need max_tokens >= 1 and max_model_len >= 1, got {max_tokens}, {max_model_len}"
        )
    full, rest = divmod(max_tokens, max_model_len)
    return [(max_model_len, max_model_len)] * full + ([(rest, max_model_len)] if rest else [])


def profile_num_blocks(max_tokens: int, max_model_len: int, block_size: int) -> int:
    """Blocks of the scratch pool the profile pass writes into: its new tokens'
    (the context before a chunk wraps around the pool: its values do not matter)."""
    return sum(-(-n // block_size) for n, _ in profile_step_shapes(max_tokens, max_model_len))


def kv_cache_bytes(
    total: int,
    gpu_memory_utilization: float,
    weights: int,
    activation_peak: int,
    non_torch: int,
    cuda_graphs: int,
) -> int:
    """vLLM's rule (see the module doc), never below 0."""
    budget = total * gpu_memory_utilization
    return max(0, int(budget - weights - activation_peak - non_torch - cuda_graphs))


def num_blocks_for(
    pool_bytes: int, block_bytes: int, block_size: int, max_model_len: int, cap: int | None = None
) -> int:
    """Blocks that fit in ``pool_bytes`` (at most ``cap``).

    Raises:
        ValueError: if they cannot hold one sequence of ``max_model_len`` tokens;
            the message names what to lower.
    """
    num_blocks = pool_bytes // block_bytes
    if cap is not None:
        num_blocks = min(num_blocks, cap)
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ValueError(
            f"the KV pool gets {pool_bytes / GIB:.3g} GiB ({num_blocks} blocks of {block_size} "
            f"tokens) but one --max-model-len {max_model_len} sequence needs {need} blocks; "
            "lower --max-model-len or --max-num-batched-tokens, or raise "
            "--gpu-memory-utilization"
        )
    return int(num_blocks)


def graph_pool_estimate(largest_bytes: int, smallest_bytes: int, num_sizes: int) -> int:
    """CUDA-graph memory of ``num_sizes`` graphs from the measured memory of the
    largest and the smallest one (see the module doc)."""
    return max(0, largest_bytes) + max(0, num_sizes - 1) * max(0, smallest_bytes)


def plan_kv_cache(
    runner: ModelRunner,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    reader: MemoryReader | None = None,
    max_num_kv_blocks: int | None = None,
) -> MemoryPlan:
    """Profile, size the pool, and leave ``runner`` with it (module doc).

    Args:
        runner: its pool is re-allocated (contents lost), first to the scratch
            size, then to the plan; captured graphs are dropped (capture them
            after, e.g. in the warm-up).
        max_num_seqs: the largest batch (sampler rows, graph sizes).
        max_model_len: the longest sequence (profile prompts, the pool's floor).
        gpu_memory_utilization: share of the device's total memory, in (0, 1].
        reader: device memory readings (default: ``torch.cuda`` for the
            runner's device; required off CUDA).
        max_num_kv_blocks: cap on the pool (e.g. ``max_num_seqs`` sequences of
            ``max_model_len``; beyond it a tiny model's pool is useless).

    Raises:
        ValueError: on a runner without a pass limit, a utilization outside (0,
            1], or a pool too small for one ``max_model_len`` sequence.
    """
    tokens = runner.max_tokens_per_pass
    if tokens <= 0:
        raise ValueError("the memory planner profiles the largest pass; give the runner a "
                         "max_tokens_per_pass > 0")  # fmt: skip
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if reader is None:
        if runner.device.type != "cuda":
            raise ValueError("the memory planner sizes CUDA pools; give a reader elsewhere")
        reader = CudaMemoryReader(runner.device)
    runner.allocate_kv_cache(profile_num_blocks(tokens, max_model_len, runner.block_size))
    reader.synchronize()
    reader.empty_cache()
    weights = reader.memory_allocated() - runner.kv_cache_bytes
    peak = _profile_peak(runner, tokens, max_num_seqs, max_model_len, reader)
    free, total = reader.mem_get_info()
    non_torch = max(0, (total - free) - reader.memory_reserved())
    graphs = _graph_pool_bytes(runner, max_num_seqs, max_model_len, reader)
    pool = kv_cache_bytes(total, gpu_memory_utilization, weights, peak, non_torch, graphs)
    block_bytes = runner.block_bytes
    num_blocks = num_blocks_for(
        pool, block_bytes, runner.block_size, max_model_len, max_num_kv_blocks
    )
    runner.allocate_kv_cache(num_blocks)
    return MemoryPlan(
        total_bytes=total, gpu_memory_utilization=gpu_memory_utilization, weights_bytes=weights,
        activation_peak_bytes=peak, non_torch_bytes=non_torch, cuda_graph_bytes=graphs,
        kv_cache_bytes=num_blocks * block_bytes, kv_budget_bytes=pool // block_bytes * block_bytes,
        block_bytes=block_bytes,
        num_kv_blocks=num_blocks, profiled_tokens=tokens, profiled_seqs=max_num_seqs,
    )  # fmt: skip


def _profile_peak(
    runner: ModelRunner, tokens: int, max_num_seqs: int, max_model_len: int, reader: MemoryReader
) -> int:
    """Peak bytes over what is held, of the largest pass and then the sampler over
    ``max_num_seqs`` rows of top-k/top-p logits."""
    reader.reset_peak_memory_stats()
    base = reader.memory_allocated()
    shapes = profile_step_shapes(tokens, max_model_len)
    inputs = scratch_inputs(shapes, runner.block_size, runner.num_kv_blocks, runner.vocab_size)
    runner.forward(inputs)
    logits = torch.randn((max_num_seqs, runner.vocab_size), device=runner.device)
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9)] * max_num_seqs
    generator = torch.Generator(device=runner.device).manual_seed(0)
    sample(logits, params, [generator] * max_num_seqs)
    del logits
    reader.synchronize()
    peak = max(0, reader.max_memory_allocated() - base)
    reader.empty_cache()
    return peak


def _graph_pool_bytes(
    runner: ModelRunner, max_num_seqs: int, max_model_len: int, reader: MemoryReader
) -> int:
    """The CUDA-graph pool estimate: per family (decode batches, and prefill/mixed
    passes in ``FULL`` mode), capture the largest, then the smallest size on the
    scratch pool, measuring the device memory each holds (0 without graphs)."""
    if not runner.cuda_graphs_possible or runner.device.type != "cuda":
        return 0
    sizes = capture_sizes(max_num_seqs)
    mixed_sizes = mixed_capture_sizes(runner.mixed_graph_max_tokens)
    total = 0
    for family, all_sizes in (("decode", sizes), ("mixed", mixed_sizes)):
        if not all_sizes:
            continue
        held = []
        for size in (all_sizes[-1], all_sizes[0]):
            reader.empty_cache()
            before = _used(reader)
            one = {"sizes": [size], "mixed_sizes": []} if family == "decode" else {
                "sizes": [], "mixed_sizes": [size]}  # fmt: skip
            runner.capture_cuda_graphs(max_num_seqs, max_model_len, **one)
            reader.synchronize()
            held.append(_used(reader) - before)
            runner.release_cuda_graphs()
        total += graph_pool_estimate(held[0], held[1], len(all_sizes))
    reader.empty_cache()
    return total


def _used(reader: MemoryReader) -> int:
    free, total = reader.mem_get_info()
    return total - free
