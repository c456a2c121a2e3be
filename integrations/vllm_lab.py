"""Experiments that run a policy in vLLM and in rose-sim side by side (no vLLM import).

The pieces ``benchmarks/fidelity_vllm.py``, ``benchmarks/vllm_effects.py`` and
``notebooks/vllm.ipynb`` share:

* :func:`conv_workload`: a slice of the Azure LLM inference 2023 conv trace
  fitted to GPT-2 (prompts and outputs scaled and clipped), with a tenant and a
  priority class per request and made-up token ids;
* :func:`calibrate`: vLLM step logs (through ``roseinfer.integrations.vllm``'s
  ``ROSEINFER_STEP_LOG``) of the slice that follows the workload, run with
  ``fifo``, fitted into the cost model ``rose-sim --cost-model STEPS.jsonl`` uses,
  and the engine's capacity on the workload estimated from it;
* :func:`simulate_policy`: the simulator's run of a request list under a policy,
  as ``rose-sim --scheduler-preset vllm-v1 --cost-model STEPS.jsonl`` runs it;
* the three effects (:data:`EFFECTS`) and their figures (:func:`effect_figures`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from roseinfer import workloads
from roseinfer.integrations.vllm_replay import EngineSettings, VllmReplay, sim_config, vocab_size
from roseinfer.request import Request

TRACE = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared"
    / "traces"
    / "AzureLLMInferenceTrace_conv.csv"
)
"""The Azure conv trace (``../shared/traces``); the embedded sample when absent."""
LIGHT, HEAVY = "light", "heavy"


@dataclass(frozen=True)
class WorkloadSpec:
    """How a trace slice is fitted to a small model and labelled.

    Attributes:
        num_requests: rows of the trace taken (after ``skip``).
        skip: rows skipped first.
        prompt_scale, max_prompt_tokens: prompt length = clip(scale x trace, 8, max).
        output_scale, max_output_tokens: output length = clip(scale x trace, 2, max).
        light_every: every n-th request is the ``light`` tenant's, the rest ``heavy``
            (11: a 10:1 load).
        urgent_share: fraction of requests of priority 0 (urgent); the rest 1.
        seed: token ids and the urgent draw.
    """

    num_requests: int = 40
    skip: int = 0
    prompt_scale: float = 0.25
    max_prompt_tokens: int = 512
    output_scale: float = 0.15
    max_output_tokens: int = 64
    light_every: int = 11
    urgent_share: float = 0.1
    seed: int = 0


def conv_workload(spec: WorkloadSpec, vocab_size: int) -> tuple[list[Request], str]:
    """The trace slice of ``spec`` (arrivals as in the trace, from 0), with tenants,
    priorities and token ids in ``[0, vocab_size)``.

    Returns:
        (requests, a one-line description).
    """
    path = TRACE if TRACE.is_file() else None
    reqs = workloads.load_trace(path) if path else workloads.load_default_trace()
    reqs = workloads.select(reqs, num_requests=spec.num_requests, skip=spec.skip)
    rng = np.random.default_rng([spec.seed, 15])
    urgent = rng.random(len(reqs)) < spec.urgent_share
    fitted = [
        dataclasses.replace(
            r,
            num_prompt_tokens=int(np.clip(r.num_prompt_tokens * spec.prompt_scale, 8, spec.max_prompt_tokens)),
            max_output_tokens=int(np.clip(r.max_output_tokens * spec.output_scale, 2, spec.max_output_tokens)),
            prompt_token_ids=None, prefix_hash_ids=None,
            tenant=LIGHT if i % spec.light_every == 0 else HEAVY, priority=0 if urgent[i] else 1,
        )
        for i, r in enumerate(reqs)
    ]  # fmt: skip
    fitted = workloads.with_token_ids(fitted, vocab_size=vocab_size, seed=spec.seed)
    p = [r.num_prompt_tokens for r in fitted]
    o = [r.max_output_tokens for r in fitted]
    name = path.name if path else workloads.DEFAULT_TRACE_NAME
    note = (
        f"{name} rows {spec.skip}..{spec.skip + len(fitted) - 1}: prompts x{spec.prompt_scale:g} "
        f"clipped to 8..{spec.max_prompt_tokens} (mean {np.mean(p):.0f}), outputs "
        f"x{spec.output_scale:g} clipped to 2..{spec.max_output_tokens} (mean {np.mean(o):.0f}); "
        f"tenants {HEAVY}:{LIGHT} {spec.light_every - 1}:1, {int(urgent.sum())} urgent (priority 0)"
    )
    return fitted, note


def at_load(
    requests: Sequence[Request], load: float, capacity_req_s: float, seed: int = 0
) -> list[Request]:
    """``requests`` with Poisson arrivals at ``load`` x ``capacity_req_s`` (seeded)."""
    return workloads.rescale_arrivals(requests, request_rate=load * capacity_req_s, seed=seed)


@dataclass
class Calibration:
    """A cost model fitted to vLLM's own step logs, and what it says of the workload.

    Attributes:
        cost_model: prices simulated steps (``rose-sim --cost-model`` of ``step_logs``).
        step_logs: the vLLM step logs it was fitted to.
        capacity_req_s: requests/s the engine sustains on the workload (simulated
            makespan of the workload arriving at once, fifo).
        describe: one line.
    """

    cost_model: Any
    step_logs: list[Path]
    capacity_req_s: float
    describe: str


def calibrate(
    vllm: VllmReplay,
    settings: EngineSettings,
    workload: Sequence[Request],
    calibration_requests: Sequence[Request],
    folder: Path,
    *,
    load: float = 0.75,
) -> Calibration:
    """Fit the cost model to vLLM step logs of ``calibration_requests`` (fifo): once
    all at t=0 (full batches), once with Poisson arrivals at ``load`` of the capacity
    the first fit estimates (partial batches), pooled as ``rose-sim --cost-model A B``
    pools them; then the capacity on ``workload``.

    Raises:
        roseinfer.calibration.step_model.ProfileError: with fewer than 10 steps.
    """
    from roseinfer.calibration.profile import load_calibration
    from roseinfer.experiments.fidelity import estimate_capacity

    folder.mkdir(parents=True, exist_ok=True)
    burst = [dataclasses.replace(r, arrival_time_s=0.0) for r in calibration_requests]
    paths = [folder / "calibration-burst.steps.jsonl", folder / "calibration-poisson.steps.jsonl"]
    vllm.run(burst, None, step_log=paths[0])
    fifo = sim_config(settings, None)
    first = load_calibration([paths[0]]).cost_model()
    rough = estimate_capacity(calibration_requests, fifo, first)
    vllm.run(at_load(calibration_requests, load, rough, seed=1), None, step_log=paths[1])
    cost_model = load_calibration(paths).cost_model()
    capacity = estimate_capacity(workload, fifo, cost_model)
    return Calibration(cost_model, paths, capacity, cost_model.describe())


def simulate_policy(
    requests: Sequence[Request], settings: EngineSettings, policy_args: str | None, cost_model: Any
) -> Any:
    """The simulator's :class:`~roseinfer.calibration.report.RunOutput` of ``requests``
    under ``policy_args`` on ``settings``' limits (:func:`sim_config`)."""
    from roseinfer.experiments.fidelity import simulate_output

    return simulate_output(requests, sim_config(settings, policy_args), cost_model)


