"""Where a real run loses against its floor: step classes' time over their floor, from step logs.

For each step log (``rose-run --save-steps``, ``gpu_throughput.py --save-steps``), steps are
grouped by class (decodes by batch size; prefill-only and mixed steps by new tokens) and the
script prints, per class, the steps, their floor (``max(bytes / bandwidth, FLOPs / peak)`` of
the logged model, as ``decode_skew.py`` computes it), their device time (``forward_s``), their
wall time (``end_s - start_s``: host work between forwards included), the two ratios, and each
class's share of the run's time above the floor: the classes worth optimizing first. A
workload's "floor / measured" in ``gpu_throughput.py`` is the total line's floor over its wall.

    python benchmarks/gpu/step_floor.py benchmarks/gpu/results/h100-2026-11-26/steps-budget.jsonl

Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from decode_skew import H100_MEASURED_BANDWIDTH, H100_MEASURED_FLOPS, floor_model

from roseinfer.calibration.steplog import StepLogError, load_step_log

DECODE_EDGES = (1, 64, 128, 192, 257, 1 << 20)
TOKEN_EDGES = (1, 512, 2048, 4096, 8193, 1 << 30)


def step_class(num_prefill_tokens: int, num_decodes: int) -> str:
    """``decode B1-B2`` by batch size, else ``prefill``/``mixed`` by new prefill tokens."""
    if not num_prefill_tokens:
        lo, hi = _bucket(num_decodes, DECODE_EDGES)
        return f"decode {lo}-{hi - 1}"
    lo, hi = _bucket(num_prefill_tokens, TOKEN_EDGES)
    return f"{'mixed' if num_decodes else 'prefill'} {lo}-{hi - 1} tok"


def _bucket(value: int, edges: Sequence[int]) -> tuple[int, int]:
    for lo, hi in zip(edges, edges[1:], strict=False):
        if lo <= value < hi:
            return lo, hi
    return edges[-2], edges[-1]


def class_table(path: str, bandwidth: float, flops: float) -> list[str]:
    """The per-class lines of one step log, and its total."""
    log = load_step_log(path)
    floor = floor_model(log.header, bandwidth, flops)
    sums: dict[str, list[float]] = {}
    for r in log.records:
        shape = r.shape
        key = step_class(int(shape.prefill_new_tokens.sum()), len(shape.decode_context_tokens))
        forward = r.forward_s if r.forward_s is not None else r.duration_s
        row = sums.setdefault(key, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += floor.step_time_s(shape)
        row[2] += forward
        row[3] += r.duration_s
    total = [sum(v[i] for v in sums.values()) for i in range(4)]
    lost = total[3] - total[1]
    lines = [path, f"  {'class':<22} {'steps':>6} {'floor s':>8} {'device s':>9} {'wall s':>8} "
             f"{'dev/floor':>9} {'wall/floor':>10} {'of the loss':>11}"]  # fmt: skip
    for key, (n, f, d, w) in [*sorted(sums.items(), key=_order), ("total", total)]:
        share = (w - f) / lost if lost > 0 else 0.0
        lines.append(f"  {key:<22} {int(n):>6} {f:>8.2f} {d:>9.2f} {w:>8.2f} {d / f:>9.2f} "
                     f"{w / f:>10.2f} {share:>11.0%}")  # fmt: skip
    lines.append(f"  floor / wall: {total[1] / total[3]:.2f}")
    return lines


def _order(item: tuple[str, list[float]]) -> tuple[str, int]:
    kind, _, rest = item[0].partition(" ")
    return kind, int(rest.split("-")[0])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, print one table per log."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="step logs")
    p.add_argument("--bandwidth", type=float, default=H100_MEASURED_BANDWIDTH, help="B/s")
    p.add_argument("--flops", type=float, default=H100_MEASURED_FLOPS, help="FLOP/s")
    args = p.parse_args(argv)
    try:
        for path in args.logs:
            print("\n".join(class_table(path, args.bandwidth, args.flops)))
    except StepLogError as err:
        print(f"step_floor: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
