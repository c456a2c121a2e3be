"""The fidelity report's arithmetic: how far a simulation is from a real run, and why.

An end-to-end number (``(sim - real) / real`` of p99 TTFT, say) mixes three
errors: the cost model's step times, any divergence between the two
backends' schedules, and drift of the machine between calibration and run.
Both backends run the same scheduler, so the report can take them apart:

* **end to end** (:func:`fidelity_table`): per combination and metric the
  relative error against the mean of the repeated real runs, the real runs'
  spread (the noise floor) and a bootstrap 95% confidence interval of the real
  value, so a claim reads "within target" or "within the real runs' CI";
* **step-model error** (:func:`step_model_error`): the cost model's price of
  every step the real run executed against its measured duration (the median
  of ``predicted / measured`` is the drift between calibration and run);
* **replay error** (:func:`replay_error`): the simulator priced by the real
  run's own step times (``roseinfer.calibration.replay.ReplayCostModel``)
  against the real run, per request. What remains names a divergence of the
  schedules, not of the cost model;
* rank agreement (:func:`rank_agreement`): Kendall's tau of sim vs real across
  combinations and the resolved pairs ordered alike.

Pure functions of records and step logs (no simulator, no torch): the
experiment that runs both backends is ``roseinfer.experiments.fidelity``.
Metrics follow ``roseinfer.metrics.summarize`` (vLLM bench's definitions).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.calibration.cost_model import CostModel
from roseinfer.calibration.steplog import StepRecord
from roseinfer.metrics import summarize

FIDELITY_METRICS: tuple[str, ...] = tuple(
    f"p{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in (50, 90, 99)
) + ("output_throughput",)
"""Summary keys compared: latency percentiles (ms) and output throughput (tok/s)."""

CI_LEVEL = 0.95
NUM_RESAMPLES = 400  # bootstrap resamples per (combination, metric)


class FidelityError(ValueError):
    """The two sides of a comparison did not replay the same requests."""


@dataclass(frozen=True)
class RunOutput:
    """One backend run: per-request records, its duration and (optionally) its steps.

    Attributes:
        records: records frame (``roseinfer.metrics.schema``), token times kept.
        duration_s: seconds from the first arrival to the last step end.
        info: extra facts (e.g. warm-up seconds, load average).
        steps: the run's step log, when recorded.
    """

    records: pd.DataFrame
    duration_s: float
    info: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] | None = None


def summary_of(run: RunOutput) -> dict[str, float]:
    """The :data:`FIDELITY_METRICS` of one run."""
    out = summarize(run.records, duration_s=run.duration_s, percentiles=(50, 90, 99))
    return {k: float(out[k]) for k in FIDELITY_METRICS}


def check_same_requests(a: RunOutput, b: RunOutput, what: str) -> None:
    """Raise unless ``a`` and ``b`` hold the same requests (ids, prompt and output
    lengths, finished or rejected).

    Raises:
        FidelityError: naming the first request that differs and how.
    """
    cols = ["request_id", "num_prompt_tokens", "status"]
    left = a.records[cols].sort_values("request_id").reset_index(drop=True)
    right = b.records[cols].sort_values("request_id").reset_index(drop=True)
    if len(left) != len(right):
        raise FidelityError(f"{what}: {len(left)} requests on one side, {len(right)} on the other")
    diff = (left != right).any(axis=1).to_numpy()
    if diff.any():
        i = int(np.argmax(diff))
        raise FidelityError(
            f"{what}: the two sides replayed different requests (first: "
            f"{left.iloc[i].to_dict()} vs {right.iloc[i].to_dict()}); fit both workloads "
            "with the same --fit-lengths and --max-model-len"
        )


# ------------------------------------------------------------------ bootstrap


@dataclass(frozen=True)
class _Values:
    """Per-request latencies of one run (s), for resampling requests."""

    ttft: np.ndarray
    tpot: np.ndarray  # nan where a request has one output token
    e2el: np.ndarray
    gaps: np.ndarray  # every ITL gap, grouped by request
    gap_starts: np.ndarray  # index of each request's first gap in ``gaps``
    num_gaps: np.ndarray
    output_tokens: np.ndarray
    duration_s: float

    @classmethod
    def of(cls, run: RunOutput) -> _Values:
        done = run.records[run.records["status"] == "finished"]
        first = done["first_token_s"].to_numpy(float)
        finish = done["finish_s"].to_numpy(float)
        arrival = done["arrival_s"].to_numpy(float)
        num_out = done["num_output_tokens"].to_numpy(float)
        tpot = np.where(num_out > 1, (finish - first) / np.maximum(num_out - 1, 1), np.nan)
        gap_lists = [np.diff(np.asarray(t, dtype=float)) for t in done["token_times_s"]]
        num_gaps = np.array([len(g) for g in gap_lists], dtype=np.int64)
        gaps = np.concatenate(gap_lists) if gap_lists else np.empty(0)
        starts = np.concatenate([[0], np.cumsum(num_gaps)[:-1]]) if len(num_gaps) else num_gaps
        return cls(first - arrival, tpot, finish - arrival, gaps, starts, num_gaps, num_out,
                   run.duration_s)  # fmt: skip

    def metric(self, name: str, idx: np.ndarray | None = None) -> float:
        """One :data:`FIDELITY_METRICS` value over the requests ``idx`` (all if None)."""
        if name == "output_throughput":
            out = self.output_tokens if idx is None else self.output_tokens[idx]
            return float(out.sum() / self.duration_s) if self.duration_s > 0 else math.nan
        q, kind = name.split("_")[0], name.split("_")[1]
        values = self._values(kind, idx) * 1000.0
        values = values[~np.isnan(values)]
        return float(np.percentile(values, float(q[1:]))) if values.size else math.nan

    def _values(self, kind: str, idx: np.ndarray | None) -> np.ndarray:
        if kind != "itl":
            values = getattr(self, kind)
            return values if idx is None else values[idx]
        if idx is None:
            return self.gaps
        counts = self.num_gaps[idx]
        total = int(counts.sum())
        if total == 0:
            return np.empty(0)
        # flat gap indices of the resampled requests: start + 0..count-1 for each
        offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        return self.gaps[np.repeat(self.gap_starts[idx], counts) + offsets]


def bootstrap_ci(
    runs: Sequence[RunOutput],
    metrics: Sequence[str] = FIDELITY_METRICS,
    *,
    num_resamples: int = NUM_RESAMPLES,
    level: float = CI_LEVEL,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Bootstrap confidence interval of each metric's mean over repeated runs.

    Each resample draws every run's requests with replacement (a request brings
    all its token gaps), recomputes the metric per run and averages the runs,
    as the real value of the report is their mean. Percentile interval
    (Efron & Tibshirani 1993, ch. 13).

    Returns:
        metric -> (low, high) at ``level`` (nan when a run has no finished request).
    """
    values = [_Values.of(r) for r in runs]
    rng = np.random.default_rng(seed)
    draws = {m: np.empty(num_resamples) for m in metrics}
    for b in range(num_resamples):
        picks = [rng.integers(0, len(v.ttft), len(v.ttft)) for v in values]
        for m in metrics:
            draws[m][b] = np.mean([v.metric(m, idx) for v, idx in zip(values, picks)])
    tail = (1.0 - level) / 2 * 100
    out = {}
    for m, d in draws.items():
        d = d[~np.isnan(d)]
        out[m] = (
            (float(np.percentile(d, tail)), float(np.percentile(d, 100 - tail)))
            if d.size
            else (math.nan, math.nan)
        )
    return out


