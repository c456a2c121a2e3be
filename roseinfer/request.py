"""Requests as a workload describes them, and their sampling parameters.

A :class:`Request` is immutable: what a trace row or a client asked for. The
scheduler keeps the mutable per-request state in :class:`roseinfer.sequence.Sequence`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the executor picks each output token.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / T).
        top_k: keep the k most likely tokens; 0 (or -1, vLLM's value) disables.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        seed: per-request seed for a reproducible sample; None draws from the
            engine's seeded generator.
        ignore_eos: True honours the output length exactly (vLLM bench's
            ``--ignore-eos``, used for trace replay); False stops at EOS.
        stop_token_ids: extra token ids that end the request (besides EOS).

    Raises:
        ValueError: on a negative temperature, top_k < -1, or top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be >= 0, or -1 (0 and -1 disable), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True when the output is the argmax at every step."""
        return self.temperature == 0.0 or self.top_k == 1


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class Request:
    """One LLM request.

    Attributes:
        request_id: unique id within a run.
        arrival_time_s: arrival time in seconds from the start of the run.
        num_prompt_tokens: prompt length in tokens (> 0). Equals
            ``len(prompt_token_ids)`` when ids are given.
        max_output_tokens: output length in tokens (> 0): exact when
            ``sampling.ignore_eos`` (trace replay), an upper bound otherwise.
        prompt_token_ids: the prompt's token ids, or None when only its length
            is known (a trace without text); the executor then needs ids made up
            by the workload (see ``roseinfer.workloads.with_token_ids``).
        prefix_hash_ids: Mooncake-style prefix ids, one per
            ``prefix_hash_block_tokens`` tokens of the prompt; equal leading ids mean
            an equal prompt prefix. Used for prefix caching when no token ids exist.
        prefix_hash_block_tokens: tokens covered by one prefix hash id (512 in the
            Mooncake traces).
        tenant: optional tenant (client) name, for fairness metrics.
        priority: priority class (lower is more urgent, vLLM's convention; default
            0); read by ``priority`` and reported per class by the metrics.
        deadline_s: optional first-token deadline in seconds after arrival (a
            TTFT SLO); read by ``edf``; the metrics report its attainment.
        sampling: sampling parameters for the executor.
        num_transferred_tokens: leading prompt tokens whose KV arrives with the
            request (a prefill replica computed them; prefill/decode
            disaggregation in the cluster simulator): the first admission
            allocates blocks for them but computes only the rest. 0 otherwise.

    Raises:
        ValueError: on non-positive lengths, a negative arrival time, or token ids
            whose count differs from ``num_prompt_tokens``, or a deadline <= 0.
    """

    request_id: str
    arrival_time_s: float
    num_prompt_tokens: int
    max_output_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prefix_hash_ids: tuple[int, ...] | None = None
    prefix_hash_block_tokens: int = 512
    tenant: str | None = None
    priority: int = 0
    deadline_s: float | None = None
    sampling: SamplingParams = field(default=GREEDY)
    num_transferred_tokens: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0:
            raise ValueError(
                f"request {self.request_id}: prompt length must be > 0, got {self.num_prompt_tokens}"
            )
        if self.max_output_tokens <= 0:
            raise ValueError(
                f"request {self.request_id}: output length must be > 0, got {self.max_output_tokens}"
            )
        if self.arrival_time_s < 0:
            raise ValueError(
                f"request {self.request_id}: arrival time must be >= 0 s, got {self.arrival_time_s}"
            )
        ids = self.prompt_token_ids
        if ids is not None and len(ids) != self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: {len(ids)} prompt token ids but "
                f"num_prompt_tokens={self.num_prompt_tokens}"
            )
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(
                f"request {self.request_id}: deadline_s must be > 0 s, got {self.deadline_s}"
            )
        if self.prefix_hash_block_tokens <= 0:
            raise ValueError("prefix_hash_block_tokens must be > 0")
        if not 0 <= self.num_transferred_tokens <= self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: num_transferred_tokens must be in "
                f"0..{self.num_prompt_tokens}, got {self.num_transferred_tokens}"
            )

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most output tokens it can have (tokens of KV it can need)."""
        return self.num_prompt_tokens + self.max_output_tokens
