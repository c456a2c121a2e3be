"""Large decode steps by context skew: how much a step's longest context costs a real run.

A decode batch large enough not to split keys runs one attention program per sequence and KV
head, so its longest context streams its keys alone after the rest are done (the tail that the
Triton backend's balanced key splits remove, when the warm-up keeps them). This reads real runs'
step logs (``rose-run --save-steps``) and groups their decode steps of at least ``--min-seqs``
sequences by skew, the longest context over the mean; per group it prints the steps, their mean
context, and the median of each step's time over its floor: ``max(bytes / bandwidth, FLOPs /
peak)`` of the logged model at ``--bandwidth`` and ``--flops`` (the roofline with no efficiency
factor or overhead, as ``gpu_throughput.py``'s floor; defaults: the peaks it measured on an H100
on 2026-11-27). It then says how many seconds the skewed steps took beyond the least-skewed
group's median ratio: the most that balancing the skewed steps could save, if their tail were all
that set them apart. The log header's ``attention_launches`` says whether a run kept balanced
splits (its ``balanced`` list).

    python benchmarks/gpu/decode_skew.py \\
        benchmarks/gpu/results/h100-2026-11-26-checks/steps-1s.jsonl.gz \\
        benchmarks/gpu/results/h100-2026-11-26-checks/steps-2s.jsonl.gz

Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from roseinfer.calibration.cost_model import RooflineCostModel
from roseinfer.calibration.specs import DATASHEET_DEVICES, ModelSpec, get_model_spec
from roseinfer.calibration.steplog import StepLogError, load_step_log

SKEW_EDGES = (1.0, 2.0, 3.0, 4.0, 6.0, float("inf"))
H100_MEASURED_BANDWIDTH = 3020e9  # B/s: a device-to-device copy on the H100, 2026-11-27
H100_MEASURED_FLOPS = 815e12  # FLOP/s: an 8192^3 bf16 matmul on the same card


def floor_model(header: dict, bandwidth: float, flops: float) -> RooflineCostModel:
    """The floor of the logged model (its header's spec, else the named built-in)."""
    model = header.get("model") or {}
    spec = model.get("spec")  # checked by load_step_log
    if isinstance(spec, dict):
        shape = ModelSpec(**spec)
    else:
        shape = get_model_spec(str(model.get("name") or "llama-3.1-8b"))
    device = dataclasses.replace(
        DATASHEET_DEVICES["h100-sxm"], mem_bandwidth=bandwidth, peak_flops=flops, mfu=1.0,
        bandwidth_efficiency=1.0, overhead_s=0.0,
    )  # fmt: skip
    return RooflineCostModel(shape, device)


def skew_rows(paths: Sequence[str], min_seqs: int, bandwidth: float, flops: float):
    """``(skew, mean context, seconds, floor seconds)`` of every decode-only step of at
    least ``min_seqs`` sequences in the logs, and each log's balanced-split keys."""
    rows, balanced = [], {}
    for path in paths:
        log = load_step_log(path)
        floor = floor_model(log.header, bandwidth, flops)
        launches = (log.header.get("executor") or {}).get("attention_launches") or {}
        balanced[path] = launches.get("balanced")
        for r in log.records:
            shape = r.shape
            contexts = shape.decode_context_tokens
            if len(shape.prefill_new_tokens) or len(contexts) < min_seqs or r.duration_s <= 0:
                continue
            mean = float(np.mean(contexts))
            seconds = r.forward_s if r.forward_s is not None else r.duration_s
            rows.append((max(contexts) / mean, mean, seconds, floor.step_time_s(shape)))
    return np.array(rows, dtype=np.float64).reshape(-1, 4), balanced


def report(rows: np.ndarray) -> list[str]:
    """The per-skew lines and the seconds the skewed steps took beyond the least-skewed
    group's median ratio."""
    lines = [f"{'skew':>9} {'steps':>6} {'mean ctx':>9} {'x floor (median)':>17}"]
    base = None
    extra = 0.0
    for lo, hi in zip(SKEW_EDGES, SKEW_EDGES[1:], strict=False):
        group = rows[(rows[:, 0] >= lo) & (rows[:, 0] < hi)]
        if not len(group):
            continue
        ratio = float(np.median(group[:, 2] / group[:, 3]))
        if base is None:
            base = ratio
        else:
            extra += float(np.sum(np.maximum(0.0, group[:, 2] - base * group[:, 3])))
        label = f"{lo:g}-{hi:g}" if hi != float("inf") else f">= {lo:g}"
        lines.append(f"{label:>9} {len(group):>6} {group[:, 1].mean():>9.0f} {ratio:>17.2f}")
    total = float(rows[:, 2].sum())
    lines.append(
        f"these steps: {total:.2f} s; beyond the least-skewed group's {base:.2f}x floor: "
        f"{extra:.2f} s ({extra / total:.0%})"
    )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, read the logs, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="step logs (rose-run --save-steps)")
    p.add_argument("--min-seqs", type=int, default=128, help="decode steps of at least this many")
    p.add_argument("--bandwidth", type=float, default=H100_MEASURED_BANDWIDTH, help="B/s")
    p.add_argument("--flops", type=float, default=H100_MEASURED_FLOPS, help="FLOP/s")
    args = p.parse_args(argv)
    try:
        rows, balanced = skew_rows(args.logs, args.min_seqs, args.bandwidth, args.flops)
    except StepLogError as err:
        print(f"decode_skew: error: {err}", file=sys.stderr)
        return 2
    for path, keys in balanced.items():
        said = "not recorded" if keys is None else (keys or "none")
        print(f"{path}: balanced splits {said}")
    if not len(rows):
        print(f"no decode step of >= {args.min_seqs} sequences in these logs", file=sys.stderr)
        return 1
    print("\n".join(report(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
