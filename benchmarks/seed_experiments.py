"""Reproduce a seed post's before/after experiment with one command.

Runs every variant the post compares (``seed_recipes.SEED_EXPERIMENTS``)
on the same workload, in the simulator (``--backend sim``: cost model,
seconds) or on the real executor (``--backend run``: GPT-2 124M with random
weights, same compute as the real one), and prints the seeds' metrics side by
side with the post's own reported figures for the same comparison.

    python benchmarks/seed_experiments.py 031                      # simulator, CPU cost model
    python benchmarks/seed_experiments.py 033 --device h100-sxm    # simulator, GPU cost model
    python benchmarks/seed_experiments.py 031 --backend run        # real GPT-2 on this CPU
    python benchmarks/seed_experiments.py 033 --backend run --num-requests 32
    python benchmarks/seed_experiments.py all --backend sim
    python benchmarks/seed_experiments.py all --backend both --cost-model gpt2-cpu.json

``--backend both`` runs each experiment in the simulator, priced by ``--cost-model``
(a ``rose-run profile`` of GPT-2 on this CPU, or step logs), and for real, and says
for each metric whether the two backends move the same way from before to after.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import pandas as pd
from seed_recipes import SEED_EXPERIMENTS, SeedExperiment

from roseinfer import workloads
from roseinfer.config import SchedulerConfig
from roseinfer.experiments.sweep import apply_overrides
from roseinfer.metrics import summarize

# What each post printed for its before -> after pair (ms; tokens/s), copied from
# ../shared/seeds as reference points (GPT-2 via HF; 031 on CPU, 032/033 on CUDA).
REPORTED: dict[str, dict[str, dict[str, float]]] = {
    "031": {
        "fifo": {"p99_ttft_ms": 532.18, "p99_itl_ms": 438.15, "p99_tpot_ms": 159.20, "tok/s": 186.22},
        "budget-224": {"p99_ttft_ms": 463.65, "p99_itl_ms": 340.15, "p99_tpot_ms": 156.88, "tok/s": 189.24},
    },
    "032": {
        "prefill-first": {"p99_ttft_ms": 211.24, "p99_itl_ms": 163.72, "p99_tpot_ms": 118.04, "tok/s": 963.54},
        "decode-first": {"p99_ttft_ms": 221.82, "p99_itl_ms": 139.56, "p99_tpot_ms": 112.51, "tok/s": 1016.65},
    },
    "033": {
        "budget": {"p99_ttft_ms": 1144.49, "p99_itl_ms": 189.82, "p99_tpot_ms": 146.08, "tok/s": 751.55},
        "pack+ff8": {"p99_ttft_ms": 689.69, "p99_itl_ms": 221.63, "p99_tpot_ms": 158.17, "tok/s": 763.48},
    },
    "027": {"fifo": {"p99_ttft_ms": 775.59, "tok/s": 165.28}},
    "004-prefix": {"prefix-cache": {"p99_ttft_ms": 260.26, "p99_itl_ms": 150.47, "tok/s": 253.68}},
}  # fmt: skip

COLUMNS = [
    "variant",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p50_itl_ms",
    "p99_itl_ms",
    "p99_e2el_ms",
    "output_throughput",
    "preemptions",
]


def base_config(model_len: int) -> SchedulerConfig:
    """Roomy KV pool and GPT-2's context; variants override the rest."""
    return SchedulerConfig(num_kv_blocks=4096, block_size=16, max_model_len=model_len)


def run_sim(
    exp: SeedExperiment, requests: list, device: str, cost_files: list[str] | None = None
) -> pd.DataFrame:
    """Every variant in the simulator: GPT-2's roofline on ``device``, or priced by a
    calibration (``cost_files``: a profile and/or step logs)."""
    from roseinfer.calibration.profile import load_calibration
    from roseinfer.simulator import make_cost_model, simulate

    cost = (
        load_calibration(cost_files).cost_model() if cost_files else make_cost_model("gpt2", device)
    )
    rows = []
    for label, overrides in exp.variants.items():
        result = simulate(requests, apply_overrides(base_config(1024), overrides), cost)
        rows.append({"variant": label, **summarize(result.records, duration_s=result.duration_s)})
    return pd.DataFrame(rows)


