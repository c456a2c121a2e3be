"""Per-request scheduler state (the mutable side of a :class:`Request`)."""

from __future__ import annotations

import enum

from roseinfer.request import Request


class SeqStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # in the waiting queue (new, or preempted)
    RUNNING = "running"  # holds KV blocks; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"  # produced its last output token
    REJECTED = "rejected"  # never admitted, or aborted (see ``reject_reason``)


class Sequence:
    """Scheduler state of one request.

    Token accounting follows vLLM v1's ``num_computed_tokens``: the sequence has
    ``num_tokens = num_prompt_tokens + num_output_tokens`` tokens, and KV exists
    for the first ``num_computed_tokens`` of them. A step computes
    ``num_new_tokens`` more; when that reaches ``num_tokens`` the step samples
    one new token. So a whole-prompt prefill, a prefill chunk and a decode (the
    one token sampled last, ``num_tokens - num_computed_tokens == 1``) are one
    mechanism. After a preemption (recompute) the KV is dropped and the request
    computes its prompt and output tokens again.

    Attributes:
        seq_id: dense integer id (index of submission).
        request: the immutable request.
        status: :class:`SeqStatus`.
        num_output_tokens: tokens generated so far.
        num_computed_tokens: tokens whose KV is in the cache (or is being
            written by the step in flight).
        output_token_ids: generated ids when the backend reports them (executor).
        num_cached_prompt_tokens: prefix-cache hit of the first admission
            (tokens); None before it.
        num_preemptions: times it was preempted.
        admitted_s: start time of the first step that scheduled it; None before.
        finish_s: end time of the step that produced its last token, or the time
            it was rejected/aborted; None while unfinished.
        reject_reason: why it was rejected ("" otherwise).
        stays: one ``[first_token_step, last_step]`` pair per stay in the running
            set (one per admission): the step that sampled its first token of the
            stay (None until then) and the step it left in (None while running).
        stop_reason: "length", "stop" (EOS/stop token), "abort", or "".
        in_prefill: True from an admission until the step that completes its
            (re)prefill (which samples a token); then it decodes.
        block_hashes: chained hashes of its full prompt blocks, computed once
            by the BlockManager.
        prefix_hit: the BlockManager's memo of this request's prefix-cache hit
            (see ``BlockManager.lookup``).
        kv_slots: tokens its KV blocks hold (kept by the BlockManager).
        admission_index: order of its current stay's admission (the scheduler's).
        num_prompt_tokens: the request's prompt length (tokens).
        max_output_tokens: the request's output length limit (tokens).
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
        "stays",
        "stop_reason",
        "in_prefill",
        "block_hashes",
        "prefix_hit",
        "kv_slots",
        "admission_index",
        "num_prompt_tokens",
        "max_output_tokens",
    )

    def __init__(self, seq_id: int, request: Request) -> None:
        self.seq_id = seq_id
        self.request = request
        self.status = SeqStatus.WAITING
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.output_token_ids: list[int] = []
        self.num_cached_prompt_tokens: int | None = None
        self.num_preemptions = 0
        self.admitted_s: float | None = None
        self.finish_s: float | None = None
        self.reject_reason = ""
        self.stays: list[list[int | None]] = []
        self.stop_reason = ""
        self.in_prefill = False
        self.block_hashes: list[int] | None = None
        self.prefix_hit: object | None = None
        self.kv_slots = 0  # tokens its KV blocks hold (kept by the BlockManager)
        self.admission_index = -1  # order of its current stay's admission (the scheduler's)
        # the request's lengths, copied for hot loops (a Request is immutable)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.max_output_tokens = request.max_output_tokens

    @property
    def request_id(self) -> str:
        """The request's id."""
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def arrival_time_s(self) -> float:
        """Arrival time in seconds."""
        return self.request.arrival_time_s

    @property
    def remaining_output_tokens(self) -> int:
        """Output tokens left before the length limit."""
        return self.max_output_tokens - self.num_output_tokens

    @property
    def is_done(self) -> bool:
        """True once finished or rejected."""
        return self.status in (SeqStatus.FINISHED, SeqStatus.REJECTED)

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Token ids ``[start, end)`` of prompt plus output (needs prompt ids; executor).

        Raises:
            ValueError: if the request has no prompt token ids.
        """
        ids = self.request.prompt_token_ids
        if ids is None:
            raise ValueError(
                f"request {self.request_id} has no prompt token ids; the executor needs "
                "them (roseinfer.workloads.fit.with_token_ids makes them up for a trace)"
            )
        end = self.num_tokens if end is None else end
        num_prompt = len(ids)
        if end <= num_prompt:
            return list(ids[start:end])
        out = self.output_token_ids
        if start >= num_prompt:
            return out[start - num_prompt : end - num_prompt]
        return [*ids[start:], *out[: end - num_prompt]]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
