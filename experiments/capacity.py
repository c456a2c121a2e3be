"""Capacity search: the highest request rate whose goodput meets SLOs.

As Vidur-Search (Agrawal et al., "Vidur", MLSys 2024) finds a deployment's
capacity, the search re-simulates the workload at different request rates and
bisects on the rate. A rate *passes* when at least ``attainment`` of all
submitted requests (rejected ones count as misses) finish within every SLO
(TTFT, TPOT, E2EL in ms): the SLO-attainment definition of goodput of DistServe
(Zhong et al., OSDI 2024), whose 90% default we keep.

Search: probe ``min_rate``; if it fails the capacity is 0. Otherwise double
the rate until one fails or ``max_rate`` passes (then ``max_rate`` is
reported, a lower bound), and bisect between the last pass and the first fail
until ``(fail - pass) <= tolerance * pass``. The result is the highest rate
that passed, so it is within ``tolerance`` (relative) below the true boundary
for this seed, assuming attainment falls with the rate. Every probe re-draws
arrivals with the same seed (common random numbers), so two configurations
are compared on the same arrival pattern; repeat with other seeds to see the
spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from roseinfer.experiments.sweep import GridInputs, GridPoint, run_point

DEFAULT_ATTAINMENT = 0.9  # DistServe's SLO attainment target
DEFAULT_TOLERANCE = 0.05  # relative width of the final bracket


@dataclass(slots=True)
class CapacitySearch:
    """Search settings (see the module docstring).

    Attributes:
        slos_ms: SLOs in ms, e.g. ``{"ttft": 2000.0, "tpot": 100.0}``.
        min_rate: first rate probed (req/s, > 0).
        max_rate: highest rate probed (req/s).
        tolerance: relative bracket width at which bisection stops (> 0).
        attainment: share of requests that must meet every SLO, in (0, 1].

    Raises:
        ValueError: on a bad setting.
    """

    slos_ms: Mapping[str, float]
    min_rate: float = 0.25
    max_rate: float = 256.0
    tolerance: float = DEFAULT_TOLERANCE
    attainment: float = DEFAULT_ATTAINMENT

    def __post_init__(self) -> None:
        if not self.slos_ms:
            raise ValueError("capacity needs at least one SLO, e.g. --goodput ttft:2000")
        if not 0 < self.min_rate <= self.max_rate or math.isinf(self.max_rate):
            raise ValueError(
                f"need 0 < --min-rate <= --max-rate < inf, got {self.min_rate}, {self.max_rate}"
            )
        if self.tolerance <= 0:
            raise ValueError(f"--tolerance must be > 0, got {self.tolerance}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")


@dataclass(slots=True)
class CapacityResult:
    """The outcome of one search.

    Attributes:
        capacity_rate: highest rate that passed (req/s); 0 when ``min_rate`` failed.
        probes: ``(rate, attainment, passed)`` of every probe, in probe order.
        capped: True when ``max_rate`` itself passed (capacity is at least that).
    """

    capacity_rate: float
    probes: list[tuple[float, float, bool]] = field(default_factory=list)
    capped: bool = False


def find_capacity(
    attainment_at: Callable[[float], float], search: CapacitySearch
) -> CapacityResult:
    """Bisect on the request rate (see the module docstring).

    Args:
        attainment_at: simulates at a rate (req/s) and returns the share of
            requests meeting every SLO.
        search: the settings.
    """
    result = CapacityResult(0.0)

    def passes(rate: float) -> bool:
        value = attainment_at(rate)
        ok = value >= search.attainment
        result.probes.append((rate, value, ok))
        return ok

    if not passes(search.min_rate):
        return result
    good, bad = search.min_rate, math.inf
    while math.isinf(bad):
        rate = min(good * 2, search.max_rate)
        if rate <= good:  # max_rate passed
            result.capacity_rate, result.capped = good, True
            return result
        if passes(rate):
            good = rate
        else:
            bad = rate
    while bad - good > search.tolerance * good:
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    result.capacity_rate = good
    return result


def slo_attainment(summary: Mapping[str, Any], num_requests: int) -> float:
    """Share of ``num_requests`` meeting every SLO, from a summary made with
    ``goodput`` (``request_goodput`` x ``duration``)."""
    if num_requests == 0 or not summary.get("duration"):
        return 0.0
    good = summary["request_goodput"] * summary["duration"]
    return 0.0 if math.isnan(good) else round(good) / num_requests


def search_point(point: GridPoint, inputs: GridInputs, search: CapacitySearch) -> dict:
    """The capacity of one sweep configuration (its rate axis is searched).

    Returns:
        ``variant``, ``router``, ``num_replicas``, ``seed``, ``capacity_rate``
        (req/s), ``capped``, ``num_probes`` and the probes as text.
    """
    slos = dict(search.slos_ms)
    inputs = GridInputs(inputs.requests, inputs.base, inputs.cost_model, inputs.burstiness, slos)
    num = len(inputs.requests)

    def attainment_at(rate: float) -> float:
        probe = GridPoint(
            point.index, point.variant, point.overrides, rate, point.num_replicas, point.seed
        )
        row = run_point(probe, inputs)
        return slo_attainment(row, num)

    found = find_capacity(attainment_at, search)
    return {
        "variant": point.variant,
        "router": str(point.overrides.get("router", "")),
        "num_replicas": point.num_replicas,
        "seed": point.seed,
        "capacity_rate": found.capacity_rate,
        "capped": found.capped,
        "num_probes": len(found.probes),
        "probes": " ".join(f"{r:.3g}:{a:.2f}{'+' if ok else '-'}" for r, a, ok in found.probes),
    }
