"""Reproduce a seed post's before/after experiment with one command.

Runs every variant the post compares (``seed_recipes.SEED_EXPERIMENTS``) on the
same workload, in the simulator (``--backend sim``: a cost model) or on the real
executor (``--backend run``: GPT-2 124M with random weights, the posts' model
and dtype), and compares the direction and size of each before -> after change
with the post's own table.

    python benchmarks/seed_experiments.py 031                      # simulator, CPU roofline
    python benchmarks/seed_experiments.py 033 --hardware h100-sxm  # simulator, GPU roofline
    python benchmarks/seed_experiments.py 031 --backend run        # real GPT-2 on this CPU
    python benchmarks/seed_experiments.py all --backend run --device cuda --repeats 3
    python benchmarks/seed_experiments.py all --backend both --device cuda --cost-model gpu.json
    python benchmarks/seed_experiments.py 004-prefix-shared --step-check --device cuda

A real run is warmed up before its clock starts (the largest step shapes, and
``--warmup-runs`` untimed runs of the first variant: a cold CUDA context cost the
027 burst 1.8 s), and every variant runs ``--repeats`` times, interleaved, so the
spread of the repeats (the noise floor) says which changes are real. Per post
and metric the table says ``agree`` (same direction as the post), ``DISAGREE``
or ``noise`` (our change is inside the repeats' spread). ``--backend both`` also
says whether the simulator moves each metric the way the real runs do.
``--step-check`` times the steps a prefix-cache hit changes (see
:func:`prefix_step_check`).
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

# What each post printed for each variant (ms; tokens/s), from ../shared/seeds (GPT-2
# via HF transformers, float32; 027/031/004 on CPU, 032/033 on CUDA). 027 and 004
# compare implementations, not flags: 027's "before" submitted requests slowly (its
# TTFT hid the queue), so only its "after" is a reference; 004's "before" prefilled
# prefix-cache misses one request at a time, ours as one request per prefill step.
REPORTED: dict[str, dict[str, dict[str, float]]] = {
    "031": {
        "fifo": {"p99_ttft_ms": 532.18, "p99_itl_ms": 438.15, "p99_tpot_ms": 159.20, "output_throughput": 186.22},
        "budget-224": {"p99_ttft_ms": 463.65, "p99_itl_ms": 340.15, "p99_tpot_ms": 156.88, "output_throughput": 189.24},
    },
    "032": {
        "prefill-first": {"p99_ttft_ms": 211.24, "p99_itl_ms": 163.72, "p99_tpot_ms": 118.04, "output_throughput": 963.54},
        "decode-first": {"p99_ttft_ms": 221.82, "p99_itl_ms": 139.56, "p99_tpot_ms": 112.51, "output_throughput": 1016.65},
    },
    "033": {
        "budget": {"p99_ttft_ms": 1144.49, "p99_itl_ms": 189.82, "p99_tpot_ms": 146.08, "output_throughput": 751.55},
        "pack+ff8": {"p99_ttft_ms": 689.69, "p99_itl_ms": 221.63, "p99_tpot_ms": 158.17, "output_throughput": 763.48},
    },
    "027": {"fifo": {"p99_ttft_ms": 775.59, "output_throughput": 165.28}},
    "004-prefix": {
        "serial-miss-prefill": {"p99_ttft_ms": 798.77, "p99_itl_ms": 400.98, "p99_tpot_ms": 165.49, "output_throughput": 163.84},
        "batched-prefill": {"p99_ttft_ms": 260.26, "p99_itl_ms": 150.47, "p99_tpot_ms": 106.35, "output_throughput": 253.68},
    },
}  # fmt: skip

METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
           "p99_e2el_ms", "output_throughput")  # fmt: skip
NO_CHANGE = 0.02  # a change under 2% (in a noise-free simulation) counts as none


def base_config(model_len: int) -> SchedulerConfig:
    """Roomy KV pool and the model's context (GPT-2's 1024); variants override the rest."""
    return SchedulerConfig(num_kv_blocks=4096, block_size=16, max_model_len=model_len)


def run_sim(
    exp: SeedExperiment, requests: list, hardware: str, cost_files: list[str] | None = None,
    dtype_bytes: int | None = None, model: str = "gpt2",
) -> pd.DataFrame:  # fmt: skip
    """Every variant once in the simulator: ``model``'s roofline on ``hardware``, or
    priced by a calibration (``cost_files``: a profile and/or step logs)."""
    from roseinfer.calibration.profile import load_calibration
    from roseinfer.simulator import make_cost_model, simulate

    cost = (
        load_calibration(cost_files).cost_model()
        if cost_files
        else make_cost_model(sim_model_spec(model), hardware, dtype_bytes)
    )
    rows = []
    for label, overrides in exp.variants.items():
        config = apply_overrides(base_config(sim_model_spec(model).max_model_len), overrides)
        result = simulate(requests, config, cost)
        summary = summarize(result.records, duration_s=result.duration_s)
        rows.append({"variant": label, "repeat": 0, **summary})
    return pd.DataFrame(rows)


def sim_model_spec(model: str):  # type: ignore[no-untyped-def]
    """The simulator's shape of ``model``: a built-in spec, else the executor's
    built-in config of that name (e.g. ``tiny-gpt2``; needs transformers)."""
    from roseinfer.calibration.specs import ModelSpec, UnknownSpecError, get_model_spec

    try:
        return get_model_spec(model)
    except UnknownSpecError:
        from roseinfer.executor.models import builtin_config

        return ModelSpec.from_hf_config(builtin_config(model), name=model)


def run_real(exp: SeedExperiment, requests: list, args: argparse.Namespace) -> pd.DataFrame:
    """Every variant on the executor (GPT-2 124M, random weights), ``args.repeats``
    times interleaved, after ``args.warmup_runs`` untimed runs; each timed run is
    also warmed up on its largest step shapes (``ExecutorReplay``)."""
    replay = _replay(args)
    base = base_config(sim_model_spec(args.model).max_model_len)
    variants = {label: apply_overrides(base, o) for label, o in exp.variants.items()}
    first = next(iter(variants.values()))
    for _ in range(args.warmup_runs):
        replay(requests, first)
    rows = []
    for repeat in range(args.repeats):
        for label, config in variants.items():
            run = replay(requests, config)
            summary = summarize(run.records, duration_s=run.duration_s)
            rows.append({"variant": label, "repeat": repeat, **summary})
    return pd.DataFrame(rows)


def _replay(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """An ``ExecutorReplay`` of ``args.model`` on ``args.device`` (random weights)."""
    import torch

    from roseinfer.executor.models import build_model
    from roseinfer.executor.replay import ExecutorReplay

    dtype = getattr(torch, args.dtype)
    model, _, _ = build_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    return ExecutorReplay(model, device=args.device, dtype=dtype, seed=args.seed)


def spread_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per variant and metric: the mean over repeats and the spread (max - min) / mean."""
    rows = []
    for label, runs in df.groupby("variant", sort=False):
        row: dict[str, Any] = {"variant": label, "runs": len(runs)}
        for m in METRICS:
            mean = runs[m].mean()
            row[m] = mean
            row[f"{m}_spread"] = (runs[m].max() - runs[m].min()) / mean if mean else 0.0
        rows.append(row)
    return pd.DataFrame(rows)