# ------------------------------------------------------------------ end to end


def fidelity_table(
    sim: Mapping[str, RunOutput],
    real: Mapping[str, Sequence[RunOutput]],
    *,
    targets: Mapping[str, float] | None = None,
    num_resamples: int = NUM_RESAMPLES,
) -> pd.DataFrame:
    """Per (combination, metric): sim, real mean, real runs, relative error,
    noise floor, the real value's bootstrap CI and whether the sim is within it.

    Args:
        sim: combination -> simulator output.
        real: combination -> one or more real outputs (same keys as ``sim``).
        targets: metric -> allowed |relative error| (default: 5% at p50, 10%
            otherwise, the fidelity targets).
        num_resamples: bootstrap resamples (0: no CI).

    Returns:
        Columns ``combination, metric, sim, real, real_runs, rel_error, noise,
        ci_low, ci_high, within_ci, target, within_target``.
    """
    rows = []
    for name, sim_run in sim.items():
        s = summary_of(sim_run)
        runs = [summary_of(r) for r in real[name]]
        ci = bootstrap_ci(real[name], num_resamples=num_resamples) if num_resamples else {}
        for metric in FIDELITY_METRICS:
            values = [r[metric] for r in runs]
            mean = float(np.mean(values))
            low, high = ci.get(metric, (math.nan, math.nan))
            target = (targets or {}).get(metric, default_target(metric))
            rel = relative(s[metric] - mean, mean)
            rows.append({
                "combination": name, "metric": metric, "sim": s[metric], "real": mean,
                "real_runs": values, "rel_error": rel,
                "noise": relative(max(values) - min(values), mean),
                "ci_low": low, "ci_high": high, "within_ci": bool(low <= s[metric] <= high),
                "target": target, "within_target": bool(abs(rel) <= target),
            })  # fmt: skip
    return pd.DataFrame(rows)


