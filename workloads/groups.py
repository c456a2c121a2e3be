"""Synthetic request groups: Poisson streams with their own tenant, priority and deadline.

A :class:`GroupSpec` describes one stream (rate, uniform prompt and output
length ranges, and the request fields the policies read); :func:`groups`
merges several into one workload. ``two_tenant`` is the fairness workload
(a heavy tenant sending 10x a light one's load, same lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from roseinfer.request import Request
from roseinfer.workloads.errors import WorkloadError


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One Poisson stream of requests.

    Attributes:
        name: prefix of the request ids (``{name}-{i}``).
        rate: mean arrivals per second (> 0).
        prompt_tokens: (low, high) inclusive uniform range of prompt lengths.
        output_tokens: (low, high) inclusive uniform range of output lengths.
        tenant: the requests' tenant (None: none).
        priority: their priority (lower is more urgent).
        deadline_s: their first-token deadline (s after arrival), or None.

    Raises:
        WorkloadError: on a non-positive rate, an empty or non-positive range,
            or a non-positive deadline.
    """

    name: str
    rate: float
    prompt_tokens: tuple[int, int] = (200, 1500)
    output_tokens: tuple[int, int] = (50, 300)
    tenant: str | None = None
    priority: int = 0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise WorkloadError(f"group {self.name}: rate must be > 0 req/s, got {self.rate}")
        for what, (lo, hi) in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if not 0 < lo <= hi:
                raise WorkloadError(
                    f"group {self.name}: {what} range must be 0 < low <= high, got {(lo, hi)}"
                )
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise WorkloadError(f"group {self.name}: deadline_s must be > 0, got {self.deadline_s}")


def groups(specs: Sequence[GroupSpec], duration_s: float, seed: int = 0) -> list[Request]:
    """Requests of every group arriving in ``[0, duration_s)``, merged by arrival.

    Raises:
        WorkloadError: on a non-positive duration, duplicate group names, or no request.
    """
    if not duration_s > 0:
        raise WorkloadError(f"duration_s must be > 0, got {duration_s}")
    if len({s.name for s in specs}) != len(specs):
        raise WorkloadError("group names must be unique (they prefix the request ids)")
    rng = np.random.default_rng(seed)
    reqs: list[Request] = []
    for spec in specs:
        gaps = rng.exponential(1.0 / spec.rate, size=int(spec.rate * duration_s * 1.5) + 16)
        times = np.cumsum(gaps)
        times = times[times < duration_s]
        prompts = rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1, len(times))
        outputs = rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1, len(times))
        reqs += [
            Request(
                f"{spec.name}-{i}",
                float(t),
                int(p),
                int(o),
                tenant=spec.tenant,
                priority=spec.priority,
                deadline_s=spec.deadline_s,
            )
            for i, (t, p, o) in enumerate(zip(times, prompts, outputs))
        ]
    if not reqs:
        raise WorkloadError("the groups produced no request; raise a rate or duration_s")
    reqs.sort(key=lambda r: r.arrival_time_s)
    return reqs


def two_tenant(
    light_rate: float = 2.0,
    ratio: float = 10.0,
    duration_s: float = 120.0,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (200, 1500),
    output_tokens: tuple[int, int] = (50, 300),
) -> list[Request]:
    """Tenants ``heavy`` (``ratio`` x the rate) and ``light``, same length ranges."""
    specs = [
        GroupSpec("heavy", light_rate * ratio, prompt_tokens, output_tokens, tenant="heavy"),
        GroupSpec("light", light_rate, prompt_tokens, output_tokens, tenant="light"),
    ]
    return groups(specs, duration_s, seed)