# ------------------------------------------------------------------- effects
@dataclass(frozen=True)
class Effect:
    """A policy's expected effect against fifo, measured by one figure.

    Attributes:
        name: short label.
        policy_args: the policy's flags (``ROSEINFER_POLICY_ARGS``).
        figure: what is measured (ms).
        claim: the direction that must hold in vLLM and in rose-sim.
    """

    name: str
    policy_args: str
    figure: str
    claim: str


EFFECTS: tuple[Effect, ...] = (
    Effect("vtc", "--policy vtc", "light tenant p99 TTFT",
           "vtc lowers the light tenant's p99 TTFT (10:1 load)"),
    Effect("priority", "--policy priority", "urgent class p99 TTFT",
           "priority lowers the urgent class's p99 TTFT"),
    Effect("sjf", "--policy sjf --length-predictor oracle", "mean E2EL",
           "sjf (oracle lengths) lowers mean E2EL"),
)  # fmt: skip
"""The three policy effects, each against ``fifo`` on the same requests."""


def figures(records: pd.DataFrame) -> dict[str, float]:
    """Every effect's figure, plus the other tenant's and class's p99 TTFT (ms)."""
    from roseinfer.metrics.classes import per_class
    from roseinfer.metrics.fairness import per_tenant

    tenants = per_tenant(records).set_index("tenant")["p99_ttft_ms"]
    classes = per_class(records).set_index("class")["p99_ttft_ms"]
    done = records[records.status == "finished"]
    return {
        "light tenant p99 TTFT": float(tenants.get(LIGHT, math.nan)),
        "heavy tenant p99 TTFT": float(tenants.get(HEAVY, math.nan)),
        "urgent class p99 TTFT": float(classes.get("0", math.nan)),
        "other class p99 TTFT": float(classes.get("1", math.nan)),
        "mean E2EL": float(((done.finish_s - done.arrival_s) * 1000).mean()),
    }


