"""rose-sim's own spread on the GPU fidelity check's runs: each real run priced by the check's
GPU profile under several step-jitter seeds.

The check (``../shared/checks/20-gpu-fidelity``) simulates each run once, with the profile's step
jitter at seed 0, and a p99 of a 500-request run moves with the seed (which steps draw a stretched
factor). This prints, per run folder R (``benchmarks/gpu/results/h100-2026-11-27*-checks``, laid
out as ``benchmarks/gpu/sim_vs_check20.sh`` expects) and run, the mean and the range over seeds of
the signed error ``sim / real - 1`` of every metric, then the mean |error| of the p50 and the p99
metrics over all runs. ``--draw-neighbours 1,30`` compares how many eager single draws the
interpolation averages (``calibration/step_model.py`` ``EAGER_DRAW_NEIGHBOURS``; 1: none).

    python benchmarks/gpu/jitter_seeds.py benchmarks/gpu/results/h100-2026-11-27-checks \\
        benchmarks/gpu/results/h100-2026-11-27b-checks --seeds 4 --draw-neighbours 1,30

Runs on a CPU, about 2 s per simulation (runs x seeds x neighbour counts of them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import roseinfer.calibration.step_model as step_model
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.step_model import ProfiledCostModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_vs_run import prepare  # noqa: E402 -- a sibling script

COMBOS = {
    "1": "--policy budget --prefill-max-tokens 2048",
    "2": "--policy pack --prefill-max-tokens 2048 --force-fifo-every 8 --loop-order decode-first",
}
METRICS = ("duration",) + tuple(
    f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p99")
)


def run_errors(folder: Path, run: str, seeds: int) -> np.ndarray:
    """``[seeds, len(METRICS)]``: the errors of run ``run`` (``1s``, ``2l``, ...) of
    ``folder`` priced by its profile under jitter seeds 0 .. seeds - 1."""
    i, load = run
    saturated = json.loads((folder / "check20" / f"r{i}s.json").read_text())
    real = json.loads((folder / "check20" / f"r{run}.json").read_text())
    rate = "inf" if load == "s" else repr(0.6 * saturated["completed"] / saturated["duration"])
    sim = prepare(
        f"--model llama-3.1-8b --hardware h100-sxm --num-requests 500 --max-model-len 4096 "
        f"--seed 0 {COMBOS[i]} --request-rate {rate} --num-kv-blocks {real['num_kv_blocks']}".split()
    )
    profile = load_calibration([folder / "check20" / "p.json"]).cost_model()
    assert isinstance(profile, ProfiledCostModel) and profile.jitter is not None
    out = []
    for seed in range(seeds):
        cost = ProfiledCostModel(
            profile.model, profile.label, profile.held_out, profile.fit_source,
            profile.sample_range, dataclasses.replace(profile.jitter, seed=seed),
        )  # fmt: skip
        summary = sim.run(cost)
        out.append([summary[k] / real[k] - 1 for k in METRICS])
    return np.array(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, simulate every run under every seed, print the spread."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", type=Path, nargs="+", help="check 20 result folders (R)")
    p.add_argument("--seeds", type=int, default=8, help="jitter seeds per run (default 8)")
    p.add_argument("--draw-neighbours", default=str(step_model.EAGER_DRAW_NEIGHBOURS),
                   help="comma-separated EAGER_DRAW_NEIGHBOURS values to compare")  # fmt: skip
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    p50 = [j for j, k in enumerate(METRICS) if not k.startswith("p99")]
    p99 = [j for j, k in enumerate(METRICS) if k.startswith("p99")]
    for k in (int(v) for v in args.draw_neighbours.split(",")):
        step_model.EAGER_DRAW_NEIGHBOURS = k
        means = []
        print(
            f"== {k} draw neighbours, {args.seeds} jitter seeds: mean [min, max] of sim / real - 1"
        )
        for folder in args.folders:
            for run in ("1s", "1l", "2s", "2l"):
                errors = run_errors(folder, run, args.seeds)
                means.append(errors.mean(axis=0))
                cells = (f"{m.replace('_ms', '')} {errors[:, j].mean():+.1%} "
                         f"[{errors[:, j].min():+.1%}, {errors[:, j].max():+.1%}]"
                         for j, m in enumerate(METRICS))  # fmt: skip
                print(f"{folder.name} {run}: " + "; ".join(cells))
        a = np.abs(np.array(means))
        print(f"mean |error| over runs: p50 metrics {a[:, p50].mean():.2%}, "
              f"p99 {a[:, p99].mean():.2%}; worst run mean p50 {a[:, p50].max():.1%}, "
              f"p99 {a[:, p99].max():.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
