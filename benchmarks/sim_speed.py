"""Simulator speed: simulated requests per wall-second and peak memory, per policy.

Replays a whole trace (default: the full Azure conv 2023 trace, 19,366
requests, from ``../shared/traces``; the embedded 2,000-request sample when
that is absent) through ``rose-sim``'s engine for every built-in admission
policy, with the default cost model (Llama-3.1-8B on one H100). Each policy
runs in a fresh subprocess so its peak RSS is its own. Also runs one policy
with ``--no-jump`` semantics (every decode step planned alone) to show what
the multi-step decode jumps buy, as a ratio measured in the same run, and the
Mooncake synthetic trace (3,993 long shared-prefix prompts, ``../shared/traces``)
at its native rate with ``pack`` + force-FIFO 8 and prefix caching. Records keep
no token times (as ``rose-sim`` without ``--save-records``).

``--scale N`` replays N requests instead: the trace repeated and shifted in
time (each copy starts one second after the previous one ends), budget 2048,
reporting wall time and peak RSS (the week-long-trace case).

``--baseline-python`` times another checkout (its venv's python) on the same
runs, interleaved with this one, and prints the ratio: before/after figures
from one run on one machine.

    python benchmarks/sim_speed.py
    python benchmarks/sim_speed.py --trace path/to/trace.csv --model llama-3.1-70b --device h200
    python benchmarks/sim_speed.py --baseline-python ../base/.venv/bin/python
    python benchmarks/sim_speed.py --scale 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared/traces"
SHARED_TRACE = SHARED / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_TRACE = SHARED / "synthetic_trace.jsonl"
MOONCAKE_FLAGS = [
    "--policy", "pack", "--force-fifo-every", "8", "--enable-prefix-caching",
]  # fmt: skip
RUNS = {
    "fifo": [],
    "budget-2048": ["--policy", "budget", "--prefill-max-tokens", "2048"],
    "pack-2048+ff8": [
        "--policy", "pack", "--prefill-max-tokens", "2048", "--lookahead", "64",
        "--force-fifo-every", "8",
    ],
    "budget-2048+decode-first": [
        "--policy", "budget", "--prefill-max-tokens", "2048", "--loop-order", "decode-first",
    ],
    "mixed+chunked-512": [
        "--loop-order", "mixed", "--enable-chunked-prefill", "--max-num-batched-tokens", "512",
    ],
    # preempting policies (the target: within 2x of fifo's time)
    "srpt (oracle)": ["--policy", "srpt", "--length-predictor", "oracle"],
    "priority": ["--policy", "priority"],
}  # fmt: skip

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from roseinfer.simulator.cli import build_parser, load_model_spec, default_num_kv_blocks
from roseinfer.cli import build_workload, scheduler_config
from roseinfer.registry import load_registry
from roseinfer.simulator import make_cost_model, simulate
try:
    from roseinfer.calibration.specs import get_device_spec
except ImportError:  # a checkout from before roseinfer.calibration
    from roseinfer.simulator.specs import get_device_spec
args = build_parser().parse_args(sys.argv[1:])
if getattr(args, "block_size", None) is None:  # rose-sim's default when no profile sets it
    args.block_size = 16
registry = load_registry()
requests, _ = build_workload(args)
model, device = load_model_spec(args.model), get_device_spec(args.device)
config = scheduler_config(args, registry, num_kv_blocks=default_num_kv_blocks(args, model, device),
                          max_model_len=model.max_model_len)
t1 = time.perf_counter()
try:
    result = simulate(requests, config, make_cost_model(model, device), registry=registry,
                      jump=not args.no_jump, keep_token_times=False)
except TypeError:  # an older checkout: it always keeps token times
    result = simulate(requests, config, make_cost_model(model, device), registry=registry,
                      jump=not args.no_jump)
t2 = time.perf_counter()
df = result.records
print(json.dumps({
    "num_requests": len(df), "finished": int((df.status == "finished").sum()),
    "hit_rate": result.scheduler.block_manager.num_hit_tokens
                / max(1, result.scheduler.block_manager.num_queried_tokens),
    "num_steps": result.num_steps, "load_s": t1 - t0, "sim_s": t2 - t1,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def run_one(flags: list[str], python: str = sys.executable) -> dict | None:
    """Run one simulation in a fresh interpreter; its figures, or None if that
    interpreter's roseinfer cannot run these flags."""
    # NOTE: run outside the checkout: `python -c` puts the working directory first
    # on sys.path, and this checkout's roseinfer/ would shadow the other one's.
    out = subprocess.run(
        [python, "-c", _CHILD, *flags], capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    if out.returncode != 0:
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def repeated_trace(trace: Path, num_requests: int, out: Path) -> Path:
    """Write ``num_requests`` rows of ``trace`` repeated, each copy shifted to start
    1 s after the previous one ends (``arrival_s,prompt_tokens,output_tokens``)."""
    import pandas as pd

    from roseinfer import workloads

    reqs = workloads.load_trace(trace)
    arrivals = pd.Series([r.arrival_time_s for r in reqs])
    span = float(arrivals.max()) + 1.0
    reps = -(-num_requests // len(reqs))
    frame = pd.concat(
        pd.DataFrame({
            "arrival_s": arrivals + i * span,
            "prompt_tokens": [r.num_prompt_tokens for r in reqs],
            "output_tokens": [r.max_output_tokens for r in reqs],
        })
        for i in range(reps)
    ).head(num_requests)  # fmt: skip
    frame.to_csv(out, index=False)
    return out


def _row(label: str, r: dict) -> str:
    rate = r["num_requests"] / r["sim_s"]
    return (
        f"{label:<28}{r['num_requests']:>9}{r['num_steps']:>9}{r['sim_s']:>8.2f}"
        f"{rate:>10.0f}{r['load_s']:>8.2f}{r['peak_rss_mb']:>8.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", type=Path, default=SHARED_TRACE if SHARED_TRACE.exists() else None
    )
    parser.add_argument(
        "--mooncake",
        type=Path,
        default=MOONCAKE_TRACE if MOONCAKE_TRACE.exists() else None,
        help="Mooncake-format trace timed with pack + force-FIFO 8 and prefix caching",
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--baseline-python", help="python of another checkout to compare with")
    parser.add_argument(
        "--scale", type=int, metavar="N", help="replay N requests (the trace repeated) instead"
    )
    args = parser.parse_args()
    if args.scale is not None and (args.scale < 1 or args.trace is None):
        parser.error("--scale needs N >= 1 and a --trace to repeat")
    # NOTE: rose-sim's old name for --hardware, so that --baseline-python checkouts
    # from before the rename parse the same flags (this one warns once per run)
    base = ["--model", args.model, "--device", args.device]
    if args.trace is not None:
        base += ["--trace", str(args.trace)]
    if args.num_requests:
        base += ["--num-requests", str(args.num_requests)]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    print(
        f"workload: {args.trace or 'embedded azure conv sample'}; model {args.model} on {args.device}"
    )
    print(
        f"{'run':<28}{'requests':>9}{'steps':>9}{'sim s':>8}{'req/s':>10}{'load s':>8}{'RSS MB':>8}"
    )
    if args.scale is not None:
        big = repeated_trace(args.trace, args.scale, Path(tempfile.mkdtemp()) / "repeated.csv")
        flags = ["--model", args.model, "--device", args.device, "--trace", str(big)]
        runs = [(f"{args.scale} requests budget-2048", flags + RUNS["budget-2048"])]
        for label, run_flags in runs:
            r = run_one(run_flags)
            assert r is not None, f"{label}: the run failed"
            print(_row(label, r) + f"   (wall incl. load {r['load_s'] + r['sim_s']:.1f} s)")
        return
    runs = [(label, base + flags) for label, flags in RUNS.items()]
    runs.append(("fifo --no-jump", [*base, "--no-jump"]))
    if args.mooncake is not None:
        mooncake = ["--model", args.model, "--device", args.device, "--trace", str(args.mooncake)]
        runs.append(("mooncake pack+ff8 prefix", mooncake + MOONCAKE_FLAGS))
    results = {}
    for label, flags in runs:
        r = run_one(flags)
        assert r is not None, f"{label}: the run failed"
        results[label] = r
        print(_row(label, r))
        if args.baseline_python:
            b = run_one(flags, args.baseline_python)
            if b is None:
                print(f"{'  baseline':<28}  (cannot run these flags)")
                continue
            print(_row("  baseline", b) + f"   this/baseline time {r['sim_s'] / b['sim_s']:.2f}x")
    if "mooncake pack+ff8 prefix" in results:
        hit = results["mooncake pack+ff8 prefix"]["hit_rate"]
        print(f"mooncake: prefix-cache hit rate {hit:.3f} (of prompt tokens at first admission)")
    ratio = results["fifo --no-jump"]["sim_s"] / results["fifo"]["sim_s"]
    print(f"multi-step decode jumps: {ratio:.1f}x faster than planning every step (fifo)")


if __name__ == "__main__":
    main()