def effect_table(runs: dict[str, dict[str, list[dict[str, float]]]]) -> pd.DataFrame:
    """Each effect's figure under fifo and under its policy, in vLLM and in rose-sim.

    Args:
        runs: ``{"vllm"|"sim": {policy name: [figures per round]}}`` (the
            :func:`figures` of each run; the simulator has one round).

    Returns:
        One row per (effect, backend): ``fifo_ms`` and ``policy_ms`` (medians over
        rounds), ``ratio`` (median over rounds of policy / fifo, each round's pair
        measured back to back), ``ratio_min``, ``ratio_max``, ``holds`` (ratio < 1).
    """
    rows = []
    for effect in EFFECTS:
        for backend, by_policy in runs.items():
            fifo = [f[effect.figure] for f in by_policy["fifo"]]
            mine = [f[effect.figure] for f in by_policy[effect.name]]
            ratios = [m / f for m, f in zip(mine, fifo)]
            rows.append({
                "effect": effect.name, "figure": effect.figure, "backend": backend,
                "fifo_ms": float(np.median(fifo)), "policy_ms": float(np.median(mine)),
                "ratio": float(np.median(ratios)), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "rounds": len(ratios), "holds": bool(np.median(ratios) < 1.0),
            })  # fmt: skip
    return pd.DataFrame(rows)


def effect_markdown(table: pd.DataFrame) -> str:
    """:func:`effect_table` as a markdown table, vLLM and rose-sim side by side."""
    lines = [
        "| effect | figure | vLLM fifo → policy (ms) | vLLM ratio [min, max] | "
        "rose-sim fifo → policy (ms) | rose-sim ratio | same direction |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for name, rows in table.groupby("effect", sort=False):
        real = rows[rows.backend == "vllm"].iloc[0]
        sim = rows[rows.backend == "sim"].iloc[0]
        same = "yes" if real.holds and sim.holds else "no"
        lines.append(
            f"| {name} | {real.figure} | {real.fifo_ms:,.0f} → {real.policy_ms:,.0f} | "
            f"{real.ratio:.2f} [{real.ratio_min:.2f}, {real.ratio_max:.2f}] | "
            f"{sim.fifo_ms:,.0f} → {sim.policy_ms:,.0f} | {sim.ratio:.2f} | {same} |"
        )
    return "\n".join(lines)


@dataclass
class EffectsRun:
    """What :func:`run_effects` measured.

    Attributes:
        table: :func:`effect_table` of the runs.
        figures: ``{"vllm"|"sim": {policy: [figures per round]}}``.
        records: the first round's records per backend and policy (for plots).
        calibration: the cost model rose-sim used.
        workload: one line; ``rate_req_s``: the arrival rate replayed.
        engine: what vLLM reported of itself; ``wall_s``: seconds the whole took.
    """

    table: pd.DataFrame
    figures: dict[str, dict[str, list[dict[str, float]]]]
    records: dict[str, dict[str, pd.DataFrame]]
    calibration: Calibration
    workload: str
    rate_req_s: float
    engine: dict[str, Any]
    wall_s: float


def run_effects(
    settings: EngineSettings,
    spec: WorkloadSpec,
    *,
    load: float = 0.9,
    rounds: int = 3,
    folder: Path,
    python: str | None = None,
    progress: Any = None,
) -> EffectsRun:
    """The three :data:`EFFECTS` in vLLM and in rose-sim on one request list.

    vLLM (one engine, loaded once) is calibrated on the slice after ``spec``'s
    (:func:`calibrate`), the workload replayed at ``load`` x the calibrated
    capacity under fifo and each effect's policy, ``rounds`` times (the order of
    the policies rotates each round); rose-sim runs each policy once on the same
    requests, priced by the calibration.

    Args:
        folder: where the step logs and vLLM's log go.
        python: the vLLM venv's python (default: ``ROSEINFER_VLLM_PYTHON``).
        progress: called with one line before each run, or None.

    Raises:
        roseinfer.integrations.vllm_replay.VllmReplayError: if vLLM fails.
    """
    start = time.perf_counter()
    vocab = vocab_size(settings.model) if not Path(settings.model).is_dir() else 50257
    requests, note = conv_workload(spec, vocab)
    calib, _ = conv_workload(dataclasses.replace(spec, skip=spec.skip + spec.num_requests), vocab)
    policies = {"fifo": "--policy fifo", **{e.name: e.policy_args for e in EFFECTS}}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {"vllm": {}, "sim": {}}
    records: dict[str, dict[str, pd.DataFrame]] = {"vllm": {}, "sim": {}}
    with VllmReplay(settings, python=python, workdir=folder / "vllm") as vllm:
        calibration = calibrate(vllm, settings, requests, calib, folder)
        timed = at_load(requests, load, calibration.capacity_req_s, seed=spec.seed)
        names = list(policies)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if progress is not None:
                    progress(f"round {r + 1}/{rounds}: vLLM {name}")
                run = vllm.run(
                    timed, policies[name], step_log=folder / f"effects-{name}-{r + 1}.steps.jsonl"
                )
                runs["vllm"].setdefault(name, []).append(figures(run.records))
                records["vllm"].setdefault(name, run.records)
        engine = vllm.engine
    for name, flags in policies.items():
        sim = simulate_policy(timed, settings, flags, calibration.cost_model)
        runs["sim"][name] = [figures(sim.records)]
        records["sim"][name] = sim.records
    rate = load * calibration.capacity_req_s
    return EffectsRun(effect_table(runs), runs, records, calibration, note, rate, engine,
                      time.perf_counter() - start)  # fmt: skip
