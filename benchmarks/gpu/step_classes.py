"""Real steps against their prices, class by class: where a GPU profile and the built-in roofline
are off, and how far the real steps stretch.

For each step log (``rose-run --save-steps``), steps are grouped by class (decodes by batch size,
prefills by token count) and the script prints, per class, the median of ``price / real`` for the
calibration (``--calibration``, a profile, priced at its medians) and for the built-in roofline
(``--hardware``), and for prefills the share of steps over 1.5x the calibration's price, the 99th
percentile of ``real / price`` and the worst step. Then, from the profile itself: the spread of
its repeated eager shapes under 20 ms (what its step jitter draws from for small prefills), how
many of its served run's eager steps exceed 2,048 tokens, how far its graph-replayed steps
scatter (repetitions around their medians, the served run's steps around the linear fit), with
``--prompts`` its price of single prompts over its linear model's (``--draw-neighbours`` sets
``step_model.EAGER_DRAW_NEIGHBOURS`` first; 1: no averaging of the served run's eager draws), and
with ``--decode-batches`` its price of even decode batches over the roofline's.

    python benchmarks/gpu/step_classes.py \\
        --calibration benchmarks/gpu/results/h100-2026-11-27b-checks/check20/p.json \\
        benchmarks/gpu/results/h100-2026-11-27b-checks/rerun-*/steps-*.jsonl.gz
    python benchmarks/gpu/step_classes.py --draw-neighbours 1 --prompts 1000,1100,1200 \\
        --calibration benchmarks/gpu/results/h100-2026-11-27-checks/check20/p.json

Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

import roseinfer.calibration.step_model as step_model
from roseinfer.calibration.cost_model import BatchShape, CostModel, make_cost_model
from roseinfer.calibration.graph_replay import GraphReplay
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.steplog import load_step_log

DECODE_CLASSES = ((1, 64), (64, 128), (128, 200), (200, 257))
PREFILL_CLASSES = ((0, 512), (512, 1024), (1024, 2049), (2049, 1 << 20))
STRETCHED = 1.5
GRAPH_STRETCHED = 1.25
"""Graph-replayed steps scatter less: their share over this ratio is printed."""
DECODE_CONTEXTS = (500, 1000, 2000, 3000)
"""Even contexts (tokens) ``--decode-batches`` prices decodes at."""


def log_table(path: Path, profile: CostModel, model: str, hardware: str) -> list[str]:
    """The per-class lines of one step log (the roofline of ``model`` on ``hardware``
    replaying the graphs the logged run replayed)."""
    log = load_step_log(path)
    graphs = GraphReplay.of_executor(log.header.get("executor") or {})
    roofline = make_cost_model(model, hardware, graphs=graphs)
    rows = []
    for r in log.records:
        if r.duration_s > 0:
            t = r.shape.totals()
            rows.append((r.kind, t.num_seqs, t.num_tokens, r.duration_s,
                         profile.step_time_s(r.shape), roofline.step_time_s(r.shape)))  # fmt: skip
    lines = [f"== {path} ({len(rows)} steps)"]
    for kind, axis, classes in (("decode", 1, DECODE_CLASSES), ("prefill", 2, PREFILL_CLASSES)):
        for lo, hi in classes:
            sel = [x for x in rows if x[0] == kind and lo <= x[axis] < hi]
            if not sel:
                continue
            a = np.array([x[1:] for x in sel], dtype=np.float64)
            real, prof, roof = a[:, 2], a[:, 3], a[:, 4]
            unit = "seqs" if kind == "decode" else "tokens"
            line = (f"{kind:7s} {unit} [{lo}, {hi}): {len(sel):5d} steps, real median "
                    f"{np.median(real) * 1e3:6.2f} ms; price / real median: profile "
                    f"{np.median(prof / real):.3f}, roofline {np.median(roof / real):.3f}")  # fmt: skip
            if kind == "prefill":
                stretch = real / prof
                worst = int(np.argmax(stretch))
                line += (f"; over {STRETCHED}x the profile {np.mean(stretch > STRETCHED):.0%}, "
                         f"p99 {np.quantile(stretch, 0.99):.2f}x, worst {real[worst] * 1e3:.1f} ms "
                         f"for {int(a[worst, 1])} tokens (priced {prof[worst] * 1e3:.1f} ms)")  # fmt: skip
            lines.append(line)
    return lines


def profile_lines(path: Path, prompts: Sequence[int]) -> list[str]:
    """What the profile itself says about small eager steps and single prompts."""
    profile = load_calibration([path])
    model = profile.step_fit.model
    linear = getattr(model, "fallback", model)
    reps, draws, big = [], 0, 0
    graph_reps, graph_draws = [], []  # graph-replayed: repetitions / median, served / linear fit
    # per class, each repeated shape's largest ratio, sequences, tokens and median
    worst: dict[str, list[tuple[float, int, int, float]]] = {"eager": [], "graph-replayed": []}
    for s in profile.samples:
        t = s.shape.totals()
        eager = profile.graphs.runs_eagerly(t.num_tokens, t.num_seqs)
        if len(s.times_s) > 1:
            top = float(max(s.times_s) / s.median_s)
            worst["eager" if eager else "graph-replayed"].append(
                (top, t.num_seqs, t.num_tokens, s.median_s)
            )
        if not eager:
            if len(s.times_s) > 1:
                graph_reps.extend(np.asarray(s.times_s) / s.median_s)
            else:
                agg = step_model.shape_aggregates(s.shape)[None]
                graph_draws.append(s.times_s[0] / float(linear.predict(agg)[0]))
            continue
        if len(s.times_s) > 1 and s.median_s < 0.020:
            reps.extend(np.asarray(s.times_s) / s.median_s)
        elif len(s.times_s) == 1:
            draws, big = draws + 1, big + int(t.num_tokens > 2048)
    lines = [f"== {path}"]
    if reps:
        r = np.array(reps)
        lines.append(f"eager repetitions under 20 ms: {r.size}, over {STRETCHED}x their median "
                     f"{np.mean(r > STRETCHED):.0%}, p99 {np.quantile(r, 0.99):.2f}x")  # fmt: skip
    lines.append(f"eager steps timed once (a served run's): {draws}, over 2,048 tokens: {big}")
    for name, ratios in (("graph-replayed repetitions / their median", graph_reps),
                         ("graph-replayed served steps / the linear fit", graph_draws)):  # fmt: skip
        if ratios:
            r = np.array(ratios)
            lines.append(f"{name}: {r.size}, over {GRAPH_STRETCHED}x {np.mean(r > GRAPH_STRETCHED):.1%}, "
                         f"p99 {np.quantile(r, 0.99):.2f}x, max {r.max():.2f}x")  # fmt: skip
    for kind, shapes in worst.items():
        if shapes:
            top = ", ".join(f"{x:.2f}x ({n} seqs, {k} tokens, median {m * 1e3:.1f} ms)"
                            for x, n, k, m in sorted(shapes, reverse=True)[:5])  # fmt: skip
            lines.append(f"largest {kind} repetitions (of {len(shapes)} repeated shapes): {top}")
    priced = profile.cost_model().without_jitter()
    for n in prompts:
        shape = BatchShape([n], [n], [])
        agg = step_model.shape_aggregates(shape)[None]
        ratio = priced.step_time_s(shape) / float(linear.predict(agg)[0])
        lines.append(f"a single {n}-token prompt: {priced.step_time_s(shape) * 1e3:.2f} ms, "
                     f"{ratio:.3f}x the linear model's price")  # fmt: skip
    return lines


def decode_lines(path: Path, batches: Sequence[int], model: str, hardware: str) -> list[str]:
    """The profile's price of decode batches of ``batches`` sequences at even contexts
    of 500-3,000 tokens, over the roofline's (replaying the profile's graphs)."""
    profile = load_calibration([path])
    priced = profile.cost_model().without_jitter()
    roofline = make_cost_model(model, hardware, graphs=profile.graphs)
    lines = []
    for n in batches:
        ratios = []
        for context in DECODE_CONTEXTS:
            shape = BatchShape((), (), (context,) * n)
            ratios.append(priced.step_time_s(shape) / roofline.step_time_s(shape))
        lines.append(f"decodes of {n} sequences at contexts {DECODE_CONTEXTS[0]}-"
                     f"{DECODE_CONTEXTS[-1]}: profile / roofline {min(ratios):.3f}-{max(ratios):.3f}")  # fmt: skip
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, print the profile's lines, then each step log's table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("steps", type=Path, nargs="*", help="step logs (--save-steps) of real runs")
    p.add_argument("--calibration", type=Path, required=True, help="a rose-run profile")
    p.add_argument("--model", default="llama-3.1-8b", help="the roofline's model (built-in)")
    p.add_argument("--hardware", default="h100-sxm", help="the roofline's device (built-in)")
    p.add_argument("--draw-neighbours", type=int, default=step_model.EAGER_DRAW_NEIGHBOURS,
                   help="step_model.EAGER_DRAW_NEIGHBOURS to load the profile with")  # fmt: skip
    p.add_argument("--prompts", default="", help="comma-separated prompt lengths to price")
    p.add_argument("--decode-batches", default="",
                   help="comma-separated decode batch sizes: the profile's price over the roofline's")  # fmt: skip
    args = p.parse_args(argv)
    if args.draw_neighbours < 1:
        p.error("--draw-neighbours must be >= 1")
    step_model.EAGER_DRAW_NEIGHBOURS = args.draw_neighbours
    prompts = [int(v) for v in args.prompts.split(",") if v]
    print("\n".join(profile_lines(args.calibration, prompts)))
    batches = [int(v) for v in args.decode_batches.split(",") if v]
    if batches:
        print("\n".join(decode_lines(args.calibration, batches, args.model, args.hardware)))
    profile = load_calibration([args.calibration]).cost_model().without_jitter()
    for path in args.steps:
        print("\n".join(log_table(path, profile, args.model, args.hardware)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
