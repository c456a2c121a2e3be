"""Simulator speed: simulated requests per wall-second and peak memory, per policy.

Replays a whole trace (default: the full Azure conv 2023 trace, 19,366
requests, ``azure-conv-2023``, fetched and cached on first use; ``--trace embedded``
for the embedded 2,000-request sample) through ``rose-sim``'s engine for every built-in admission
policy, with the default cost model (Llama-3.1-8B on one H100). Each policy
runs in a fresh subprocess so its peak RSS is its own. Also runs one policy
with ``--no-jump`` semantics (every decode step planned alone) to show what
the multi-step decode jumps buy, as a ratio measured in the same run, and the
Mooncake synthetic trace (3,993 long shared-prefix prompts, ``mooncake-synthetic``)
at its native rate with ``pack`` + force-FIFO 8 and prefix caching. Records keep
no token times (as ``rose-sim`` without ``--save-records``).

``--scale N`` replays N requests instead: the trace repeated and shifted in
time (each copy starts one second after the previous one ends), budget 2048,
reporting wall time and peak RSS (the week-long-trace case).

``--baseline-python`` times another checkout (its venv's python) on the same
runs, interleaved with this one, and prints the ratios: before/after figures
from one run on one machine.

Each row gives the simulation's wall time, its cost per simulated step (an
engine iteration) and per event (an arrival, or a scheduler output: one step
or one multi-step decode run), the start-up before it (imports, workload,
setup), the whole child process (what an acceptance check times) and peak
RSS; the header names the simulator core each checkout runs (compiled or
pure Python, ``roseinfer._core.core_info()``).

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
import time
from pathlib import Path

TRACE = "azure-conv-2023"
MOONCAKE_TRACE = "mooncake-synthetic"
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
from roseinfer.registry import load_registry
from roseinfer.simulator import make_cost_model, simulate
registry = load_registry()
try:  # one module per command (roseinfer.cli.sim)
    from roseinfer.cli.config import check_args
    from roseinfer.cli.sim import build_parser, run_config, setup_of
    from roseinfer.cli.workload import build_workload
    args = build_parser().parse_args(sys.argv[1:])
    requests, _ = build_workload(args)
    setup = setup_of(args)
    config = run_config(args, registry, check_args(args, registry), setup)
    model, cost = setup.model, setup.cost_model
except ImportError:  # an older checkout: roseinfer.simulator.cli
    from roseinfer.simulator.cli import build_parser, load_model_spec, default_num_kv_blocks
    from roseinfer.cli import build_workload, scheduler_config
    try:
        from roseinfer.calibration.specs import get_device_spec
    except ImportError:  # a checkout from before roseinfer.calibration
        from roseinfer.simulator.specs import get_device_spec
    args = build_parser().parse_args(sys.argv[1:])
    if getattr(args, "block_size", None) is None:  # rose-sim's default when no profile sets it
        args.block_size = 16
    requests, _ = build_workload(args)
    model, device = load_model_spec(args.model), get_device_spec(args.device)
    config = scheduler_config(args, registry, num_kv_blocks=default_num_kv_blocks(args, model, device),
                              max_model_len=model.max_model_len)
    cost = make_cost_model(model, device)
t1 = time.perf_counter()
try:
    result = simulate(requests, config, cost, registry=registry,
                      jump=not args.no_jump, keep_token_times=False)
except TypeError:  # an older checkout: it always keeps token times
    result = simulate(requests, config, cost, registry=registry, jump=not args.no_jump)
t2 = time.perf_counter()
columns = getattr(result, "columns", None)  # this checkout: no DataFrame, no pandas import
status = list((result.records if columns is None else columns)["status"])
try:
    from roseinfer._core import core_info
    core = core_info()
except ImportError:  # a checkout from before the compiled core
    core = "pure-Python core (no compiled core in this checkout)"
print(json.dumps({
    "num_requests": len(status), "finished": sum(s == "finished" for s in status),
    "hit_rate": result.scheduler.block_manager.num_hit_tokens
                / max(1, result.scheduler.block_manager.num_queried_tokens),
    "num_steps": result.num_steps, "load_s": t1 - t0, "sim_s": t2 - t1,
    "num_outputs": getattr(result.scheduler, "num_outputs", None), "core": core,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def run_one(flags: list[str], python: str = sys.executable) -> dict | None:
    """Run one simulation in a fresh interpreter; its figures, or None if that
    interpreter's roseinfer cannot run these flags."""
    # NOTE: run outside the checkout: `python -c` puts the working directory first
    # on sys.path, and this checkout's roseinfer/ would shadow the other one's.
    start = time.perf_counter()
    out = subprocess.run(
        [python, "-c", _CHILD, *flags], capture_output=True, text=True, cwd=tempfile.gettempdir()
    )
    if out.returncode != 0:
        return None
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    figures["process_s"] = time.perf_counter() - start
    return figures


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


