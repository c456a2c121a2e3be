"""The seed posts' experiments: which scheduler flags each post compared.

The request mix of each post is ``roseinfer.workloads.SEED_WORKLOADS``; this
file adds what the post varied (``--backend`` independent), as keys of
``roseinfer.experiments.sweep.apply_overrides``. Used by ``seed_experiments.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from roseinfer.workloads import SEED_WORKLOADS, SeedWorkload

# NOTE: the posts' --max-batch-size 8 caps each decode forward, not the set of
# admitted sessions (their prefill admits up to --prefill-max-batch-size and all of
# them stay active). Our running set is also the decode batch (vLLM's max_num_seqs),
# so the closest match is a running cap equal to the admission cap; with
# max_num_seqs=8 admission would be seat-bound and the budget never bind.
_SEATS_32 = {"max_num_seqs": 32, "prefill_max_seqs": 32}
_SEATS_128 = {"max_num_seqs": 128, "prefill_max_seqs": 128}


@dataclass(frozen=True)
class SeedExperiment:
    """One seed post's before/after comparison.

    Attributes:
        title: what the post studies.
        workload: its request mix (post file, client flags, printed totals).
        variants: label -> scheduler overrides of each run the post compares.
        device: where the post ran (GPT-2 via HF transformers).
    """

    title: str
    workload: SeedWorkload
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "cpu"


SEED_EXPERIMENTS: dict[str, SeedExperiment] = {
    # Before/after is an implementation change (add_request only enqueues), not a flag.
    "027": SeedExperiment(
        "027 pending queue admission: a burst of 32 short prompts",
        SEED_WORKLOADS["027"],
        {"fifo": {"policy": "fifo", "enable_prefix_caching": False}},
    ),
    # NOTE: the post kept its prefix cache on, but that cache was keyed by the whole
    # prompt, so unique prompts never hit; our block-hash cache would hit the shared
    # "Hello" x 64 blocks, so it is off here to match the post.
    "031": SeedExperiment(
        "031 prefill token budget: 3 short + 1 long prompt, 20 ms apart",
        SEED_WORKLOADS["031"],
        {
            "fifo": {**_SEATS_32, "enable_prefix_caching": False, "policy": "fifo"},
            "budget-224": {
                **_SEATS_32,
                "enable_prefix_caching": False,
                "policy": "budget",
                "prefill_max_tokens": 224,
            },
        },
    ),
    "032": SeedExperiment(
        "032 decode-first: prefill vs decode order under a steady stream",
        SEED_WORKLOADS["032"],
        {
            "prefill-first": {**_SEATS_128, "enable_prefix_caching": False},
            "decode-first": {
                **_SEATS_128,
                "enable_prefix_caching": False,
                "loop_order": "decode-first",
            },
        },
        device="cuda",
    ),
    "033": SeedExperiment(
        "033 lookahead packing: oversize heads block short prompts",
        SEED_WORKLOADS["033"],
        {
            "budget": {
                **_SEATS_128,
                "enable_prefix_caching": False,
                "policy": "budget",
                "prefill_max_tokens": 256,
            },
            "pack+ff8": {
                **_SEATS_128,
                "enable_prefix_caching": False,
                "policy": "pack",
                "prefill_max_tokens": 256,
                "lookahead": 64,
                "force_fifo_every": 8,
            },
        },
        device="cuda",
    ),
    # The post's before/after is an implementation change: with the prefix cache on,
    # its "before" prefilled every cache miss on its own, its "after" batched them.
    # Ours always batches; one request per prefill step (prefill_max_seqs=1), with
    # prefill steps run while any can be formed (prefill-priority), is its "before":
    # the serial prefills back to back within one admission round, decodes after.
    "004-prefix": SeedExperiment(
        "004 prefix cache with batched prefill: unique prompts",
        SEED_WORKLOADS["004-prefix"],
        {
            "serial-miss-prefill": {
                "enable_prefix_caching": True,
                "prefill_max_seqs": 1,
                "loop_order": "prefill-priority",
            },
            "batched-prefill": {"enable_prefix_caching": True},
        },
    ),
    "004-prefix-shared": SeedExperiment(
        "004 prefix cache with batched prefill: shared prompts",
        SEED_WORKLOADS["004-prefix-shared"],
        {  # before (cache off) -> after (cache on), as the README's tables read
            "no-prefix-cache": {"enable_prefix_caching": False},
            "prefix-cache": {"enable_prefix_caching": True},
        },
    ),
}
