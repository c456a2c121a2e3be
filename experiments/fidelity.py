"""Fidelity experiment: how well ``rose-sim`` predicts a real run on the same requests, and why.

Both backends run the same scheduler code, so on the same request list and the
same :class:`~roseinfer.config.SchedulerConfig` the only thing that differs is
the clock: a cost model here, the real step times there. :func:`run_fidelity`
runs every named configuration (policy x loop order) in the simulator once and
on the real executor ``repeats`` times (each recording its step log), and
reports in four parts (``roseinfer.calibration.report``):

* **end to end**: per combination and metric (p50/p90/p99 of TTFT, TPOT, ITL,
  E2EL in ms; output throughput) the relative error against the mean of the
  real runs, the noise floor (their spread) and a bootstrap 95% CI;
* **step-model error**: the cost model's price of every step the real runs
  executed against its measured duration (median, p90, median ratio = drift);
* **replay error**: the simulator priced by each real run's own step times
  (:class:`~roseinfer.calibration.replay.ReplayCostModel`) against that run,
  with how many steps agreed;
* **rank agreement**: Kendall's tau across combinations, resolved pairs.

It fails loudly (:class:`~roseinfer.calibration.report.FidelityError`) when
the two sides did not replay the same requests. The real side is a callable
(:data:`RealRun`), so this module never imports torch:
``roseinfer.executor.replay.ExecutorReplay`` is the executor's one.

Example::

    from roseinfer.calibration import load_profile
    from roseinfer.experiments.fidelity import default_combinations, run_fidelity
    profile = load_profile("p.json")
    report = run_fidelity(requests, default_combinations(base), profile.cost_model(), real_run)
    print(markdown_table(report)); print(decomposition_table(report))
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from roseinfer.calibration.cost_model import CostModel
from roseinfer.calibration.replay import ReplayCostModel
from roseinfer.calibration.report import (
    FIDELITY_METRICS,
    NUM_RESAMPLES,
    FidelityError,
    RunOutput,
    check_same_requests,
    fidelity_table,
    rank_agreement,
    replay_error,
    step_model_error,
)
from roseinfer.calibration.steplog import StepRecorder
from roseinfer.config import SchedulerConfig
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.simulator.engine import simulate

__all__ = [
    "FIDELITY_METRICS",
    "LOOP_ORDERS",
    "POLICIES",
    "Combination",
    "FidelityError",
    "FidelityReport",
    "RealRun",
    "RunOutput",
    "decomposition_table",
    "default_combinations",
    "estimate_capacity",
    "markdown_table",
    "run_fidelity",
    "serving_combinations",
    "simulate_output",
]

POLICIES: tuple[str, ...] = ("fifo", "budget", "pack")
LOOP_ORDERS: tuple[str, ...] = ("prefill-first", "decode-first", "mixed")
DEFAULT_PREFILL_MAX_TOKENS = 512  # budget/pack admission budget (prompt tokens per step)
DEFAULT_CHUNK_TOKENS = 512  # mixed: max_num_batched_tokens with chunked prefill
SERVING_BUDGET_TOKENS = 2048  # vLLM's default max_num_batched_tokens with chunked prefill

RealRun = Callable[[Sequence[Request], SchedulerConfig], RunOutput]
"""Runs requests for real under a scheduler config, recording its steps
(``RunOutput.steps``; ``ExecutorReplay`` is one)."""


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


def serving_combinations(
    base: SchedulerConfig,
    budget_tokens: int = SERVING_BUDGET_TOKENS,
    force_fifo_every: int = 8,
) -> list[Combination]:
    """The serving grid a GPU fidelity run covers, on top of ``base``:

    ``fifo`` (prefill-first, no budget); ``budget-B`` (FIFO under a prefill token
    budget of B); ``pack-B+ffN`` (lookahead packing under B, strict FIFO every N-th
    step, seed 033); ``budget-B/decode-first`` (seed 032's order); ``mixed-B``
    (FIFO, one step of decodes plus prefill chunks under ``max_num_batched_tokens
    = max(B, max_num_seqs)``, vLLM v1's scheduling).

    Raises:
        ValueError: on an invalid configuration (from ``SchedulerConfig``).
    """
    from roseinfer.experiments.sweep import apply_overrides

    budget = {"policy": "budget", "prefill_max_tokens": budget_tokens}
    variants: dict[str, dict[str, Any]] = {
        "fifo": {"policy": "fifo"},
        f"budget-{budget_tokens}": budget,
        f"pack-{budget_tokens}+ff{force_fifo_every}": {
            **budget,
            "policy": "pack",
            "force_fifo_every": force_fifo_every,
        },  # fmt: skip
        f"budget-{budget_tokens}/decode-first": {**budget, "loop_order": "decode-first"},
        f"mixed-{budget_tokens}": {
            "policy": "fifo",
            "loop_order": "mixed",
            "enable_chunked_prefill": True,
            "max_num_batched_tokens": max(budget_tokens, base.max_num_seqs),
        },  # fmt: skip
    }
    return [Combination(name, apply_overrides(base, knobs)) for name, knobs in variants.items()]


def simulate_output(
    requests: Sequence[Request],
    config: SchedulerConfig,
    cost_model: CostModel,
    registry: Registry | None = None,
    *,
    jump: bool = True,
    keep_steps: bool = False,
) -> RunOutput:
    """The simulator's :class:`RunOutput` for ``requests`` under ``config``
    (with its step log when ``keep_steps``)."""
    recorder = StepRecorder(keep=True) if keep_steps else None
    result = simulate(requests, config, cost_model, registry=registry, jump=jump, on_step=recorder)
    return RunOutput(
        result.records,
        result.duration_s,
        {"num_steps": result.num_steps},
        recorder.records if recorder is not None else None,
    )


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
            repeats), ``real_runs``, ``rel_error``, ``noise``, ``ci_low``,
            ``ci_high``, ``within_ci``, ``target``, ``within_target``
            (``roseinfer.calibration.report.fidelity_table``).
        decomposition: per combination: ``step_model`` (a
            :class:`~roseinfer.calibration.report.StepModelError` as JSON, over
            every real run's steps), ``replay`` (per real run: its replay error
            and how many steps agreed), ``explained_by`` (one line).
        summary: per metric ``kendall_tau``, ``pairs_resolved``, ``pairs_agree``,
            ``max_abs_rel_error``; plus ``num_combinations``, ``num_requests``,
            ``repeats``, ``cost_model``.
        sim, real, replays: the runs by combination.
    """

    table: pd.DataFrame
    decomposition: dict[str, dict[str, Any]]
    summary: dict[str, Any]
    sim: dict[str, RunOutput]
    real: dict[str, list[RunOutput]]
    replays: dict[str, list[RunOutput]]

    def to_json(self) -> dict[str, Any]:
        """Table rows, decomposition and summary as plain JSON types (nan -> None)."""
        rows = self.table.to_dict(orient="records")
        return _jsonable(
            {"summary": self.summary, "decomposition": self.decomposition, "rows": rows}
        )


CostModelFor = CostModel | Callable[[str], CostModel]
"""One cost model for every combination, or a function giving a combination's
(by name), e.g. one calibrated from the other combinations' step logs."""


def run_fidelity(
    requests: Sequence[Request],
    combinations: Sequence[Combination],
    cost_model: CostModelFor,
    real_run: RealRun,
    *,
    repeats: int = 3,
    registry: Registry | None = None,
    on_run: Callable[[str, str], None] | None = None,
    num_resamples: int = NUM_RESAMPLES,
) -> FidelityReport:
    """Run every combination in the simulator once and for real ``repeats`` times,
    replay each real run from its own step log, and decompose the error.

    Args:
        requests: the request list both backends replay (token ids included,
            so prefix-cache hits match).
        combinations: named scheduler configurations (distinct names).
        cost_model: prices the simulated steps (e.g. a profile's), or a function
            ``name -> CostModel`` giving each combination its own.
        real_run: runs requests on the real executor, recording steps; called
            ``repeats`` times per combination, back to back.
        repeats: real runs per combination (>= 3 for a noise floor worth the name).
        registry: plugin registry for the simulator (default: built-ins).
        on_run: called with (combination name, "sim" or "real #k") before each run.
        num_resamples: bootstrap resamples of the real runs' CIs.

    Raises:
        ValueError: on no combinations, duplicate names or ``repeats < 1``.
        FidelityError: if a real run replayed other requests than the simulator
            (different ids, lengths or rejections).
    """
    names = [c.name for c in combinations]
    if not names or len(set(names)) != len(names) or repeats < 1:
        raise ValueError(
            f"need distinct combination names and repeats >= 1, got {names} and {repeats}"
        )
    sim: dict[str, RunOutput] = {}
    real: dict[str, list[RunOutput]] = {}
    replays: dict[str, list[RunOutput]] = {}
    decomposition: dict[str, dict[str, Any]] = {}
    described: dict[str, str] = {}
    for combo in combinations:
        model = cost_model if isinstance(cost_model, CostModel) else cost_model(combo.name)
        described[combo.name] = model.describe()
        if on_run is not None:
            on_run(combo.name, "sim")
        sim[combo.name] = simulate_output(requests, combo.config, model, registry)
        real[combo.name] = []
        for k in range(repeats):
            if on_run is not None:
                on_run(combo.name, f"real #{k + 1}")
            run = real_run(requests, combo.config)
            check_same_requests(sim[combo.name], run, f"{combo.name} sim vs real #{k + 1}")
            real[combo.name].append(run)
        replays[combo.name], decomposition[combo.name] = _decompose(
            real[combo.name], combo.config, model, requests, registry
        )
    table = fidelity_table(sim, real, num_resamples=num_resamples)
    for name, parts in decomposition.items():
        parts["explained_by"] = explain(table[table.combination == name], parts)
    summary = {
        **rank_agreement(table),
        "num_combinations": len(names),
        "num_requests": len(requests),
        "repeats": repeats,
        "cost_model": described
        if len(set(described.values())) > 1
        else next(iter(described.values())),
    }
    return FidelityReport(table, decomposition, summary, sim, real, replays)


def _decompose(
    runs: list[RunOutput],
    config: SchedulerConfig,
    cost_model: CostModel,
    requests: Sequence[Request],
    registry: Registry | None,
) -> tuple[list[RunOutput], dict[str, Any]]:
    """Step-model error over every run's steps; each run replayed by its own steps."""
    steps = [s for run in runs for s in (run.steps or [])]
    parts: dict[str, Any] = {"step_model": step_model_error(cost_model, steps).to_json()}
    replays, per_run = [], []
    for run in runs:
        if not run.steps:
            continue
        oracle = ReplayCostModel(run.steps, cost_model)
        replay = simulate_output(requests, config, oracle, registry, jump=False)
        replays.append(replay)
        per_run.append({
            **replay_error(run, replay),
            "steps_agreed": oracle.num_agreed,
            "num_steps": len(run.steps),
            "first_divergence": oracle.first_divergence,
        })  # fmt: skip
    parts["replay"] = per_run
    return replays, parts


def explain(rows: pd.DataFrame, parts: dict[str, Any]) -> str:
    """Which part explains a combination's end-to-end error, in one line.

    The headline error is the largest |rel_error| over the p50 and p99 metrics.
    It is *noise* when every such sim value lies in its real CI; *schedule
    divergence* when the replay error (real step times, the same scheduler)
    is at least half of it; otherwise the *step model*, with its median ratio
    (the drift between calibration and run) and p90 error.
    """
    head = rows[rows.metric.str.match(r"p(50|99)_")]
    if head.empty or head["rel_error"].isna().all():
        return "no finished requests"
    worst = head.loc[head["rel_error"].abs().idxmax()]
    err = abs(float(worst["rel_error"]))
    if bool(head["within_ci"].all()):
        return f"noise: every p50/p99 sim value lies in the real runs' 95% CI (worst {err:.0%})"
    replay = [
        r["max_abs_rel_error"] for r in parts["replay"] if math.isfinite(r["max_abs_rel_error"])
    ]
    replay_err = float(np.median(replay)) if replay else math.nan
    step = parts["step_model"]
    if math.isfinite(replay_err) and replay_err >= err / 2:
        return (
            f"schedule divergence: replay error {replay_err:.0%} of end-to-end "
            f"{err:.0%} ({worst['metric']})"
        )
    return (
        f"step model: end-to-end {err:.0%} ({worst['metric']}); steps priced "
        f"{step['median_ratio']:.2f}x measured (median), p90 error {step['p90']:.0%}; "
        f"replay error {replay_err:.0%}"
    )


# ------------------------------------------------------------------ tables


def markdown_table(report: FidelityReport, metrics: Sequence[str] | None = None) -> str:
    """End-to-end errors as a markdown table: one row per combination, one column
    per metric, each cell ``+12% (±3%)`` = rel_error (noise floor), marked ``*``
    when the sim value lies in the real runs' 95% CI; then tau and pairs rows."""
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


def decomposition_table(report: FidelityReport) -> str:
    """Per combination: the step-model error (median / p90 / median ratio), the
    replay error (worst p50/p99 metric, steps agreed) and what explains the
    end-to-end error, as a markdown table."""
    lines = [
        "| combination | step model: median / p90 / ratio | replay error (p50, p99) | "
        "steps agreed | explained by |",
        "|---|---:|---:|---:|---|",
    ]
    for name, parts in report.decomposition.items():
        step = parts["step_model"]
        replays = parts["replay"]
        worst = max((r["max_abs_rel_error"] for r in replays), default=math.nan)
        agreed = " ".join(f"{r['steps_agreed']}/{r['num_steps']}" for r in replays) or "n/a"
        lines.append(
            f"| {name} | {_fmt(step['median'], '.1%')} / {_fmt(step['p90'], '.1%')} / "
            f"{_fmt(step['median_ratio'], '.3f')} | {_fmt(worst, '.1%')} | {agreed} | "
            f"{parts.get('explained_by', '')} |"
        )
    return "\n".join(lines)


def _cell(row: pd.Series) -> str:
    mark = "*" if bool(row.get("within_ci", False)) else ""
    return f"{_fmt(row['rel_error'], '+.0%')}{mark} (±{_fmt(row['noise'], '.0%')})"


def _fmt(value: float | None, spec: str) -> str:
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
