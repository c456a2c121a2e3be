"""Synthetic workloads: the seeds' ``benchmark_streaming`` request shapes.

:func:`synthetic` makes requests like the seed posts' benchmark client;
``SEED_WORKLOADS`` names the request mix of each seed post's experiment (the
flags each post compared live next to the benchmark that runs them,
``benchmarks/seed_recipes.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from roseinfer.request import Request
from roseinfer.workloads.errors import WorkloadError

GPT2_VOCAB_SIZE = 50257
UNIQUE_SUFFIX_TOKENS = 3
"""Tokens appended by ``synthetic(unique_prompts=True)``, like the seeds' ``" [i]"``
(GPT-2: ``' ['``, ``'i'``, ``']'``)."""


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of :func:`synthetic` (the seeds' ``benchmark_streaming`` flags).

    Attributes:
        num_requests: requests to make (``--num-requests``).
        prompt_tokens: tokens of the base prompt (``--prompt "Hello"`` = 1 GPT-2 token).
        prompt_repeats: base-prompt repeat counts cycled per request
            (``--prompt-repeats``); None = 1 for all.
        output_tokens: output tokens per request (``--max-new-tokens`` with
            ``--no-stop-on-eos``).
        submit_interval_s: seconds between arrivals (``--submit-interval-ms`` / 1000).
        unique_prompts: append a distinct ``UNIQUE_SUFFIX_TOKENS``-token suffix
            per request (``--unique-prompts``: ``f"{p} [{i}]"``).
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: seeds the base prompt's token ids.

    Raises:
        WorkloadError: on a non-positive count or length, or a negative interval
            or seed.
    """

    num_requests: int
    prompt_tokens: int = 4
    prompt_repeats: tuple[int, ...] | None = None
    output_tokens: int = 32
    submit_interval_s: float = 0.0
    unique_prompts: bool = True
    vocab_size: int = GPT2_VOCAB_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompt_repeats is not None:
            object.__setattr__(self, "prompt_repeats", tuple(self.prompt_repeats))
        for name in ("num_requests", "prompt_tokens", "output_tokens", "vocab_size"):
            if getattr(self, name) <= 0:
                raise WorkloadError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prompt_repeats is not None and (
            not self.prompt_repeats or min(self.prompt_repeats) <= 0
        ):
            raise WorkloadError(
                f"prompt_repeats needs positive integers, got {self.prompt_repeats}"
            )
        if self.seed < 0:
            raise WorkloadError(f"seed must be >= 0, got {self.seed}")
        if not self.submit_interval_s >= 0:
            raise WorkloadError(f"submit_interval_s must be >= 0, got {self.submit_interval_s}")
        if self.unique_prompts and self.num_requests > self.vocab_size**2:
            raise WorkloadError(
                f"unique_prompts supports at most vocab_size**2 = {self.vocab_size**2} "
                f"requests, got {self.num_requests}; raise vocab_size"
            )


def synthetic(
    num_requests: int,
    *,
    prompt_tokens: int = 4,
    prompt_repeats: Sequence[int] | None = None,
    output_tokens: int = 32,
    submit_interval_s: float = 0.0,
    unique_prompts: bool = True,
    vocab_size: int = GPT2_VOCAB_SIZE,
    seed: int = 0,
) -> list[Request]:
    """Requests like the seeds' ``benchmark_streaming`` makes, with token ids.

    Request i (id ``"syn-{i}"``) arrives at ``i * submit_interval_s`` seconds;
    its prompt is the base prompt (``prompt_tokens`` ids drawn once from
    ``default_rng(seed)``) repeated ``prompt_repeats[i % len(prompt_repeats)]``
    times, plus, with ``unique_prompts``, a ``UNIQUE_SUFFIX_TOKENS``-token suffix
    (a marker id, then i in base ``vocab_size``) that differs per request, like
    the seeds' ``" [i]"``. So ``num_prompt_tokens = prompt_tokens * repeat + 3``
    (unique) or ``prompt_tokens * repeat`` (shared: every prompt with the same
    repeat is identical, so the prefix cache hits on its full blocks).
    NOTE: unique prompts still share the repeated base as a prefix, so a
    block-hash prefix cache hits on its full blocks (the seeds' whole-prompt
    cache did not); the seed variants turn prefix caching off where the post
    had no hits.

    Example: ``prompt_tokens=1`` (GPT-2 "Hello") with unique prompts gives 4
    tokens per short prompt, reproducing the seeds' printed totals (see
    ``SEED_WORKLOADS``).

    Raises:
        WorkloadError: see :class:`SyntheticSpec`.
    """
    spec = SyntheticSpec(
        num_requests,
        prompt_tokens,
        None if prompt_repeats is None else tuple(prompt_repeats),
        output_tokens,
        submit_interval_s,
        unique_prompts,
        vocab_size,
        seed,
    )
    return generate(spec)