HEADER = (
    f"{'run':<28}{'requests':>9}{'steps':>9}{'sim s':>8}{'us/step':>8}{'us/event':>9}"
    f"{'load s':>7}{'proc s':>7}{'RSS MB':>7}"
)


def _row(label: str, r: dict) -> str:
    us_step = 1e6 * r["sim_s"] / max(1, r["num_steps"])
    outputs = r.get("num_outputs")
    per_event = (
        "-" if outputs is None else f"{1e6 * r['sim_s'] / (outputs + r['num_requests']):.2f}"
    )
    return (
        f"{label:<28}{r['num_requests']:>9}{r['num_steps']:>9}{r['sim_s']:>8.2f}{us_step:>8.2f}"
        f"{per_event:>9}{r['load_s']:>7.2f}{r['process_s']:>7.2f}{r['peak_rss_mb']:>7.0f}"
    )


def _ratios(r: dict, b: dict) -> str:
    return (
        f"   this/baseline: sim {r['sim_s'] / b['sim_s']:.2f}x, "
        f"process {r['process_s'] / b['process_s']:.2f}x"
    )


def _local(trace: str, flag: str, off: str) -> Path | None:
    """The file of ``trace`` (a public trace name is fetched once, so a baseline
    checkout that knows no names reads the same file); None for ``off``.
    Exits with one line when the trace cannot be had."""
    from roseinfer import workloads

    if trace == off:
        return None
    try:
        return workloads.resolve_trace(trace)
    except workloads.WorkloadError as err:
        sys.exit(f"sim_speed.py: error: {err} (or {flag} {off})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", default=TRACE, help="a trace file or public trace name; 'embedded': the sample"
    )
    parser.add_argument(
        "--mooncake",
        default=MOONCAKE_TRACE,
        help="Mooncake-format trace (file or name) timed with pack + force-FIFO 8 and prefix "
        "caching; 'none' to skip it",
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--num-requests", type=int)
    parser.add_argument("--baseline-python", help="python of another checkout to compare with")
    parser.add_argument(
        "--scale", type=int, metavar="N", help="replay N requests (the trace repeated) instead"
    )
    args = parser.parse_args()
    args.trace = _local(args.trace, "--trace", "embedded")
    args.mooncake = _local(args.mooncake, "--mooncake", "none")
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
    print(HEADER)
    if args.scale is not None:
        big = repeated_trace(args.trace, args.scale, Path(tempfile.mkdtemp()) / "repeated.csv")
        flags = ["--model", args.model, "--device", args.device, "--trace", str(big)]
        runs = [(f"{args.scale} requests budget-2048", flags + RUNS["budget-2048"])]
        for label, run_flags in runs:
            r = run_one(run_flags)
            assert r is not None, f"{label}: the run failed"
            print(_row(label, r) + f"   ({r['core']})")
            if args.baseline_python:
                b = run_one(run_flags, args.baseline_python)
                print(f"{'  baseline':<28}  (cannot run these flags)" if b is None
                      else _row("  baseline", b) + _ratios(r, b))  # fmt: skip
        return
    runs = [(label, base + flags) for label, flags in RUNS.items()]
    runs.append(("fifo --no-jump", [*base, "--no-jump"]))
    if args.mooncake is not None:
        mooncake = ["--model", args.model, "--device", args.device, "--trace", str(args.mooncake)]
        runs.append(("mooncake pack+ff8 prefix", mooncake + MOONCAKE_FLAGS))
    results = {}
    cores = []
    for label, flags in runs:
        r = run_one(flags)
        assert r is not None, f"{label}: the run failed"
        results[label] = r
        print(_row(label, r))
        cores.append(f"this checkout: {r['core']}")
        if args.baseline_python:
            b = run_one(flags, args.baseline_python)
            if b is None:
                print(f"{'  baseline':<28}  (cannot run these flags)")
                continue
            print(_row("  baseline", b) + _ratios(r, b))
            cores.append(f"baseline: {b['core']}")
    for line in dict.fromkeys(cores):
        print(line)
    if "mooncake pack+ff8 prefix" in results:
        hit = results["mooncake pack+ff8 prefix"]["hit_rate"]
        print(f"mooncake: prefix-cache hit rate {hit:.3f} (of prompt tokens at first admission)")
    ratio = results["fifo --no-jump"]["sim_s"] / results["fifo"]["sim_s"]
    print(f"multi-step decode jumps: {ratio:.1f}x faster than planning every step (fifo)")


if __name__ == "__main__":
    main()
