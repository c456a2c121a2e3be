"""Per-request scheduler state (the mutable side of a :class:`Request`)."""

from __future__ import annotations

import enum

from roseinfer.request import Request


class SeqStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # in the waiting queue (new, or preempted)
    RUNNING = "running"  # holds KV blocks, decodes every iteration
    FINISHED = "finished"  # produced its last output token
    REJECTED = "rejected"  # never admitted (see ``reject_reason``)


class Sequence:
    """Scheduler state of one request.

    Token accounting follows vLLM's ``num_computed_tokens``: the sequence has
    ``num_tokens = num_prompt_tokens + num_output_tokens`` tokens; KV exists for
    ``num_computed_tokens`` of them. A prefill computes every token not cached
    and samples one new token; a decode computes the last token and samples one.
    After a preemption (recompute) the KV is dropped and the next prefill
    computes prompt and output tokens again.

    Attributes:
        seq_id: dense integer id (index of submission), used for arrays.
        request: the immutable request.
        status: :class:`SeqStatus`.
        num_output_tokens: tokens generated so far.
        num_computed_tokens: tokens whose KV is in the cache.
        output_token_ids: generated ids when the backend reports them (executor).
        num_cached_prompt_tokens: prefix-cache hit of the first admission (tokens).
        num_preemptions: times it was preempted.
        admitted_s: start time of the first step that prefilled it.
        finish_s: end time of the step that produced its last token.
        reject_reason: why it was rejected ("" otherwise).
        segments: ``[prefill_step, last_step]`` step indices of each stay in the
            running set (one per admission); the last one is open (-1) while running.
        stop_reason: "length", "stop" (EOS/stop token), "abort", or "".
    """

    __slots__ = (
        "seq_id",
        "request",
        "status",
        "num_output_tokens",
        "num_computed_tokens",
        "output_token_ids",
        "num_cached_prompt_tokens",
        "num_preemptions",
        "admitted_s",
        "finish_s",
        "reject_reason",
        "segments",
        "stop_reason",
        "block_hashes",
    )

    def __init__(self, seq_id: int, request: Request) -> None:
        self.seq_id = seq_id
        self.request = request
        self.status = SeqStatus.WAITING
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.num_cached_prompt_tokens = -1  # set at first admission
        self.num_preemptions = 0
        self.admitted_s = float("nan")
        self.finish_s = float("nan")
        self.reject_reason = ""
        self.segments: list[list[int]] = []
        self.stop_reason = ""
        self.block_hashes: list[int] | None = None  # cached by the BlockManager

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.request.num_prompt_tokens + self.num_output_tokens

    @property
    def arrival_time_s(self) -> float:
        """Arrival time in seconds."""
        return self.request.arrival_time_s

    @property
    def remaining_output_tokens(self) -> int:
        """Output tokens left before the length limit."""
        return self.request.max_output_tokens - self.num_output_tokens

    @property
    def is_done(self) -> bool:
        """True once finished or rejected."""
        return self.status in (SeqStatus.FINISHED, SeqStatus.REJECTED)

    def token_ids(self) -> list[int]:
        """Prompt plus output token ids (needs prompt ids; used by the executor).

        Raises:
            ValueError: if the request has no prompt token ids.
        """
        ids = self.request.prompt_token_ids
        if ids is None:
            raise ValueError(
                f"request {self.request_id} has no prompt token ids; the executor needs "
                "them (roseinfer.workloads.with_token_ids makes them up for a trace)"
            )
        return [*ids, *self.output_token_ids]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens})"
        )
