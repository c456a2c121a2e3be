"""Capacity search: the highest steady-state request rate whose requests meet SLOs.

As Vidur-Search (Agrawal et al., "Vidur", MLSys 2024) finds a deployment's
capacity, the search simulates the workload at different request rates and
bisects on the rate. Each probe is a **steady-state** measurement, not a
finite burst (a burst of N requests drains after its last arrival, so a short
one passes rates the system cannot sustain: 42 req/s with 400 requests where
the steady state holds 19):

- **Workload.** Requests are drawn with replacement from the whole workload
  (their lengths, prefix ids, tenants: the mix), arriving as a Poisson (or
  gamma, ``burstiness``) process at the probed rate for a horizon of simulated
  time. A request count (``--num-requests``) is the fewest requests a probe
  simulates, not a cut of the trace: the answer is the mix's, however long
  the probes.
- **Horizon.** ``H = max(min_duration_s, 2 x tau / tolerance)``, where ``tau``
  is the system's own time scale: the largest SLO in seconds (a TPOT SLO
  times the mean output length). A rate ``tolerance`` above capacity builds a
  backlog whose wait grows by about ``tolerance`` seconds per second, so after
  ``tau / tolerance`` seconds a request waits longer than the SLO; measuring
  over ``2 x`` that fails such a rate (more than 10% of the measured requests
  then miss), so the answer stays put when the workload grows. The horizon
  also holds at least 2,000 measured requests, so the attainment's sampling
  error is under a percentage point (sqrt(0.9 x 0.1 / 2000) = 0.7%).
- **Window.** Requests arriving in the first 20% of the horizon (warm-up from
  an empty system) and the last 10% (the drain, with fewer competitors) are
  simulated but not measured.
- **Criteria.** A criterion ``metric:MS`` counts toward the joint attainment:
  the share of measured requests meeting every such SLO must reach
  ``attainment`` (DistServe's goodput definition, 90% by default; a rejected
  request misses). A criterion ``metric:pXX:MS`` holds when that metric's XX-th
  percentile over the measured requests is at most MS. Metrics: ``ttft``,
  ``tpot``, ``e2el`` (vLLM bench's) and ``queue`` (arrival to first
  admission, Vidur-Search's scheduling delay; e.g. ``queue:p99:5000``).

Search: a fluid estimate brackets it: the saturation throughput (every
drawn request at t = 0, requests / makespan), about the most the system can
sustain (a burst's KV pressure can make it a little lower). The first probe
is 0.55x of it; the search steps up (x1.5, up to ``max_rate``) or down (x0.5,
down to ``min_rate``) to a pass and a fail, then bisects until ``(fail - pass) <= tolerance * pass``. The
answer is the highest rate that passed, within ``tolerance`` below the
boundary for this seed. Every probe draws with the same seed (common random
numbers), so configurations are compared on the same arrivals.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.calibration.cost_model import CostModel
from roseinfer.config import SchedulerConfig
from roseinfer.experiments.sweep import (
    GridInputs,
    GridPoint,
    point_layout,
    point_replicas,
    simulate_point,
)
from roseinfer.request import Request

DEFAULT_ATTAINMENT = 0.9  # DistServe's SLO attainment target
DEFAULT_TOLERANCE = 0.05  # relative width of the final bracket
DEFAULT_MIN_DURATION_S = 60.0  # shortest probe horizon (simulated s)
HORIZON_FACTOR = 2.0  # horizon = factor x time scale / tolerance (module docstring)
WARMUP_FRACTION = 0.2  # arrivals in the first 20% of the horizon are not measured
DRAIN_FRACTION = 0.1  # nor those in the last 10%
MEASURED_FRACTION = 1 - WARMUP_FRACTION - DRAIN_FRACTION
SATURATION_REQUESTS = 4000  # the fluid estimate bursts at most this many requests
MAX_PROBE_REQUESTS = 500_000  # a probe's horizon shrinks to hold at most this many
MIN_MEASURED_REQUESTS = 2000  # ... and grows to measure at least this many
# Caps, as a grid's size is capped: past them a search runs for hours and answers
# nothing finer (each is a flag's range; the error names it).
MIN_TOLERANCE = 1e-3  # bisection to 0.1% of the rate: 9 halvings from a 1.5x bracket
MAX_TOLERANCE = 0.5
MAX_DURATION_S = 3600.0  # --min-duration-s: one simulated hour
MAX_MEASURED_REQUESTS = 100_000  # --min-measured-requests: sampling error < 0.1 point
MAX_SLO_MS = 3_600_000.0  # an SLO of at most an hour (ms)
MAX_HORIZON_S = 86_400.0  # a probe spans at most a simulated day
CRITERION_METRICS = ("ttft", "tpot", "e2el", "queue")


@dataclass(frozen=True, slots=True)
class Criterion:
    """One SLO of a capacity search.

    Attributes:
        metric: ``ttft``, ``tpot``, ``e2el`` or ``queue`` (ms per request).
        threshold_ms: the SLO in ms (>= 0).
        percentile: None: the SLO counts toward the joint attainment; else the
            percentile (0-100] of the metric that must be <= the threshold.
    """

    metric: str
    threshold_ms: float
    percentile: float | None = None

    def __str__(self) -> str:
        p = "" if self.percentile is None else f"p{self.percentile:g}:"
        return f"{self.metric}:{p}{self.threshold_ms:g}"


def parse_criteria(specs: str | Iterable[str]) -> list[Criterion]:
    """Parse ``METRIC:MS`` or ``METRIC:pXX:MS`` tokens, e.g. ``"ttft:2000 tpot:p99:100"``.

    Raises:
        ValueError: on no tokens, a malformed one, an unknown metric, a threshold
            that is not a finite number >= 0, a percentile outside (0, 100], or a
            metric given twice.
    """
    tokens = [t for s in ([specs] if isinstance(specs, str) else specs) for t in s.split()]
    if not tokens:
        raise ValueError("capacity needs SLOs: --goodput ttft:MS [tpot:MS e2el:MS queue:pXX:MS]")
    out: list[Criterion] = []
    for token in tokens:
        parts = token.split(":")
        metric = parts[0].strip().lower()
        if metric not in CRITERION_METRICS or len(parts) not in (2, 3):
            raise ValueError(
                f"bad SLO {token!r}: expected METRIC:MS or METRIC:pXX:MS with METRIC one of "
                f"{', '.join(CRITERION_METRICS)} (e.g. ttft:2000, queue:p99:5000)"
            )
        percentile = None
        if len(parts) == 3:
            percentile = _number(token, parts[1].lower().removeprefix("p"))
            if not 0 < percentile <= 100:
                raise ValueError(f"bad SLO {token!r}: the percentile must be in (0, 100]")
        threshold = _number(token, parts[-1])
        if any(c.metric == metric for c in out):
            raise ValueError(f"SLO {metric!r} given twice")
        out.append(Criterion(metric, threshold, percentile))
    return out


def _number(token: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"bad SLO {token!r}: {text!r} is not a finite number >= 0")
    return value


@dataclass(slots=True)
class CapacitySearch:
    """Search settings (see the module docstring).

    Attributes:
        criteria: the SLOs (:func:`parse_criteria`); a ``{"ttft": MS}`` mapping
            is taken as joint-attainment criteria.
        min_rate: lowest rate probed (req/s, > 0); failing it gives capacity 0.
        max_rate: highest rate probed (req/s).
        tolerance: relative bracket width at which bisection stops (> 0, < 1).
        attainment: share of measured requests that must meet every joint SLO, in (0, 1].
        min_duration_s: shortest probe horizon (simulated s, > 0).
        min_requests: fewest requests a probe simulates (its horizon grows to
            hold them at the probed rate; 0: no floor).
        min_measured_requests: fewest requests a probe measures (after warm-up,
            before drain): the attainment's precision (>= 1).

    Raises:
        ValueError: on a bad setting (each names its flag).
    """

    criteria: Sequence[Criterion] | Mapping[str, float]
    min_rate: float = 0.01
    max_rate: float = 1e6
    tolerance: float = DEFAULT_TOLERANCE
    attainment: float = DEFAULT_ATTAINMENT
    min_duration_s: float = DEFAULT_MIN_DURATION_S
    min_requests: int = 0
    min_measured_requests: int = MIN_MEASURED_REQUESTS

    def __post_init__(self) -> None:
        if isinstance(self.criteria, Mapping):
            self.criteria = [Criterion(k, float(v)) for k, v in self.criteria.items()]
        if not self.criteria:
            raise ValueError("capacity needs at least one SLO, e.g. --goodput ttft:2000")
        if not 0 < self.min_rate <= self.max_rate < math.inf:
            raise ValueError(
                f"need 0 < --min-rate <= --max-rate < inf, got {self.min_rate}, {self.max_rate}"
            )
        if not MIN_TOLERANCE <= self.tolerance <= MAX_TOLERANCE:
            raise ValueError(
                f"--tolerance must be in [{MIN_TOLERANCE:g}, {MAX_TOLERANCE:g}], got {self.tolerance}"
            )
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")
        if not 0 < self.min_duration_s <= MAX_DURATION_S:
            raise ValueError(
                f"--min-duration-s must be in (0, {MAX_DURATION_S:g}], got {self.min_duration_s}"
            )
        if not 1 <= self.min_measured_requests <= MAX_MEASURED_REQUESTS:
            raise ValueError(
                f"--min-measured-requests must be in [1, {MAX_MEASURED_REQUESTS}], got "
                f"{self.min_measured_requests}"
            )
        for c in self.slos:
            if c.threshold_ms > MAX_SLO_MS:
                raise ValueError(
                    f"SLO {c} is longer than an hour ({MAX_SLO_MS:g} ms), the most a capacity "
                    "search measures; give a smaller --goodput threshold"
                )

    @property
    def slos(self) -> list[Criterion]:
        """The criteria (a mapping given at construction became criteria)."""
        return [c for c in self.criteria if isinstance(c, Criterion)]

    def horizon_s(self, mean_output_tokens: float) -> float:
        """A probe's horizon in simulated seconds (module docstring)."""
        scales = [
            c.threshold_ms / 1e3 * (mean_output_tokens if c.metric == "tpot" else 1.0)
            for c in self.slos
        ]
        horizon = max(self.min_duration_s, HORIZON_FACTOR * max(scales) / self.tolerance)
        return min(horizon, MAX_HORIZON_S)

    def expected_probes(self) -> int:
        """Probes a search usually takes: three to bracket the boundary from the fluid
        estimate (0.55x, 0.83x, 1.24x), then halvings of the 1.5x bracket down to the
        tolerance. A workload far from its estimate takes a few more."""
        return 3 + math.ceil(math.log2(0.5 / self.tolerance))