def change(table: pd.DataFrame, metric: str) -> tuple[float, float]:
    """The first -> last variant change of ``metric`` (fraction) and its noise
    floor (the larger spread of the two variants' repeats)."""
    a, b = table.iloc[0], table.iloc[-1]
    delta = (b[metric] - a[metric]) / a[metric] if a[metric] else float("nan")
    return delta, max(a.get(f"{metric}_spread", 0.0), b.get(f"{metric}_spread", 0.0))


def verdict(ours: float, noise: float, theirs: float, them: str = "post") -> str:
    """``agree`` / ``DISAGREE`` on the direction, or ``noise`` when our change lies
    within the repeats' spread (or under :data:`NO_CHANGE` without repeats)."""
    if abs(ours) <= max(noise, NO_CHANGE if noise == 0 else 0.0):
        return "noise" if noise else "no change"
    if abs(theirs) < NO_CHANGE:
        return f"DISAGREE ({them}: no change)"
    return "agree" if (ours > 0) == (theirs > 0) else "DISAGREE"


def against_post(name: str, table: pd.DataFrame) -> pd.DataFrame | None:
    """Per metric the post reported: its before -> after change, ours (± noise),
    the verdict and the size ratio; absolute values when the post has one variant."""
    reported = REPORTED.get(name)
    if not reported:
        return None
    post = list(reported.values())
    rows = []
    for m in post[-1]:
        row: dict[str, Any] = {"metric": m, "post": f"{post[-1][m]:.1f}",
                               "ours": f"{table.iloc[-1][m]:.1f}"}  # fmt: skip
        if len(post) == 2 and len(table) >= 2:
            theirs = (post[1][m] - post[0][m]) / post[0][m]
            ours, noise = change(table, m)
            row.update({"post change": f"{theirs:+.0%}", "our change": f"{ours:+.0%}",
                        "noise": f"±{noise:.0%}", "verdict": verdict(ours, noise, theirs),
                        "size ratio": f"{ours / theirs:.2f}" if theirs else "n/a"})  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def directions(sim: pd.DataFrame, real: pd.DataFrame) -> pd.DataFrame:
    """Per metric: the before -> after change in each backend and whether the
    simulator moves it the way the real runs do (``noise``: the real change lies
    within the repeats' spread)."""
    rows = []
    for m in METRICS:
        ds, _ = change(sim, m)
        dr, noise = change(real, m)
        rows.append({"metric": m, "sim": f"{ds:+.0%}", "real": f"{dr:+.0%} (±{noise:.0%})",
                     "agree": verdict(dr, noise, ds, "sim")})  # fmt: skip
    return pd.DataFrame(rows)


