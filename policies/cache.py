"""Prefix-cache-aware admission: ``lpm`` (longest prefix match) with an aging bound."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roseinfer import hookimpl
from roseinfer.interface import CHUNK_HEAD_OPTION, AdmissionPolicy, PolicyContext, PolicyOption
from roseinfer.sequence import Sequence as Seq


class LongestPrefixMatch(AdmissionPolicy):
    """Longest cached prefix first, with aging so cold requests are not starved.

    Rank: a request that has waited at least ``--lpm-aging-s`` since arrival is
    *aged* and goes before every other, aged ones in arrival order; the rest by
    most prompt tokens already in the prefix cache (``num_tokens - cost``).
    Without aging (SGLang's ``--schedule-policy lpm``,
    python/sglang/srt/managers/schedule_policy.py) a stream of warm requests
    starves cold ones (SGLang #31953); with it, a request waits at most the
    aging bound plus the service of the requests that arrived before it.
    """

    name = "lpm"
    description = "longest cached prefix first; FIFO for requests older than --lpm-aging-s"
    uses_token_budget = True
    guarantees = ("ranked-prefix", "aging-bound")
    option_specs = (
        PolicyOption(
            "lpm_aging_s",
            float,
            5.0,
            "lpm: a request waiting this long (s) goes first, in arrival order (default 5)",
            minimum=0.0,
        ),
        CHUNK_HEAD_OPTION,
    )

    def __init__(self, options=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self._aging_s = float(self.opt("lpm_aging_s"))

    def input_warnings(self, requests: Sequence[Any], config: Any = None) -> list[str]:
        """lpm ranks on cached prefixes: none without prefix caching or prompt identity."""
        if config is not None and not getattr(config, "enable_prefix_caching", True):
            return ["lpm: prefix caching is off (--enable-prefix-caching), so nothing is "
                    "ever cached and lpm admits in arrival order, as fifo"]  # fmt: skip
        if requests and not any(
            r.prompt_token_ids is not None or r.prefix_hash_ids is not None for r in requests
        ):
            return ["lpm: no request carries prompt token ids or prefix hash ids, so no two "
                    "prompts share a cached prefix and lpm admits in arrival order, as fifo"]  # fmt: skip
        return []

    def rank(self, seq: Seq, ctx: PolicyContext) -> tuple[int, float, int]:
        """(0, arrival, id) when aged, else (1, -cached prompt tokens, id)."""
        arrival = seq.request.arrival_time_s
        if ctx.now_s - arrival >= self._aging_s:
            return (0, arrival, seq.seq_id)
        return (1, -float(seq.num_tokens - ctx.cost(seq)), seq.seq_id)


@hookimpl
def register_admission_policies() -> list[type[AdmissionPolicy]]:
    """The cache-aware policies."""
    return [LongestPrefixMatch]