@dataclass(slots=True)
class CapacityResult:
    """The outcome of one search.

    Attributes:
        capacity_rate: highest rate that passed (req/s); 0 when ``min_rate`` failed.
        probes: ``(rate, attainment, passed)`` of every probe, in probe order
            (attainment of the joint SLOs; 1.0 when there are only percentile ones).
        capped: True when ``max_rate`` itself passed (capacity is at least that).
        estimate_rate: the fluid estimate the search started from (req/s; NaN if none).
    """

    capacity_rate: float
    probes: list[tuple[float, float, bool]] = field(default_factory=list)
    capped: bool = False
    estimate_rate: float = math.nan


Probe = Callable[[float], tuple[bool, float]]
"""Simulates at a rate (req/s): (passed, joint attainment)."""


def find_capacity(
    probe: Probe, search: CapacitySearch, estimate_rate: float | None = None
) -> CapacityResult:
    """Bracket from ``estimate_rate`` (default ``max_rate``) and bisect (module docstring)."""
    result = CapacityResult(0.0, estimate_rate=math.nan if estimate_rate is None else estimate_rate)
    lo, hi = search.min_rate, search.max_rate

    def passes(rate: float) -> bool:
        ok, value = probe(rate)
        result.probes.append((rate, value, ok))
        return ok

    top = hi if estimate_rate is None else min(hi, max(lo, 1.1 * estimate_rate))
    rate = min(top, max(lo, 0.5 * top))
    good, bad = 0.0, math.inf
    while True:  # bracket: a pass below a fail
        if passes(rate):
            good = rate
            if bad < math.inf:
                break
            if rate >= hi:
                result.capacity_rate, result.capped = rate, True
                return result
            rate = min(hi, rate * 1.5)
        else:
            bad = rate
            if good > 0:
                break
            if rate <= lo:
                return result
            rate = max(lo, rate * 0.5)
    while bad - good > search.tolerance * good:
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    result.capacity_rate = good
    return result