def show(name: str, exp: SeedExperiment, table: pd.DataFrame, where: str) -> None:
    """Ours (mean of the repeats, with spreads) and the comparison with the post."""
    print(f"\n=== {exp.title} [{where}] ===")
    spreads = table["runs"].max() > 1
    cols = ["variant", "runs", *[c for m in METRICS for c in (m, f"{m}_spread")[: 1 + spreads]]]
    print(table[[c for c in cols if c in table]].round(3).to_string(index=False))
    compared = against_post(name, table)
    if compared is not None:
        print(f"against the post ({exp.workload.seed_file}, run on {exp.device}):")
        print(compared.to_string(index=False))


# ---------------------------------------------------------------- step check


def prefix_step_check(args: argparse.Namespace, block_size: int = 16) -> pd.DataFrame:
    """Time the prefill step of the 004 shared-prompt burst with and without prefix hits.

    The burst is ``N`` requests of one ``P``-token prompt at t=0. Without the
    cache the first step prefills all ``N x P`` tokens; with it the first request
    computes the prompt and the others hit its full blocks and compute the rest
    (``P - cached`` tokens on a ``P``-token context, as the scheduler plans it).
    A hit that makes the step slower than the miss step it replaces is a defect
    of the attention path (cached prefixes read through the block table); the
    third shape computes the hit step's new tokens without the cached context,
    so hit vs no-context isolates the cost of reading the prefix.
    """
    import torch

    from roseinfer.executor.builder import new_runner
    from roseinfer.executor.models import build_model
    from roseinfer.executor.profiler import time_grid

    spec = workloads.SEED_WORKLOADS["004-prefix-shared"].spec
    n, p = spec.num_requests, spec.prompt_tokens
    cached = (p - 1) // block_size * block_size
    shapes = {
        "miss (cache off)": [(p, p)] * n,
        "hit (cache on)": [(p, p)] + [(p - cached, p)] * (n - 1),
        "hit's new tokens, no context": [(p, p)] + [(p - cached, p - cached)] * (n - 1),
    }
    dtype = getattr(torch, args.dtype)
    model, _, _ = build_model(args.model, seed=args.seed, dtype=dtype, device=args.device)
    pool = SchedulerConfig(num_kv_blocks=4 * n * -(-p // block_size), block_size=block_size,
                           max_num_seqs=n, max_model_len=p)  # fmt: skip
    runner = new_runner(model, pool, device=args.device, dtype=dtype)
    timed = time_grid(runner, [("prefill", s) for s in shapes.values()], repetitions=7)
    rows = [{"step": name, "tokens": sum(a for a, _ in s), "median_ms": 1e3 * pd.Series(t).median()}
            for name, (_, s, t) in zip(shapes, timed)]  # fmt: skip
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Flags of the seed benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=[*SEED_EXPERIMENTS, "all"])
    p.add_argument("--backend", choices=["sim", "run", "both"], default="sim")
    p.add_argument("--cost-model", nargs="+", help="sim: price with these calibration files")
    p.add_argument("--hardware", help="sim: a device spec (default: cpu for the posts run on "
                   "CPU, h100-sxm for those on CUDA; with --device cuda, h100-sxm)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="run: the torch device, cpu or cuda[:N]")
    p.add_argument("--model", default="gpt2",
                   help="GPT-2 124M (the posts'), or another built-in shape (e.g. tiny-gpt2)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="run: GPT-2's dtype (default float32, as the posts' HF GPT-2)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="run: timed runs per variant")
    p.add_argument("--warmup-runs", type=int,
                   help="run: untimed runs before timing (default 1 on CUDA, 0 on CPU)")  # fmt: skip
    p.add_argument("--num-requests", type=int, help="scale the request count down")
    p.add_argument("--step-check", action="store_true",
                   help="time the 004 burst's prefill step with and without prefix hits")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    return p


