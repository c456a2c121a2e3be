"""Fidelity report: how well ``rose-sim`` predicts ``rose-run`` on the same requests.

Both backends run the same scheduler code, so on the same request list and the
same :class:`~roseinfer.config.SchedulerConfig` the only thing that differs is
the clock: a cost model here, the real step times there. :func:`run_fidelity`
runs every named scheduler configuration (policy x loop order) in the
simulator once and on the real executor ``repeats`` times, and reports:

* per combination and metric (p50/p90/p99 of TTFT, TPOT, ITL, E2EL in ms, and
  output throughput in tok/s) the relative error ``(sim - real) / real``, where
  ``real`` is the mean of the repeated real runs;
* the noise floor: the real-vs-real spread ``(max - min) / mean`` of the
  repeated real runs of the same combination (no fidelity claim below it);
* per metric the rank agreement between sim and real when the combinations are
  ordered by that metric: Kendall's tau (``scipy.stats.kendalltau``, tau-b),
  and the share of *resolved* pairs (their real difference exceeds both
  combinations' noise floors) that the simulator orders the same way.

The real side is a callable (:data:`RealRun`), so this module never imports
torch: ``roseinfer.executor.replay.ExecutorReplay`` is the executor's one.
Metrics follow ``roseinfer.metrics.summarize`` (vLLM bench's definitions).

Example::

    from roseinfer.simulator import load_profile
    from roseinfer.simulator.fidelity import default_combinations, run_fidelity
    profile = load_profile("p.json")
    combos = default_combinations(profile_config)
    report = run_fidelity(requests, combos, profile.cost_model(), real_run)
    print(report.table)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.config import SchedulerConfig
from roseinfer.metrics import summarize
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.simulator.cost_model import CostModel
from roseinfer.simulator.engine import simulate

FIDELITY_METRICS: tuple[str, ...] = tuple(
    f"p{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in (50, 90, 99)
) + ("output_throughput",)
"""Summary keys compared: latency percentiles (ms) and output throughput (tok/s)."""

POLICIES: tuple[str, ...] = ("fifo", "budget", "pack")
LOOP_ORDERS: tuple[str, ...] = ("prefill-first", "decode-first", "mixed")
DEFAULT_PREFILL_MAX_TOKENS = 512  # budget/pack admission budget (prompt tokens per step)
DEFAULT_CHUNK_TOKENS = 512  # mixed: max_num_batched_tokens with chunked prefill


@dataclass(frozen=True)
class RunOutput:
    """One backend run: per-request records and its duration.

    Attributes:
        records: records frame (``roseinfer.metrics.schema``).
        duration_s: seconds from the first arrival to the last step end.
        info: extra facts (e.g. warm-up seconds, load average).
    """

    records: pd.DataFrame
    duration_s: float
    info: dict[str, Any] = field(default_factory=dict)


RealRun = Callable[[Sequence[Request], SchedulerConfig], RunOutput]
"""Runs requests for real under a scheduler config (``ExecutorReplay`` is one)."""


@dataclass(frozen=True)
class Combination:
    """A named scheduler configuration, e.g. ``budget/mixed``."""

    name: str
    config: SchedulerConfig


def default_combinations(
    base: SchedulerConfig,
    policies: Iterable[str] = POLICIES,
    loop_orders: Iterable[str] = LOOP_ORDERS,
    *,
    prefill_max_tokens: int = DEFAULT_PREFILL_MAX_TOKENS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> list[Combination]:
    """Every ``policy/loop_order`` on top of ``base`` (pool, block size, lengths).

    ``budget`` and ``pack`` get ``prefill_max_tokens`` (without a budget they
    are FIFO); ``mixed`` runs with chunked prefill and ``max_num_batched_tokens
    = max(chunk_tokens, base.max_num_seqs)`` (vLLM v1's scheduling, whose
    default budget is 2048 tokens; smaller here because CPU steps are slow).

    Raises:
        ValueError: on an invalid combination (from ``SchedulerConfig``).
    """
    combos = []
    for policy, order in itertools.product(policies, loop_orders):
        knobs: dict[str, Any] = {"policy": policy, "loop_order": order}
        if policy in ("budget", "pack"):
            knobs["prefill_max_tokens"] = prefill_max_tokens
        if order == "mixed":
            knobs["enable_chunked_prefill"] = True
            knobs["max_num_batched_tokens"] = max(chunk_tokens, base.max_num_seqs)
        combos.append(Combination(f"{policy}/{order}", dataclasses.replace(base, **knobs)))
    return combos


def simulate_output(
    requests: Sequence[Request],
    config: SchedulerConfig,
    cost_model: CostModel,
    registry: Registry | None = None,
) -> RunOutput:
    """The simulator's :class:`RunOutput` for ``requests`` under ``config``."""
    result = simulate(requests, config, cost_model, registry=registry)
    return RunOutput(result.records, result.duration_s, {"num_steps": result.num_steps})


