"""Slicing a workload and re-drawing or scaling its arrival times."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from roseinfer.request import Request
from roseinfer.workloads.errors import WorkloadError


def select(
    requests: Sequence[Request],
    *,
    num_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
    skip: int = 0,
) -> list[Request]:
    """A window of a workload, re-based so the first kept request arrives at 0 s.

    Order of operations: keep arrivals in ``[start_s, end_s]`` (seconds, both
    ends inclusive, None = open), then drop the first ``skip``, then keep the
    first ``num_requests`` (None = all). The result may be empty.

    Raises:
        WorkloadError: on ``num_requests <= 0`` or ``skip < 0``.
    """
    if num_requests is not None and num_requests <= 0:
        raise WorkloadError(f"num_requests must be > 0 (or None for all), got {num_requests}")
    if skip < 0:
        raise WorkloadError(f"skip must be >= 0, got {skip}")
    lo = -math.inf if start_s is None else start_s
    hi = math.inf if end_s is None else end_s
    kept = [r for r in _by_arrival(requests) if lo <= r.arrival_time_s <= hi][skip:]
    kept = kept if num_requests is None else kept[:num_requests]
    return _rebase(kept)


def _by_arrival(requests: Iterable[Request]) -> list[Request]:
    return sorted(requests, key=lambda r: r.arrival_time_s)


def _rebase(requests: list[Request]) -> list[Request]:
    if not requests or requests[0].arrival_time_s == 0.0:
        return list(requests)
    t0 = requests[0].arrival_time_s
    return [dataclasses.replace(r, arrival_time_s=r.arrival_time_s - t0) for r in requests]


def _with_arrivals(requests: Sequence[Request], arrival_s: np.ndarray) -> list[Request]:
    return [dataclasses.replace(r, arrival_time_s=float(t)) for r, t in zip(requests, arrival_s)]


def rescale_arrivals(
    requests: Sequence[Request],
    *,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[Request]:
    """New arrival times at ``request_rate`` req/s, as vLLM ``benchmark_serving``.

    Requests keep their order and lengths. ``request_rate=inf`` puts every
    arrival at 0 s. Otherwise the gaps between consecutive requests are drawn
    from Gamma(shape=burstiness, scale=1 / (request_rate * burstiness)) with
    ``numpy.random.default_rng(seed)``: mean gap 1 / request_rate seconds,
    coefficient of variation 1 / sqrt(burstiness) (burstiness 1 = Poisson,
    < 1 burstier, > 1 more regular). As in vLLM (which sends a request, then
    sleeps a gap), the first request arrives at 0 s and n requests use n - 1 gaps.

    Raises:
        WorkloadError: on a rate or burstiness that is not > 0.
    """
    if not request_rate > 0:
        raise WorkloadError(f"request_rate must be > 0 req/s (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise WorkloadError(f"burstiness must be a finite number > 0, got {burstiness}")
    num = len(requests)
    if num == 0:
        return []
    if math.isinf(request_rate):
        return _with_arrivals(requests, np.zeros(num))
    rng = np.random.default_rng(seed)
    gaps_s = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return _with_arrivals(requests, np.concatenate([[0.0], np.cumsum(gaps_s)]))


def time_scale(requests: Sequence[Request], factor: float) -> list[Request]:
    """Arrival times multiplied by ``factor`` (0.5 replays a trace twice as fast).

    Raises:
        WorkloadError: on a factor that is not a finite number > 0.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise WorkloadError(f"factor must be a finite number > 0, got {factor}")
    times = np.array([r.arrival_time_s for r in requests], dtype=float)
    return _with_arrivals(requests, times * factor)