def run_real(exp: SeedExperiment, requests: list, device: str, seed: int) -> pd.DataFrame:
    """Every variant on the executor with GPT-2 124M (random weights)."""
    import torch

    from roseinfer.executor.engine import Engine
    from roseinfer.executor.model_runner import ModelRunner
    from roseinfer.executor.models import build_model

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model, _, _ = build_model("gpt2", seed=seed, dtype=dtype, device=device)
    rows = []
    for label, overrides in exp.variants.items():
        config = apply_overrides(base_config(1024), overrides)
        runner = ModelRunner(
            model, num_kv_blocks=config.num_kv_blocks, block_size=config.block_size,
            device=device, dtype=dtype,
        )  # fmt: skip
        result = Engine(runner, config, seed=seed).run(requests)
        rows.append({"variant": label, **summarize(result.records, duration_s=result.duration_s)})
    return pd.DataFrame(rows)


def show(name: str, exp: SeedExperiment, df: pd.DataFrame, where: str) -> None:
    """Print ours next to the post's figures."""
    print(f"\n=== {exp.title} [{where}] ===")
    print(df[[c for c in COLUMNS if c in df]].round(2).to_string(index=False))
    reported = REPORTED.get(name)
    if reported:
        print(f"post ({exp.workload.seed_file}, {exp.device}):")
        print(pd.DataFrame(reported).T.to_string())
    if len(df) == 2:
        a, b = df.iloc[0], df.iloc[1]
        for key in ("p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "output_throughput"):
            change = (b[key] - a[key]) / a[key] * 100 if a[key] else float("nan")
            print(f"  {key}: {a[key]:.2f} -> {b[key]:.2f} ({change:+.1f}%)")


DIRECTION_METRICS = ("p99_ttft_ms", "p50_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "output_throughput")


def directions(sim: pd.DataFrame, real: pd.DataFrame) -> pd.DataFrame:
    """Per metric: the before -> after change in each backend and whether they agree
    (a change under 2% in both counts as agreeing: no effect either way)."""
    rows = []
    for key in DIRECTION_METRICS:
        (s0, s1), (r0, r1) = sim[key].iloc[:2], real[key].iloc[:2]
        ds, dr = (s1 - s0) / s0, (r1 - r0) / r0
        same = (abs(ds) < 0.02 and abs(dr) < 0.02) or (ds > 0) == (dr > 0)
        rows.append({"metric": key, "sim": f"{ds:+.0%}", "real": f"{dr:+.0%}",
                     "agree": "yes" if same else "NO"})  # fmt: skip
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=[*SEED_EXPERIMENTS, "all"])
    parser.add_argument("--backend", choices=["sim", "run", "both"], default="sim")
    parser.add_argument(
        "--cost-model",
        nargs="+",
        help="sim: price with these calibration files (profile, step logs)",
    )
    parser.add_argument(
        "--device",
        help="sim: a device spec (default: cpu for the posts run on CPU, h100-sxm for "
        "those run on CUDA); run: cpu or cuda (default cpu)",
    )
    parser.add_argument("--num-requests", type=int, help="scale the request count down")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = list(SEED_EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; backend {args.backend}")
    for name in names:
        overrides: dict[str, Any] = {"seed": args.seed}
        if args.num_requests:
            overrides["num_requests"] = args.num_requests
        exp = SEED_EXPERIMENTS[name]
        requests = workloads.seed_workload(name, **overrides)
        start = time.perf_counter()
        if args.backend == "sim":
            device = args.device or ("cpu" if exp.device == "cpu" else "h100-sxm")
            df = run_sim(exp, requests, device, args.cost_model)
        else:
            device = args.device or "cpu"
            df = run_real(exp, requests, device, args.seed)
        if args.backend == "both":
            sim = run_sim(exp, requests, device, args.cost_model)
            show(name, exp, sim, f"sim ({args.cost_model or 'roofline'}), {len(requests)} requests")
            if len(df) == 2:
                print("  before -> after, sim vs real:")
                print(directions(sim, df).to_string(index=False))
        where = f"{args.backend}, {device}, {len(requests)} requests"
        show(name, exp, df, where)
        print(f"  ({time.perf_counter() - start:.1f} s wall)")


if __name__ == "__main__":
    main()
