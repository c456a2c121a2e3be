"""rose-sim against real rose-run results: each cost model's error on the runs' metrics.

Simulates the run's requests with rose-sim's own flags (everything after ``--``) once per
cost model: the built-in ``--hardware`` spec as it stands (measured where ``calibration/specs.py``
records a measurement; also with its measured eager step jitter, ``--step-jitter measured``),
the same spec with its datasheet constants, and each ``--calibration``
file (a profile or a step log, as ``rose-sim --cost-model``; ``A,B`` pools them, and a profile
with repetitions is priced with and without its step jitter). Prints, per cost model, the signed
error ``sim / real - 1`` of duration, output throughput and p50/p99 TTFT, TPOT, ITL and E2EL.
Given several real results of the same command (repeats, other leases of the same GPU kind), the
real value is their mean; a row gives the runs' spread (``(max - min) / mean``, the noise floor)
and ``*`` marks a simulated value inside the runs' range. Runs on a CPU; the real results come
from GPU runs (``rose-run --save-result``).

    python benchmarks/gpu/sim_vs_run.py benchmarks/gpu/results/h100-2026-11-26/run-budget.json \\
        --calibration benchmarks/gpu/results/h100-2026-11-26/steps-budget.jsonl -- \\
        --model llama-3.1-8b --hardware h100-sxm --policy budget --prefill-max-tokens 8192 \\
        --num-requests 400 --request-rate inf --max-model-len 8192 --num-kv-blocks 27643
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roseinfer.calibration.cost_model import CostModel, RooflineCostModel
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.specs import DATASHEET_DEVICES
from roseinfer.calibration.step_model import ProfiledCostModel
from roseinfer.cli.config import check_args
from roseinfer.cli.sim_flags import build_parser, run_config, setup_of
from roseinfer.cli.workload import build_workload, fit_workload
from roseinfer.metrics.summary import summarize
from roseinfer.registry import load_registry
from roseinfer.simulator.engine import simulate

METRICS = ("duration", "output_throughput") + tuple(
    f"{q}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for q in ("p50", "p99")
)


def cost_models(base: CostModel, calibrations: Sequence[str]) -> dict[str, CostModel]:
    """The built-in spec (and with its measured eager step jitter, when it has
    one), its datasheet constants, and each calibration file, by label."""
    out: dict[str, CostModel] = {base.source: base}
    jittered = base.with_step_jitter() if isinstance(base, RooflineCostModel) else None
    if jittered is not None and jittered.jitter is not None:
        out[jittered.source + " (--step-jitter measured)"] = jittered
    if isinstance(base, RooflineCostModel) and base.device.name in DATASHEET_DEVICES:
        datasheet = DATASHEET_DEVICES[base.device.name]
        if datasheet != base.device:
            out[f"roofline {datasheet.name}, datasheet constants"] = RooflineCostModel(
                base.model,
                datasheet,
                base.tensor_parallel,
                base.pipeline_parallel,
                base.link,
                base.graphs,
            )
    for item in calibrations:
        model = load_calibration(item.split(",")).cost_model()
        if isinstance(model, ProfiledCostModel) and model.jitter is not None:
            medians = model.without_jitter()
            out[medians.source + " (medians, --step-jitter off)"] = medians
        out[model.source] = model
    return out


def errors(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    """``sim / real - 1`` per metric of :data:`METRICS` the real run has."""
    return {k: sim[k] / real[k] - 1 for k in METRICS if real.get(k) and sim.get(k) is not None}


def mean_run(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Per metric of :data:`METRICS` every run has, the runs' mean."""
    return {k: sum(r[k] for r in runs) / len(runs) for k in METRICS if all(r.get(k) for r in runs)}


def spread(runs: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Per metric every run has, the ``(min, max)`` of the runs."""
    return {
        k: (min(r[k] for r in runs), max(r[k] for r in runs))
        for k in METRICS
        if all(r.get(k) for r in runs)
    }


@dataclasses.dataclass(frozen=True)
class Simulation:
    """What rose-sim's flags make of a run: its requests, config and setup."""

    requests: list[Any]
    config: Any
    setup: Any
    registry: Any

    def run(self, cost: CostModel) -> dict[str, Any]:
        """The summary of the requests simulated with ``cost``."""
        result = simulate(self.requests, self.config, cost, registry=self.registry)
        return dict(summarize(result.columns, duration_s=result.duration_s, itl=result.itl))


def prepare(sim_argv: Sequence[str]) -> Simulation:
    """rose-sim's flags ``sim_argv`` as a :class:`Simulation` (the workload built and
    fitted to the limits, as rose-sim does)."""
    sim_args = build_parser().parse_args(list(sim_argv))
    registry = load_registry()
    options = check_args(sim_args, registry)
    setup = setup_of(sim_args)
    requests, _ = build_workload(sim_args)
    requests, _ = fit_workload(sim_args, requests, sim_args.max_model_len or setup.max_model_len,
                               default=setup.fit_lengths)  # fmt: skip
    return Simulation(requests, run_config(sim_args, registry, options, setup), setup, registry)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, simulate once per cost model, print the error table."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, sim_argv = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("real", type=Path, nargs="+",
                   help="rose-run result files (--save-result) of the same command")  # fmt: skip
    p.add_argument(
        "--calibration",
        nargs="*",
        default=[],
        help="profiles / step logs to price with, each alone; FILE,FILE pools them in one fit",
    )
    p.add_argument("--output", type=Path, help="write the errors as JSON")
    args = p.parse_args(own)
    runs = [json.loads(path.read_text()) for path in args.real]
    real, ranges = mean_run(runs), spread(runs)
    sim = prepare(sim_argv)
    sims = {
        label: sim.run(cost)
        for label, cost in cost_models(sim.setup.cost_model, args.calibration).items()
    }
    rows = {label: errors(real, s) for label, s in sims.items()}
    for i, label in enumerate(rows, 1):
        print(f"[{i}] {label}")
    names = (k.replace("_ms", "").replace("output_throughput", "out tok/s") for k in METRICS)
    print("cost model  " + "  ".join(f"{k:>10}" for k in names))
    if len(runs) > 1:
        print(f"{'real runs':<10}  " + "  ".join(
            f"{(ranges[k][1] - ranges[k][0]) / real[k]:>10.1%}" if k in ranges else f"{'-':>10}"
            for k in METRICS))  # fmt: skip
    for i, (label, errs) in enumerate(rows.items(), 1):
        marks = {} if len(runs) == 1 else {
            k: "*" if lo <= sims[label][k] <= hi else " " for k, (lo, hi) in ranges.items()
        }  # fmt: skip
        cells = (f"{errs[k]:+9.1%}{marks.get(k, '')}" if k in errs else f"{'-':>10}"
                 for k in METRICS)  # fmt: skip
        print(f"{f'[{i}]':<10}  " + "  ".join(cells))
    if len(runs) > 1:
        print(
            f"errors against the mean of {len(runs)} real runs; 'real runs': their (max - "
            "min) / mean; *: the simulated value lies within the runs' range"
        )
    if args.output:
        args.output.write_text(json.dumps({"real": [str(r) for r in args.real], "real_mean": real,
                                           "errors": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
