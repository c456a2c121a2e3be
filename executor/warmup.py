"""Warm-up: run the largest step shapes once before a run's clock starts.

The first forward of a shape pays one-time costs that later ones do not:
oneDNN/cuBLAS picking and building kernels for new GEMM shapes, the allocator
growing its pools (glibc raises its mmap threshold only after large blocks
were freed once; the CUDA caching allocator reserves segments), lazy imports
and first-call dispatch in torch and the sampler. Serving engines do this
before they accept requests: vLLM's ``profile_run`` runs a dummy batch of
``max_num_batched_tokens`` and its ``capture_model`` runs every decode batch
size it will use (vllm/v1/worker/gpu_model_runner.py). Without it the first
requests of a replay pay these costs and a run's p50 TTFT depends on what
happened to arrive first.

The warm-up writes K/V into pool blocks the scheduler has not handed out yet:
a block is always written before it is read, and padded context slots are
masked, so outputs are unchanged.

CUDA graphs are captured here too, first (vLLM's ``capture_model`` is part of
its warm-up as well), unless the runner runs eagerly; the later decode shapes
then replay them. Their capture time is the ``cuda-graphs`` step.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from roseinfer.config import SchedulerConfig
from roseinfer.executor.attn_base import LARGE_MIXED_DECODES, LARGE_MIXED_TOKENS
from roseinfer.executor.engine import synchronize
from roseinfer.executor.model_runner import ModelRunner, SeqInput

NUM_ROUNDS = 1  # a second round measured no further gain (GPT-2, CPU)
MIXED_CHUNK_TOKENS = 256  # the mixed step warms its code path; size is the prefills' job


@dataclass(frozen=True, slots=True)
class WarmupStep:
    """One warm-up step: what it ran and how long each round took.

    Attributes:
        name: ``cuda-graphs``, ``prefill``, ``prefill-batch``, ``decode``,
            ``decode-1``, ``mixed`` or ``mixed-large``.
        num_seqs: sequences in the step (``cuda-graphs``: sizes captured);
            num_tokens: tokens it computed.
        times_s: seconds of each round (the first pays the one-time costs).
    """

    name: str
    num_seqs: int
    num_tokens: int
    times_s: tuple[float, ...]


def warmup_shapes(config: SchedulerConfig) -> list[tuple[str, list[tuple[int, int]]]]:
    """The warm-up steps for these limits, largest first.

    Each step is a name and a list of ``(num_new_tokens, context_tokens)`` per
    sequence (a decode is ``(1, context)``), all fitting the KV pool:

    * ``prefill``: one prompt of ``max_model_len`` tokens (the longest attention);
    * ``prefill-batch``: when ``max_num_batched_tokens`` exceeds one prompt, that
      many tokens as prompts of at most ``max_model_len`` (the largest linear
      layers; with no limit the largest step is unbounded, so it is skipped);
    * ``decode``: ``max_num_seqs`` decodes at the longest context that fits
      (the largest decode batch and its context gather);
    * ``decode-1``: one decode; ``mixed``: a prompt chunk of at most 256 tokens
      beside a few decodes;
    * ``mixed-large``: when the limits allow one, a chunk of
      :data:`~roseinfer.executor.attn_base.LARGE_MIXED_TOKENS` beside
      ``LARGE_MIXED_DECODES`` decodes (a pass whose decodes the ``triton``
      backend launches apart: that launch compiles here, not in a timed step).
    """
    capacity = config.num_kv_blocks * config.block_size
    max_len = min(config.max_model_len, capacity)
    budget = min(config.max_num_batched_tokens or max_len, capacity)
    prompt = min(max_len, budget)
    num_decodes = min(config.max_num_seqs, capacity)
    decode_ctx = max(1, min(max_len, capacity // num_decodes))
    few = min(4, num_decodes)
    chunk = max(1, min(prompt, MIXED_CHUNK_TOKENS, budget - few, capacity - few * decode_ctx))
    shapes = [("prefill", [(prompt, prompt)])]
    if budget // prompt > 1:
        shapes.append(("prefill-batch", [(prompt, prompt)] * (budget // prompt)))
    shapes += [
        ("decode", [(1, decode_ctx)] * num_decodes),
        ("decode-1", [(1, decode_ctx)]),
        ("mixed", [(chunk, chunk), *[(1, decode_ctx)] * few]),
    ]
    large, rows = LARGE_MIXED_TOKENS, LARGE_MIXED_DECODES
    if (
        large <= max_len
        and large + rows <= budget
        and rows < config.max_num_seqs
        and large + rows * decode_ctx <= capacity
    ):
        shapes.append(("mixed-large", [(large, large), *[(1, decode_ctx)] * rows]))
    return shapes


def warm_up(
    runner: ModelRunner, config: SchedulerConfig, rounds: int = NUM_ROUNDS
) -> list[WarmupStep]:
    """Run :func:`warmup_shapes` ``rounds`` times each (forward, greedy sampling,
    synchronize) on scratch blocks of the pool. Call before the clock starts.

    Args:
        runner: the run's model runner (its pool must match ``config``).
        config: the run's scheduler limits.
        rounds: runs per shape (>= 1).

    Returns:
        One :class:`WarmupStep` per shape (``mixed-large`` on CUDA only), with the
        seconds of each round; first,
        when graphs were captured, ``cuda-graphs`` (its sizes, the capture seconds).
    """
    steps = []
    runner.tune_attention(config.max_num_seqs, config.max_model_len)  # before any capture
    if runner.cuda_graphs_possible and runner.graphs is None:
        capture_s = runner.capture_cuda_graphs(config.max_num_seqs, config.max_model_len)
        num_sizes = len(runner.graphs.sizes) if runner.graphs is not None else 0
        steps.append(WarmupStep("cuda-graphs", num_sizes, 0, (capture_s,)))
    for name, seqs in warmup_shapes(config):
        if name == "mixed-large" and runner.device.type != "cuda":
            continue  # only a GPU launches such a pass's decodes apart
        inputs = scratch_inputs(seqs, runner.block_size, runner.num_kv_blocks, runner.vocab_size)
        times = tuple(_timed_step(runner, inputs) for _ in range(rounds))
        steps.append(WarmupStep(name, len(seqs), sum(n for n, _ in seqs), times))
    return steps


def scratch_inputs(
    seqs: Sequence[tuple[int, int]],
    block_size: int,
    num_kv_blocks: int,
    vocab_size: int,
    first_block: int = 0,
    seed: int = 0,
) -> list[SeqInput]:
    """Runner inputs for ``(num_new_tokens, context_tokens)`` per sequence on
    consecutive pool blocks from ``first_block`` (wrapping around the pool;
    sequences share blocks only when the pool is too small to hold them all).

    Token ids are drawn uniformly from the vocabulary (seeded). Block tables are
    ``array('i')``, as the engine passes the block manager's own
    (``BlockManager.block_ids``), so a step timed on these pays the host work
    ``rose-run`` pays: a list table costs the runner one numpy read per sequence
    (:func:`~roseinfer.executor.input_batch.used_block_ids`; 0.65 ms against
    0.05 ms for 256 tables of 64 blocks on the 2-core VM:
    ``benchmarks/block_table_read.py``).
    """
    gen = torch.Generator().manual_seed(seed)
    inputs, block = [], first_block
    for num_new, context in seqs:
        num_blocks = -(-context // block_size)
        table = array("i", [(block + i) % num_kv_blocks for i in range(num_blocks)])
        block = (block + num_blocks) % num_kv_blocks
        tokens = torch.randint(0, vocab_size, (num_new,), generator=gen).tolist()
        inputs.append(SeqInput(tokens, context - num_new, table))
    return inputs


def _timed_step(runner: ModelRunner, inputs: Sequence[SeqInput]) -> float:
    start = time.perf_counter()
    logits = runner.forward(inputs)
    logits.argmax(dim=-1).tolist()
    synchronize(runner.device)
    return time.perf_counter() - start