def default_target(metric: str) -> float:
    """The fidelity targets: |error| <= 5% at p50 and for throughput, 10% otherwise."""
    return 0.05 if metric.startswith("p50_") or metric == "output_throughput" else 0.10


def relative(diff: float, ref: float) -> float:
    """``diff / ref``, nan when ``ref`` is 0 or not finite."""
    return diff / ref if ref and math.isfinite(ref) else math.nan


def rank_agreement(table: pd.DataFrame) -> dict[str, Any]:
    """Per metric: Kendall tau of sim vs real across combinations, resolved pairs
    (real values further apart, relative to their mean, than both noise floors
    and with disjoint CIs when known) and how many of those the simulator
    orders the same way; max |rel_error|.

    Returns:
        ``{"per_metric": {metric: {...}}}`` (JSON types; tau nan when undefined).
    """
    from scipy.stats import kendalltau

    per_metric = {}
    for metric, rows in table.groupby("metric", sort=False):
        sim, real, noise = (rows[c].to_numpy(float) for c in ("sim", "real", "noise"))
        low = rows["ci_low"].to_numpy(float) if "ci_low" in rows else np.full(len(rows), np.nan)
        high = rows["ci_high"].to_numpy(float) if "ci_high" in rows else np.full(len(rows), np.nan)
        tau = math.nan
        if len(rows) >= 2 and np.ptp(sim) > 0 and np.ptp(real) > 0:
            tau = float(kendalltau(sim, real).statistic)
        resolved = agree = 0
        for i, j in itertools.combinations(range(len(rows)), 2):
            gap = relative(abs(real[i] - real[j]), (real[i] + real[j]) / 2)
            overlap = not (high[i] < low[j] or high[j] < low[i])  # nan compares False
            if gap > max(noise[i], noise[j]) and not overlap:
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


# ----------------------------------------------------------- step-model error