def probe_requests(
    pool: Sequence[Request], rate: float, horizon_s: float, burstiness: float, seed: int
) -> list[Request]:
    """Requests drawn from ``pool`` (with replacement) arriving at ``rate`` req/s
    (gamma gaps of shape ``burstiness``, 1 = Poisson) over ``horizon_s`` seconds;
    ids ``probe-{i}``. Deterministic in ``seed``; the i-th request is the same
    pool entry at every rate (common random numbers across probes)."""
    gap_rng, pick_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    expected = rate * horizon_s
    n_draw = int(expected + 6 * math.sqrt(expected) + 16)
    gaps = gap_rng.gamma(burstiness, 1.0 / (rate * burstiness), n_draw)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    arrivals = arrivals[arrivals < horizon_s]
    picks = pick_rng.integers(len(pool), size=len(arrivals))
    return [
        dataclasses.replace(pool[int(k)], request_id=f"probe-{i}", arrival_time_s=float(t))
        for i, (k, t) in enumerate(zip(picks, arrivals))
    ]


def request_metrics_ms(records: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT, E2EL and queueing delay in ms (inf where rejected);
    TPOT is 0 for a single output token (vLLM's goodput rule)."""
    done = (records["status"] == "finished").to_numpy()
    arrival = records["arrival_s"].to_numpy(dtype=float)
    first = records["first_token_s"].to_numpy(dtype=float)
    finish = records["finish_s"].to_numpy(dtype=float)
    admitted = records["admitted_s"].to_numpy(dtype=float)
    n_out = records["num_output_tokens"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out > 1, (finish - first) / np.maximum(n_out - 1, 1), 0.0)
    out = {
        "ttft": first - arrival,
        "tpot": tpot,
        "e2el": finish - arrival,
        "queue": admitted - arrival,
    }
    return {k: np.where(done, 1e3 * v, np.inf) for k, v in out.items()}


def judge(
    records: pd.DataFrame, criteria: Sequence[Criterion], attainment: float
) -> tuple[bool, float]:
    """(every criterion holds, joint attainment) over ``records``' requests."""
    if len(records) == 0:
        return True, 1.0
    values = request_metrics_ms(records)
    joint = [c for c in criteria if c.percentile is None]
    good = np.ones(len(records), dtype=bool)
    for c in joint:
        good &= values[c.metric] <= c.threshold_ms
    share = float(good.mean()) if joint else 1.0
    ok = share >= attainment if joint else True
    for c in criteria:
        if c.percentile is not None:
            ok &= bool(np.percentile(values[c.metric], c.percentile) <= c.threshold_ms)
    return ok, share


def measured(records: pd.DataFrame, horizon_s: float) -> pd.DataFrame:
    """The records of requests arriving in the measured window (module docstring)."""
    arrival = records["arrival_s"].to_numpy(dtype=float)
    lo, hi = WARMUP_FRACTION * horizon_s, (1 - DRAIN_FRACTION) * horizon_s
    return records[(arrival >= lo) & (arrival <= hi)]


def saturation_rate(point: GridPoint, inputs: GridInputs, pool: Sequence[Request]) -> float:
    """The fluid estimate: requests per simulated second when every request of
    ``pool`` (at most 4,000 of them) arrives at t = 0 (NaN if the run takes no time)."""
    burst = [dataclasses.replace(r, arrival_time_s=0.0) for r in pool[:SATURATION_REQUESTS]]
    result = simulate_point(point, inputs, burst)
    return len(burst) / result.duration_s if result.duration_s > 0 else math.nan


def fluid_capacity(
    requests: Sequence[Request], config: SchedulerConfig, cost_model: CostModel
) -> float:
    """The fluid estimate of one engine's capacity on ``requests`` (req/s): every
    request (at most 4,000) at t = 0, requests per simulated second to drain them
    (:func:`saturation_rate`). Rates around it (0.5x-1.2x) show a latency curve's knee.

    Raises:
        ValueError: on no requests.
    """
    if not requests:
        raise ValueError("fluid_capacity needs at least one request")
    inputs = GridInputs(list(requests), config, cost_model)
    return saturation_rate(GridPoint(0, "", {}, None, 1, 0), inputs, list(requests))


def search_point(
    point: GridPoint,
    inputs: GridInputs,
    search: CapacitySearch,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The steady-state capacity of one sweep configuration.

    Args:
        say: called with one line of progress: the plan once the fluid estimate
            is known (probes expected, requests per probe, an estimate of the wall
            time from the estimate's own speed), then one line per probe as it
            finishes (rate, pass or fail, attainment).

    Returns:
        ``variant``, ``router``, ``num_replicas``, ``replicas`` (``"4"``, or ``"1P+3D"`` for a
        disaggregated cluster), ``num_gpus``, ``seed``, ``capacity_rate`` (req/s),
        ``capacity_per_gpu`` (req/s per GPU, DistServe's per-GPU goodput),
        ``capped``, ``estimate_rate`` (the fluid estimate), ``horizon_s``,
        ``num_probes`` and the probes as text (``rate:attainment`` and ``+``/``-``).
    """
    pool = list(inputs.requests)
    mean_output = float(np.mean([r.max_output_tokens for r in pool])) if pool else 1.0
    horizon = search.horizon_s(mean_output)
    fewest = max(search.min_requests, search.min_measured_requests / MEASURED_FRACTION)
    label = point.variant or "search"

    def probe(rate: float) -> tuple[bool, float]:
        span = min(max(horizon, fewest / rate), MAX_PROBE_REQUESTS / rate)
        reqs = probe_requests(pool, rate, span, inputs.burstiness, point.seed)
        result = simulate_point(dataclasses.replace(point, request_rate=rate), inputs, reqs)
        ok, value = judge(measured(result.records, span), criteria, search.attainment)
        if say is not None:
            verdict = "pass" if ok else "fail"
            say(
                f"{label}: {rate:.4g} req/s {verdict} (attainment {value:.1%}, {len(reqs):,} requests)"
            )
        return ok, value

    criteria = search.slos
    start = time.perf_counter()
    estimate = saturation_rate(point, inputs, pool) if pool else math.nan
    if say is not None and not math.isnan(estimate):
        speed = min(len(pool), SATURATION_REQUESTS) / max(time.perf_counter() - start, 1e-9)
        per_probe = min(max(estimate * horizon, fewest), MAX_PROBE_REQUESTS)
        wall = search.expected_probes() * per_probe / speed
        say(
            f"{label}: fluid estimate {estimate:.4g} req/s; about {search.expected_probes()} "
            f"probes of about {per_probe:,.0f} requests ({horizon:.0f} simulated s), about "
            f"{wall:.0f} s wall"
        )
    found = find_capacity(probe, search, None if math.isnan(estimate) else estimate)
    num_gpus = sum(s.num_gpus for s in point_replicas(point, inputs))
    return {
        "variant": point.variant,
        "router": str(point.overrides.get("router", "")),
        "num_replicas": point.num_replicas,
        "replicas": point_layout(point, inputs),
        "num_gpus": num_gpus,
        "seed": point.seed,
        "capacity_rate": found.capacity_rate,
        "capacity_per_gpu": found.capacity_rate / num_gpus,
        "capped": found.capped,
        "estimate_rate": found.estimate_rate,
        "horizon_s": horizon,
        "num_probes": len(found.probes),
        "probes": " ".join(f"{r:.3g}:{a:.2f}{'+' if ok else '-'}" for r, a, ok in found.probes),
    }
