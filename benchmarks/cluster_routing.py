"""Prefix-aware vs round-robin routing on the Mooncake synthetic trace.

Replays the Mooncake synthetic trace (``mooncake-synthetic``: 3,993 requests
with shared prefixes, Mooncake FAST'25; fetched and cached on first use) at its native
arrival times on 4 and 8 replicas of Llama-3.1-8B on H100 (roofline cost
model, prefix caching, each replica its own KV pool), with every router
given, and prints per run: wall time, cluster prefix-cache hit rate, p99 and
mean TTFT, and how unevenly requests were spread. It also prints the trace's
ideal hit rate: the share of prompt tokens in leading blocks some earlier
request already had (an infinite cache shared by every replica).

    python benchmarks/cluster_routing.py
    python benchmarks/cluster_routing.py --replicas 8 --routers prefix-aware --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from roseinfer import workloads
from roseinfer.block_manager import compute_block_hashes
from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.calibration.specs import get_device_spec, get_model_spec
from roseinfer.config import SchedulerConfig
from roseinfer.metrics import summarize
from roseinfer.registry import load_registry
from roseinfer.request import Request
from roseinfer.simulator.cluster import ReplicaSpec, simulate_cluster

TRACE = "mooncake-synthetic"
BLOCK_SIZE = 16


def ideal_hit_rate(requests: list[Request], block_size: int = BLOCK_SIZE) -> float:
    """Prompt-token share of leading full blocks seen in an earlier request
    (capped so the last prompt token is computed, as the block manager does)."""
    seen: set[int] = set()
    hit = total = 0
    for req in sorted(requests, key=lambda r: r.arrival_time_s):
        hashes = compute_block_hashes(req, block_size)
        cap = min(len(hashes), (req.num_prompt_tokens - 1) // block_size)
        n = 0
        while n < cap and hashes[n] in seen:
            n += 1
        hit += n * block_size
        total += req.num_prompt_tokens
        seen.update(hashes)
    return hit / total


def default_num_kv_blocks(model: str, device: str) -> int:
    """KV blocks rose-sim gives one replica (90% of memory minus weights)."""
    m, d = get_model_spec(model), get_device_spec(device)
    return int((d.mem_bytes * 0.9 - m.weight_bytes) // (m.kv_bytes_per_token * BLOCK_SIZE))


def main() -> None:
    """Run every (replicas, router) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=TRACE, help="a trace file or a public trace name")
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--routers", nargs="+", default=["round-robin", "prefix-aware"])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell (wall time spread)")
    args = parser.parse_args()
    try:
        requests = workloads.load_trace(args.trace)
    except workloads.WorkloadError as err:
        sys.exit(f"cluster_routing.py: error: {err}")
    registry = load_registry()
    config = SchedulerConfig(
        num_kv_blocks=default_num_kv_blocks(args.model, args.device),
        block_size=BLOCK_SIZE,
        max_model_len=get_model_spec(args.model).max_model_len,
        enable_prefix_caching=True,
    )
    cost = make_cost_model(args.model, args.device)
    print(
        f"{Path(args.trace).name}: {len(requests)} requests, ideal prefix hit rate "
        f"{ideal_hit_rate(requests):.3f} (infinite shared cache)"
    )
    print(
        f"{'replicas':>8} {'router':<14} {'wall s':>14} {'hit rate':>8} {'p99 TTFT ms':>12} "
        f"{'mean TTFT ms':>12} {'routed min/max':>15}"
    )
    for n in args.replicas:
        specs = [ReplicaSpec(f"{args.model}@{args.device}", config, cost)] * n
        for name in args.routers:
            walls = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = simulate_cluster(
                    requests, specs, registry.router(name)(), registry=registry
                )
                walls.append(time.perf_counter() - start)
            s = summarize(result.records, duration_s=result.duration_s)
            routed = result.info["routed"]
            spread = f"{min(walls):.1f}-{max(walls):.1f}" if len(walls) > 1 else f"{walls[0]:.1f}"
            print(
                f"{n:>8} {name:<14} {spread:>14} {s['prefix_cache_hit_rate']:>8.3f} "
                f"{s['p99_ttft_ms']:>12.0f} {s['mean_ttft_ms']:>12.0f} "
                f"{min(routed):>7}/{max(routed):<7}"
            )


if __name__ == "__main__":
    main()