def estimate_capacity(
    requests: Sequence[Request], config: SchedulerConfig, cost_model: CostModel
) -> float:
    """Requests per second the configuration sustains on this request mix (sim).

    All requests arrive at t=0 and the simulator, pricing steps with
    ``cost_model``, drains them: capacity = requests / simulated makespan. A
    load of 100% is this rate; rates above it make the queue grow without bound.

    Raises:
        ValueError: if ``requests`` is empty or the run takes no time.
    """
    if not requests:
        raise ValueError("estimate_capacity needs at least one request")
    at_zero = [dataclasses.replace(r, arrival_time_s=0.0) for r in requests]
    duration = simulate_output(at_zero, config, cost_model).duration_s
    if duration <= 0:
        raise ValueError("the simulated run took no time; check the cost model")
    return len(requests) / duration


@dataclass
class FidelityReport:
    """What :func:`run_fidelity` measured.

    Attributes:
        table: one row per (combination, metric): ``sim``, ``real`` (mean of the
            repeats), ``real_runs`` (list), ``rel_error`` ((sim - real) / real),
            ``noise`` ((max - min) / mean of the real runs) and ``within_noise``
            (``abs(rel_error) <= noise``).
        summary: per metric ``kendall_tau`` (nan when undefined: fewer than two
            combinations or constant values), ``pairs_resolved``,
            ``pairs_agree`` and ``max_abs_rel_error``; plus ``num_combinations``,
            ``repeats``, ``cost_model``.
        sim: combination -> simulator output; real: combination -> real outputs.
    """

    table: pd.DataFrame
    summary: dict[str, Any]
    sim: dict[str, RunOutput]
    real: dict[str, list[RunOutput]]

    def to_json(self) -> dict[str, Any]:
        """Table rows and summary as plain JSON types (nan becomes None)."""
        rows = self.table.to_dict(orient="records")
        return _jsonable({"summary": self.summary, "rows": rows})


def run_fidelity(
    requests: Sequence[Request],
    combinations: Sequence[Combination],
    cost_model: CostModel,
    real_run: RealRun,
    *,
    repeats: int = 2,
    registry: Registry | None = None,
    on_run: Callable[[str, str], None] | None = None,
) -> FidelityReport:
    """Run every combination in the simulator once and for real ``repeats`` times.

    Args:
        requests: the request list both backends replay (token ids included,
            so prefix-cache hits match).
        combinations: named scheduler configurations (distinct names).
        cost_model: prices the simulated steps (e.g. a profile's).
        real_run: runs requests on the real executor; called ``repeats`` times
            per combination, the repeats of one combination back to back.
        repeats: real runs per combination (>= 2 gives the noise floor).
        registry: plugin registry for the simulator (default: built-ins).
        on_run: called with (combination name, "sim" or "real #k") before each run.

    Raises:
        ValueError: on no combinations, duplicate names or ``repeats < 1``.
    """
    names = [c.name for c in combinations]
    if not names or len(set(names)) != len(names) or repeats < 1:
        raise ValueError(
            f"need distinct combination names and repeats >= 1, got {names} and {repeats}"
        )
    sim: dict[str, RunOutput] = {}
    real: dict[str, list[RunOutput]] = {}
    for combo in combinations:
        if on_run is not None:
            on_run(combo.name, "sim")
        sim[combo.name] = simulate_output(requests, combo.config, cost_model, registry)
        real[combo.name] = []
        for k in range(repeats):
            if on_run is not None:
                on_run(combo.name, f"real #{k + 1}")
            real[combo.name].append(real_run(requests, combo.config))
    table = fidelity_table(sim, real)
    summary = {
        **rank_agreement(table),
        "num_combinations": len(names),
        "num_requests": len(requests),
        "repeats": repeats,
        "cost_model": cost_model.describe(),
    }
    return FidelityReport(table, summary, sim, real)


