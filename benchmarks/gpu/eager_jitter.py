"""Where the eager-step stretch comes from: small prefills timed under four conditions.

On the H100 runs of ``20-gpu-fidelity`` (``benchmarks/gpu/results/h100-2026-11-26-checks``),
26-38% of the prefills under 256 tokens took over 1.25x their fitted time at 60% load, 2-3%
of those of 1,024-2,048 tokens and none above; the stretch sat inside the forward, not in
the scheduler's host time. This times prefills of one sequence on a runner built as rose-run
builds one, in four variants, each ``--steps`` times:

* ``same``: one prompt length, back to back;
* ``fresh``: a new length every step (never seen before: new GEMM row counts, new
  activation sizes for the caching allocator);
* ``after-decode``: a fresh length right after a CUDA-graph decode of ``--decode-batch``
  sequences, as a served run alternates them;
* ``after-idle``: a fresh length after the thread slept ``--idle-ms`` (as an engine
  waiting for an arrival).

Per variant it prints the median, the share of steps over 1.25x the variant's median for
their length bucket (lengths binned by powers of two), the 99th-percentile ratio, and the
host share of the stretched steps (the runner's launch time over the step's wall time): a
stretch with the host time grown with it is a slow launch loop on the CPU, one without is
the device; and the stretched steps' off-CPU share (1 - the launch's thread CPU time over its
wall time): a slow launch loop that was off the CPU was preempted or stolen. ``--output`` writes every step as JSON.

    python benchmarks/gpu/eager_jitter.py --output eager-jitter.json          # on the GPU
    python benchmarks/gpu/eager_jitter.py --cudagraph-mode FULL --output full-jitter.json
    python benchmarks/gpu/eager_jitter.py --variants same,fresh --steps 300 --op-times
    python benchmarks/gpu/eager_jitter.py --model tiny-llama --device cpu --steps 6 --small
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from roseinfer.calibration.graph_replay import CUDAGRAPH_MODES

VARIANTS = ("same", "fresh", "after-decode", "after-idle")
STRETCH = 1.25  # a step over this many times its bucket's median counts as stretched


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=150, help="prefills per variant (150)")
    p.add_argument("--min-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=32, help="decodes between prefills")
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--idle-ms", type=float, default=20.0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cudagraph-mode", choices=CUDAGRAPH_MODES, default=CUDAGRAPH_MODES[0],
                   help="FULL replays the prefills from graphs (rose-run's flag): whether "
                   "replayed prefills still stretch")  # fmt: skip
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (all four)")
    p.add_argument("--op-times", action="store_true",
                   help="time the host side of each layer's four calls (qkv, K/V store, "
                   "attention, rest of the layer) and say whether a stretch is spread over "
                   "them (a slower CPU) or sits in one call (a stall)")  # fmt: skip
    p.add_argument("--small", action="store_true", help="tiny limits for a CPU check")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        p.error(f"unknown --variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    if args.small:
        args.max_tokens, args.min_tokens = min(args.max_tokens, 48), min(args.min_tokens, 8)
        args.decode_batch, args.decode_context = 4, 32
        args.max_model_len, args.max_num_seqs, args.idle_ms = 128, 8, 1.0
    return args


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A runner built and warmed up as rose-run builds one, and a line on it."""
    from roseinfer.config import SchedulerConfig
    from roseinfer.executor import builder

    loaded = builder.load_model(builder.ModelChoice(args.model, args.device, seed=0))
    cap = builder.max_useful_blocks(args.max_num_seqs, args.max_model_len, 16)
    cpu = loaded.device.type == "cpu"
    size = builder.size_kv_pool(builder.KVPoolChoice(16, num_kv_blocks=cap if cpu else None),
                                loaded, cap)  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=size.num_blocks, max_num_seqs=args.max_num_seqs,
                             max_model_len=args.max_model_len,
                             max_num_batched_tokens=max(args.max_model_len, 2048))  # fmt: skip
    choice = builder.RunnerChoice(cudagraph_mode=args.cudagraph_mode)
    built = builder.build_runner(loaded, config, size, choice)
    builder.warm_up(built.runner, built.config)
    return built.runner