def generate(spec: SyntheticSpec) -> list[Request]:
    """The requests :class:`SyntheticSpec` describes (see :func:`synthetic`)."""
    rng = np.random.default_rng(spec.seed)
    base = tuple(rng.integers(0, spec.vocab_size, size=spec.prompt_tokens).tolist())
    marker = int(rng.integers(0, spec.vocab_size))
    repeats = spec.prompt_repeats or (1,)
    out = []
    for i in range(spec.num_requests):
        ids = base * repeats[i % len(repeats)]
        if spec.unique_prompts:
            ids += (marker, i // spec.vocab_size, i % spec.vocab_size)
        arrival_s = i * spec.submit_interval_s
        out.append(Request(f"syn-{i}", arrival_s, len(ids), spec.output_tokens, ids))
    return out


@dataclass(frozen=True)
class SeedWorkload:
    """The request mix of one seed post's benchmark.

    Attributes:
        seed_file: the post in ``../shared/seeds/``.
        spec: the benchmark client's flags as a :class:`SyntheticSpec`.
        num_prompt_tokens_total: the post's printed "Prompt tokens (total)".
        num_output_tokens_total: the post's printed "Completion tokens (total)".
    """

    seed_file: str
    spec: SyntheticSpec
    num_prompt_tokens_total: int
    num_output_tokens_total: int


SEED_WORKLOADS: dict[str, SeedWorkload] = {
    # 003_bf58523580b0c411.txt: --prompt "Hello" --unique-prompts --num-requests 32
    # --max-new-tokens 8 --no-stop-on-eos. Prints 128 / 256 tokens.
    "027": SeedWorkload(
        "003_bf58523580b0c411.txt", SyntheticSpec(32, 1, output_tokens=8), 128, 256
    ),
    # 001_d7fea02014171b97.txt: --prompt "Hello" --prompt-repeats 1,1,1,64 --unique-prompts
    # --num-requests 32 --submit-interval-ms 20 --max-new-tokens 32 --no-stop-on-eos.
    # Prints 632 / 1024 tokens: 24 x 4 + 8 x (64 + 3).
    "031": SeedWorkload(
        "001_d7fea02014171b97.txt",
        SyntheticSpec(32, 1, prompt_repeats=(1, 1, 1, 64), submit_interval_s=0.020),
        632,
        1024,
    ),
    # 002_9726b183f600ca55.txt: --prompt "Hello" --prompt-repeats 1,1,1,64 --unique-prompts
    # --num-requests 128 --submit-interval-ms 5 --max-new-tokens 32 --no-stop-on-eos.
    # Prints 2528 / 4096 tokens: 96 x 4 + 32 x 67.
    "032": SeedWorkload(
        "002_9726b183f600ca55.txt",
        SyntheticSpec(128, 1, prompt_repeats=(1, 1, 1, 64), submit_interval_s=0.005),
        2528,
        4096,
    ),
    # 000_315f5f351c27c002.txt: --prompt "Hello" --prompt-repeats 512,1,1,1 --unique-prompts
    # --num-requests 128 --submit-interval-ms 0 --max-new-tokens 32 --no-stop-on-eos.
    # Prints 16864 / 4096 tokens: 32 x (512 + 3) + 96 x 4.
    "033": SeedWorkload(
        "000_315f5f351c27c002.txt",
        SyntheticSpec(128, 1, prompt_repeats=(512, 1, 1, 1)),
        16864,
        4096,
    ),
    # 004_7f2c034a10ee99fa.txt: --prompt "Hello" --unique-prompts --num-requests 32
    # --max-new-tokens 8 --no-stop-on-eos. Prints 128 / 256 tokens.
    "004-prefix": SeedWorkload(
        "004_7f2c034a10ee99fa.txt", SyntheticSpec(32, 1, output_tokens=8), 128, 256
    ),
    # NOTE: "-shared" was not run in the post. Its prefix cache was keyed by whole
    # prompt; ours hashes full KV blocks, which a 1-token prompt never fills, so the
    # shared variant uses a 64-token prompt (4 blocks of 16) to give the cache hits.
    "004-prefix-shared": SeedWorkload(
        "004_7f2c034a10ee99fa.txt",
        SyntheticSpec(32, 64, output_tokens=8, unique_prompts=False),
        32 * 64,
        256,
    ),
}
"""The seed posts' request mixes by experiment name (``--workload seed-NAME``)."""


def seed_workload(name: str, **overrides: Any) -> list[Request]:
    """The requests of seed experiment ``name``, with :func:`synthetic` keywords replaced.

    Example: ``seed_workload("033", num_requests=256, seed=1)``.

    Raises:
        WorkloadError: on an unknown name (lists the known ones) or override key.
    """
    if name not in SEED_WORKLOADS:
        raise WorkloadError(f"unknown seed experiment {name!r}; known: {', '.join(SEED_WORKLOADS)}")
    known = [f.name for f in dataclasses.fields(SyntheticSpec)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise WorkloadError(f"unknown workload keys {unknown}; known: {', '.join(known)}")
    return generate(dataclasses.replace(SEED_WORKLOADS[name].spec, **overrides))
