"""Costs of two hardening changes, measured A vs B in one run.

1. Prefix-cache block hashes: ``sha256`` (rose-run's default) vs ``builtin``
   (Python ``hash()``, rose-sim's default): nanoseconds per 16-token block, and
   the wall time of one simulation whose prompts have token ids (a synthetic
   workload; traces without token ids, like the Azure ones, hash nothing).
2. Trace loading: plain JSONL (duplicate-id check on a dict, formerly a list:
   10k rows 1.3 s, 100k rows 119 s) vs Mooncake JSONL, rows per second.

Runs alternate A and B ``--repeats`` times; the table shows min and max.

    python benchmarks/input_costs.py
    python benchmarks/input_costs.py --num-requests 500 --rows 20000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import timeit
from pathlib import Path

from roseinfer.block_manager import BLOCK_HASHERS
from roseinfer.cli.config import check_args
from roseinfer.cli.sim import build_parser, run_config, setup_of
from roseinfer.cli.workload import build_workload
from roseinfer.registry import load_registry
from roseinfer.simulator import simulate
from roseinfer.workloads import load_trace


def hash_ns_per_block(repeats: int) -> dict[str, list[float]]:
    """Nanoseconds per call of each block hasher on one 16-token block."""
    ids, times = tuple(range(1000, 1016)), {name: [] for name in BLOCK_HASHERS}
    for _ in range(repeats):
        for name, hasher in BLOCK_HASHERS.items():
            n = 100_000
            times[name].append(
                timeit.timeit(lambda h=hasher: h(123456789, ids), number=n) / n * 1e9
            )
    return times


def sim_wall_s(num_requests: int, repeats: int) -> dict[str, list[float]]:
    """Simulation wall seconds per hash algorithm (synthetic 1,024-token prompts)."""
    registry, times = load_registry(), {name: [] for name in BLOCK_HASHERS}
    for _ in range(repeats):
        for name in BLOCK_HASHERS:
            args = build_parser().parse_args(
                ["--workload", "synthetic", "--num-requests", str(num_requests),
                 "--prompt-tokens", "1024", "--output-tokens", "32", "--submit-interval-ms", "5",
                 "--unique-prompts", "--prefix-caching-hash-algo", name]
            )  # fmt: skip
            requests, _ = build_workload(args)
            setup = setup_of(args)  # the defaults: llama-3.1-8b on h100-sxm, 16-token blocks
            config = run_config(args, registry, check_args(args, registry), setup)
            result = simulate(requests, config, setup.cost_model, registry=registry)
            times[name].append(result.wall_s)
    return times


def trace_rows_per_s(num_rows: int, repeats: int) -> dict[str, list[float]]:
    """Rows loaded per second: plain JSONL vs Mooncake JSONL of ``num_rows`` rows."""
    folder = Path(tempfile.mkdtemp())
    plain, mooncake = folder / "plain.jsonl", folder / "mooncake.jsonl"
    with plain.open("w") as f:
        for i in range(num_rows):
            f.write(json.dumps({"arrival_s": i * 0.01, "prompt_tokens": 600, "output_tokens": 50}))
            f.write("\n")
    with mooncake.open("w") as f:
        for i in range(num_rows):
            row = {
                "timestamp": i * 10,
                "input_length": 600,
                "output_length": 50,
                "hash_ids": [i, i],
            }
            f.write(json.dumps(row) + "\n")
    rates: dict[str, list[float]] = {"plain jsonl": [], "mooncake jsonl": []}
    for _ in range(repeats):
        for name, path in (("plain jsonl", plain), ("mooncake jsonl", mooncake)):
            seconds = timeit.timeit(lambda p=path: load_trace(p), number=1)
            rates[name].append(num_rows / seconds)
    return rates


def _line(label: str, values: list[float], unit: str) -> str:
    return f"  {label:<16} min {min(values):>12,.2f}  max {max(values):>12,.2f}  {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, load1 {os.getloadavg()[0]:.2f}")
    print("block hash, one 16-token block:")
    for name, values in hash_ns_per_block(args.repeats).items():
        print(_line(name, values, "ns"))
    walls = sim_wall_s(args.num_requests, args.repeats)
    print(f"simulation, {args.num_requests} synthetic requests of 1,024 prompt tokens:")
    for name, values in walls.items():
        print(_line(name, values, "s wall"))
    ratios = [s / b for s, b in zip(walls["sha256"], walls["builtin"])]
    print(f"  sha256/builtin wall, per pair: {', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"trace loading, {args.rows:,} rows:")
    for name, values in trace_rows_per_s(args.rows, args.repeats).items():
        print(_line(name, values, "rows/s"))


if __name__ == "__main__":
    main()