def lengths(args: argparse.Namespace, variant: str, rng: np.random.Generator) -> list[int]:
    """Prompt lengths of a variant: one repeated (``same``), else fresh draws."""
    if variant == "same":
        return [(args.min_tokens + args.max_tokens) // 2] * args.steps
    span = np.arange(args.min_tokens, args.max_tokens + 1)
    return rng.choice(span, size=min(args.steps, len(span)), replace=False).tolist()


def timed_prefill(runner, num_tokens: int, seed: int) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
    """Wall, host (launch) and the launch's thread CPU seconds of one prefill step as the
    engine pays it: CPU seconds short of the host seconds mean the thread was off the CPU."""
    from roseinfer.executor.engine import synchronize
    from roseinfer.executor.profiler import GREEDY
    from roseinfer.executor.warmup import scratch_inputs

    inputs = scratch_inputs([(num_tokens, num_tokens)], runner.block_size, runner.num_kv_blocks,
                            runner.vocab_size, first_block=seed % 64, seed=seed)  # fmt: skip
    synchronize(runner.device)
    runner.host_times_s = []
    start, cpu = time.perf_counter(), time.thread_time()
    logits = runner.forward(inputs)
    cpu = time.thread_time() - cpu
    runner.sample(logits, [GREEDY], [None])
    synchronize(runner.device)
    wall = time.perf_counter() - start
    host = runner.host_times_s[0]
    runner.host_times_s = None
    return wall, host, cpu


def decode_step(runner, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """One decode of ``--decode-batch`` sequences (a CUDA graph where captured)."""
    from roseinfer.executor.engine import synchronize
    from roseinfer.executor.warmup import scratch_inputs

    seqs = [(1, args.decode_context)] * args.decode_batch
    inputs = scratch_inputs(seqs, runner.block_size, runner.num_kv_blocks, runner.vocab_size,
                            first_block=64)  # fmt: skip
    runner.forward(inputs)
    synchronize(runner.device)


OPS = ("qkv", "write_kv", "attention", "finish_layer")


def time_ops(runner) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Wrap the four calls of each layer (on this runner's adapter and backend objects) to
    append their host seconds to the returned lists; clear them before each step. An
    adapter that stores K/V in its rotary launch (the fused Llama one, on CUDA) counts that
    store in ``qkv``, and ``write_kv`` stays empty."""
    calls: dict[str, list[float]] = {op: [] for op in OPS}

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            out = fn(*a, **k)
            calls[name].append(time.perf_counter() - t)
            return out

        return wrapper

    adapter, backend = runner.adapter, runner.backend
    adapter.qkv = timed("qkv", adapter.qkv)
    adapter.qkv_stored = timed("qkv", adapter.qkv_stored)
    backend.write_kv = timed("write_kv", backend.write_kv)
    backend.forward = timed("attention", backend.forward)
    adapter.finish_layer = timed("finish_layer", adapter.finish_layer)
    return calls


def run_variant(runner, args: argparse.Namespace, variant: str,  # type: ignore[no-untyped-def]
                calls: dict[str, list[float]] | None) -> list[dict[str, Any]]:  # fmt: skip
    rng = np.random.default_rng(VARIANTS.index(variant))
    rows = []
    for i, n in enumerate(lengths(args, variant, rng)):
        if variant == "after-decode":
            decode_step(runner, args)
        elif variant == "after-idle":
            time.sleep(args.idle_ms / 1e3)
        for v in (calls or {}).values():
            v.clear()
        wall, host, cpu = timed_prefill(runner, int(n), seed=i)
        row = {"variant": variant, "tokens": int(n), "wall_s": wall, "host_s": host,
               "host_cpu_s": cpu}  # fmt: skip
        if calls is not None:
            row["ops_s"] = {op: list(v) for op, v in calls.items()}
        rows.append(row)
    return rows


def bucket_ratios(rows: list[dict[str, Any]]) -> np.ndarray:
    """Each step's wall time over the median of its length bucket (powers of two)."""
    buckets: dict[int, list[float]] = {}
    for r in rows:
        buckets.setdefault(int(np.log2(r["tokens"])), []).append(r["wall_s"])
    medians = {b: statistics.median(v) for b, v in buckets.items()}
    return np.array([r["wall_s"] / medians[int(np.log2(r["tokens"]))] for r in rows])


def op_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per call kind, the host ms per step (median) of stretched and normal steps, and how
    concentrated a stretched step's excess is: its slowest single call over the median call."""
    stretched = bucket_ratios(rows) > STRETCH
    lines = [f"{'call':<13} {'normal ms':>9} {'stretched ms':>12} {'max/median call':>16}"]
    for op in OPS:
        per_step: dict[bool, list[float]] = {True: [], False: []}
        peaks = []
        for r, s in zip(rows, stretched):
            calls = r["ops_s"][op]
            per_step[bool(s)].append(1e3 * sum(calls))
            if s and calls:
                peaks.append(max(calls) / statistics.median(calls))
        cell = lambda v: f"{statistics.median(v):.2f}" if v else "-"  # noqa: E731
        lines.append(f"{op:<13} {cell(per_step[False]):>9} {cell(per_step[True]):>12} "
                     f"{cell(peaks):>16}")  # fmt: skip
    return lines


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, stretched share, p99 ratio and the stretched steps' host share."""
    ratios = bucket_ratios(rows)
    stretched = ratios > STRETCH
    host_share = [r["host_s"] / r["wall_s"] for r, s in zip(rows, stretched) if s]
    normal_share = [r["host_s"] / r["wall_s"] for r, s in zip(rows, stretched) if not s]
    off_cpu = [1 - r["host_cpu_s"] / r["host_s"] for r, s in zip(rows, stretched) if s]
    return {
        "steps": len(rows),
        "median_ms": 1e3 * statistics.median(r["wall_s"] for r in rows),
        "stretched_share": float(stretched.mean()),
        "p99_ratio": float(np.quantile(ratios, 0.99)),
        "host_share_stretched": statistics.median(host_share) if host_share else None,
        "host_share_normal": statistics.median(normal_share) if normal_share else None,
        "off_cpu_share_stretched": statistics.median(off_cpu) if off_cpu else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    runner = build(args)
    print(f"{args.model} on {runner.device}, {runner.attention_backend}, "
          f"{len(runner.graph_batch_sizes or ())} CUDA graph sizes; set-up "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr)  # fmt: skip
    calls = time_ops(runner) if args.op_times else None
    rows, table = [], {}
    for variant in args.variants:
        got = run_variant(runner, args, variant, calls)
        rows += got
        table[variant] = summarize(got)
    print(f"{'variant':<13} {'steps':>5} {'median ms':>9} {'>1.25x':>7} {'p99 x':>6} "
          f"{'host share (stretched / normal)':>32} {'off-CPU':>8}")  # fmt: skip
    for variant, s in table.items():
        shares = "/".join(
            "-" if s[k] is None else f"{s[k]:.2f}"
            for k in ("host_share_stretched", "host_share_normal")
        )
        print(f"{variant:<13} {s['steps']:>5} {s['median_ms']:>9.2f} "
              f"{s['stretched_share']:>7.1%} {s['p99_ratio']:>6.2f} {shares:>32} "
              f"{'-' if s['off_cpu_share_stretched'] is None else format(s['off_cpu_share_stretched'], '.2f'):>8}")  # fmt: skip
    if args.op_times:
        for variant in args.variants:
            print(f"\n{variant}: host time per call kind (32 layers summed)")
            print("\n".join(op_table([r for r in rows if r["variant"] == variant])))
    if args.output:
        args.output.write_text(json.dumps({"args": vars(args) | {"output": str(args.output)},
                                           "summary": table, "steps": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