def _summary_of(run: RunOutput) -> dict[str, float]:
    out = summarize(run.records, duration_s=run.duration_s, percentiles=(50, 90, 99))
    return {k: float(out[k]) for k in FIDELITY_METRICS}


def fidelity_table(sim: dict[str, RunOutput], real: dict[str, list[RunOutput]]) -> pd.DataFrame:
    """Per (combination, metric): sim, real mean, real runs, relative error, noise.

    Args:
        sim: combination -> simulator output.
        real: combination -> one or more real outputs (same keys as ``sim``).
    """
    rows = []
    for name, sim_run in sim.items():
        s = _summary_of(sim_run)
        runs = [_summary_of(r) for r in real[name]]
        for metric in FIDELITY_METRICS:
            values = [r[metric] for r in runs]
            mean = float(np.mean(values))
            rows.append(
                {
                    "combination": name,
                    "metric": metric,
                    "sim": s[metric],
                    "real": mean,
                    "real_runs": values,
                    "rel_error": _relative(s[metric] - mean, mean),
                    "noise": _relative(max(values) - min(values), mean),
                }
            )
    df = pd.DataFrame(rows)
    df["within_noise"] = df["rel_error"].abs() <= df["noise"]
    return df


def _relative(diff: float, ref: float) -> float:
    return diff / ref if ref and math.isfinite(ref) else math.nan


def rank_agreement(table: pd.DataFrame) -> dict[str, Any]:
    """Per metric: Kendall tau of sim vs real across combinations, resolved pairs
    (real values further apart, relative to their mean, than both noise floors)
    and how many of those the simulator orders the same way; max |rel_error|.

    Returns:
        ``{"per_metric": {metric: {...}}}`` (JSON types; tau nan when undefined).
    """
    from scipy.stats import kendalltau

    per_metric = {}
    for metric, rows in table.groupby("metric", sort=False):
        sim, real, noise = (rows[c].to_numpy(float) for c in ("sim", "real", "noise"))
        tau = math.nan
        if len(rows) >= 2 and np.ptp(sim) > 0 and np.ptp(real) > 0:
            tau = float(kendalltau(sim, real).statistic)
        resolved = agree = 0
        for i, j in itertools.combinations(range(len(rows)), 2):
            gap = _relative(abs(real[i] - real[j]), (real[i] + real[j]) / 2)
            if gap > max(noise[i], noise[j]):
                resolved += 1
                agree += int(np.sign(sim[i] - sim[j]) == np.sign(real[i] - real[j]))
        per_metric[str(metric)] = {
            "kendall_tau": tau,
            "pairs_resolved": resolved,
            "pairs_agree": agree,
            "max_abs_rel_error": float(np.nanmax(np.abs(rows["rel_error"]))),
            "median_noise": float(np.nanmedian(noise)),
        }
    return {"per_metric": per_metric}


def markdown_table(report: FidelityReport, metrics: Sequence[str] | None = None) -> str:
    """Relative errors as a markdown table: one row per combination, one column per
    metric, each cell ``+12% (±3%)`` = rel_error (noise floor); then a tau row."""
    metrics = list(metrics or FIDELITY_METRICS)
    short = [m.removesuffix("_ms").replace("output_throughput", "tok/s") for m in metrics]
    lines = [
        "| combination | " + " | ".join(short) + " |",
        "|---|" + "---:|" * len(metrics),
    ]
    cells = report.table.set_index(["combination", "metric"])
    for name in dict.fromkeys(report.table["combination"]):
        row = [_cell(cells.loc[(name, m)]) for m in metrics]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    per = report.summary["per_metric"]
    taus = [_fmt(per[m]["kendall_tau"], "+.2f") for m in metrics]
    lines.append("| Kendall tau | " + " | ".join(taus) + " |")
    pairs = [f"{per[m]['pairs_agree']}/{per[m]['pairs_resolved']}" for m in metrics]
    lines.append("| resolved pairs agreeing | " + " | ".join(pairs) + " |")
    return "\n".join(lines)


def _cell(row: pd.Series) -> str:
    return f"{_fmt(row['rel_error'], '+.0%')} (±{_fmt(row['noise'], '.0%')})"


def _fmt(value: float, spec: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