def hardware_for(args: argparse.Namespace, exp: SeedExperiment) -> str:
    """The simulated spec: ``--hardware``, else the GPU roofline for CUDA runs or
    posts, else the CPU roofline."""
    if args.hardware:
        return str(args.hardware)
    on_gpu = args.device.startswith("cuda") or exp.device == "cuda"
    return "h100-sxm" if on_gpu else "cpu"


def run_one(name: str, args: argparse.Namespace) -> None:
    """One post's experiment on the chosen backend(s)."""
    overrides: dict[str, Any] = {"seed": args.seed}
    overrides["vocab_size"] = sim_model_spec(args.model).vocab_size  # GPT-2's for the posts
    if args.num_requests:
        overrides["num_requests"] = args.num_requests
    exp = SEED_EXPERIMENTS[name]
    requests = workloads.seed_workload(name, **overrides)
    start, hardware = time.perf_counter(), hardware_for(args, exp)
    dtype_bytes = {"float32": 4}.get(args.dtype, 2) if args.backend == "both" else None
    if args.backend in ("sim", "both"):
        sim = spread_table(
            run_sim(exp, requests, hardware, args.cost_model, dtype_bytes, args.model)
        )
        priced = " ".join(args.cost_model) if args.cost_model else f"roofline {hardware}"
        show(name, exp, sim, f"sim, {priced}, {len(requests)} requests")
    if args.backend in ("run", "both"):
        real = spread_table(run_real(exp, requests, args))
        show(name, exp, real, f"run, {args.device} {args.dtype}, {len(requests)} requests, "
             f"{args.repeats} repeats")  # fmt: skip
        if args.backend == "both" and len(real) >= 2:
            print("before -> after, does the simulator move each metric the real way?")
            print(directions(sim, real).to_string(index=False))
    print(f"  ({time.perf_counter() - start:.1f} s wall)")


def main() -> None:
    """Entry point."""
    args = build_parser().parse_args()
    if (
        args.hardware is None
        and args.backend == "sim"
        and not args.device.startswith(("cpu", "cuda"))
    ):
        args.hardware, args.device = args.device, "cpu"  # the older `--device SPEC` of the sim
    if args.warmup_runs is None:
        args.warmup_runs = 1 if args.device.startswith("cuda") else 0
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus; backend {args.backend}")
    if args.step_check:
        print(prefix_step_check(args).round(2).to_string(index=False))
        return
    names = list(SEED_EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    for name in names:
        run_one(name, args)


if __name__ == "__main__":
    main()