@dataclass(frozen=True)
class StepModelError:
    """A cost model's price of each step a run executed against its measured time.

    Attributes:
        median, p90: of ``|predicted - measured| / measured`` (fractions).
        median_ratio: median of ``predicted / measured``: the drift between the
            calibration and the run (1.0 = none; 1.2 = the model is 20% slow).
        num_steps: steps compared.
        by_kind: the same per step kind (``prefill``, ``decode``, ``mixed``,
            ``prefill>=N`` for the largest tenth of prefills by tokens):
            ``{kind: {median, p90, median_ratio, num_steps}}``.
    """

    median: float
    p90: float
    median_ratio: float
    num_steps: int
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types."""
        return {
            "median": self.median,
            "p90": self.p90,
            "median_ratio": self.median_ratio,
            "num_steps": self.num_steps,
            "by_kind": self.by_kind,
        }


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    if measured.size == 0:
        return {"median": math.nan, "p90": math.nan, "median_ratio": math.nan, "num_steps": 0}
    ratio = predicted / measured
    rel = np.abs(ratio - 1.0)
    return {
        "median": float(np.median(rel)),
        "p90": float(np.quantile(rel, 0.9)),
        "median_ratio": float(np.median(ratio)),
        "num_steps": int(measured.size),
    }


def step_model_error(cost_model: CostModel, steps: Sequence[StepRecord]) -> StepModelError:
    """Price every step of a run with ``cost_model`` and compare with its duration.

    Steps of zero measured duration (a clock that did not tick) are skipped.
    """
    kept = [s for s in steps if s.duration_s > 0]
    measured = np.array([s.duration_s for s in kept])
    predicted = np.array([cost_model.step_time_s(s.shape) for s in kept])
    overall = _errors(predicted, measured)
    kinds = np.array([s.kind for s in kept])
    by_kind = {k: _errors(predicted[kinds == k], measured[kinds == k]) for k in sorted(set(kinds))}
    prefill_tokens = np.array([sum(n for n, d in zip(s.num_new_tokens, s.is_decode) if not d)
                               for s in kept])  # fmt: skip
    if (prefill_tokens > 0).sum() >= 10:
        cut = float(np.quantile(prefill_tokens[prefill_tokens > 0], 0.9))
        big = prefill_tokens >= cut
        by_kind[f"prefill>={cut:.0f}"] = _errors(predicted[big], measured[big])
    return StepModelError(
        overall["median"],
        overall["p90"],
        overall["median_ratio"],
        int(overall["num_steps"]),
        by_kind,
    )


# ------------------------------------------------------------------ replay error


def replay_error(real: RunOutput, replay: RunOutput) -> dict[str, Any]:
    """The replayed simulation (priced by the real run's step times) against the
    real run it replays.

    Returns:
        ``rel_error``: metric -> (replay - real) / real for :data:`FIDELITY_METRICS`;
        ``per_request``: for TTFT and E2EL the median and max over requests of
        ``|replay - real| / real``; ``max_abs_rel_error`` over the p50 and p99 metrics.

    Raises:
        FidelityError: if the two runs hold different requests.
    """
    check_same_requests(real, replay, "replay")
    r, s = summary_of(real), summary_of(replay)
    rel = {m: relative(s[m] - r[m], r[m]) for m in FIDELITY_METRICS}
    a = real.records.set_index("request_id")
    b = replay.records.set_index("request_id").loc[a.index]
    per_request = {}
    for name, col in (("ttft", "first_token_s"), ("e2el", "finish_s")):
        ra = a[col].to_numpy(float) - a["arrival_s"].to_numpy(float)
        rb = b[col].to_numpy(float) - b["arrival_s"].to_numpy(float)
        err = np.abs(rb - ra) / ra
        err = err[np.isfinite(err)]
        per_request[name] = {
            "median": float(np.median(err)) if err.size else math.nan,
            "max": float(err.max()) if err.size else math.nan,
        }
    headline = [
        abs(v) for m, v in rel.items() if m.startswith(("p50_", "p99_")) and math.isfinite(v)
    ]
    return {
        "rel_error": rel,
        "per_request": per_request,
        "max_abs_rel_error": max(headline) if headline else math.nan,
    }
