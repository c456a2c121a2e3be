"""Scheduler and KV-cache configuration (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass

from roseinfer.interface import PolicyOptions

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block_size on GPUs


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and knobs of the shared scheduler.

    Attributes:
        num_kv_blocks: KV cache blocks in the pool.
        block_size: tokens per KV block (vLLM ``--block-size``).
        max_num_seqs: cap on the running set = the decode batch (vLLM ``--max-num-seqs``;
            the seeds' ``max_batch_size``).
        prefill_max_seqs: requests admitted per round (the seeds'
            ``prefill_max_batch_size``); None means ``max_num_seqs``.
        prefill_max_tokens: prompt tokens admitted per round (the seeds'
            ``prefill_max_tokens``, seed 031); None means no limit.
        max_model_len: longest request (prompt + output tokens); longer ones are
            rejected with a reason.
        enable_prefix_caching: reuse KV blocks by chained hashes of full blocks.
        policy: admission policy name (``--policy``).
        loop_order: loop ordering name (``--loop-order``).
        options: knobs passed to the policy instances.

    Raises:
        ValueError: on a non-positive limit.
    """

    num_kv_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    prefill_max_seqs: int | None = None
    prefill_max_tokens: int | None = None
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    policy: str = "fifo"
    loop_order: str = "prefill-first"
    options: PolicyOptions = PolicyOptions()

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_max_seqs", "prefill_max_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 (or unset for no limit), got {value}")

    @property
    def effective_prefill_max_seqs(self) -> int:
        """Requests admitted per round: ``prefill_max_seqs`` or ``max_num_seqs``."""
        return self.prefill_max_seqs or self.max_num_seqs

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_kv_blocks * self.block_size
