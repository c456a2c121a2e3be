"""``rose-sim --num-replicas N``: the cluster flags and run.

Example::

    rose-sim --num-replicas 8 --router prefix-aware --trace synthetic_trace.jsonl \\
        --model llama-3.1-8b --device h100-sxm --enable-prefix-caching
    rose-sim --replica-config replicas.toml --router least-loaded

A replica config lists the replicas (TOML or JSON), each with optional
``model``, ``device``, ``num_kv_blocks``, ``name``, ``count`` (default 1),
``tensor_parallel_size``, ``pipeline_parallel_size`` and ``interconnect``;
missing fields take the command line's values. Each entry is priced by the
roofline of its model and device (a ``--cost-model`` profile prices only
``--num-replicas`` copies of the profiled setup)::

    [[replica]]
    model = "llama-3.1-8b"
    device = "h100-sxm"
    count = 4

    [[replica]]
    device = "a100-80gb"
    num_kv_blocks = 20000
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from roseinfer.calibration.cost_model import make_cost_model
from roseinfer.calibration.specs import get_device_spec
from roseinfer.cli import CliError, config_facts, report
from roseinfer.config import SchedulerConfig
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.routing import Router
from roseinfer.simulator.cluster import ClusterResult, ReplicaSpec, simulate_cluster

REPLICA_KEYS = {
    "model", "device", "num_kv_blocks", "count", "name",
    "tensor_parallel_size", "pipeline_parallel_size", "interconnect",
}  # fmt: skip
PER_REPLICA_KEYS = (
    "num_routed",
    "completed",
    "prefix_cache_hit_rate",
    "p99_ttft_ms",
    "mean_ttft_ms",
)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--num-replicas``, ``--router``, ``--router-arg``, ``--router-staleness-s``
    and ``--replica-config`` to ``parser``."""
    g = parser.add_argument_group("cluster (rose-sim only; rose-run serves one replica)")
    g.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="replicas behind a router, each with its own KV pool and prefix cache (default 1)",
    )
    g.add_argument(
        "--router",
        help="routing policy with several replicas (default round-robin; see --list-policies)",
    )
    g.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="router knob, e.g. load_weight=0.5 for prefix-aware (repeatable)",
    )
    g.add_argument(
        "--router-staleness-s",
        type=float,
        default=0.0,
        help="the router sees replica load as of its last refresh, at most this old "
        "(simulated s; default 0 = fresh at every arrival)",
    )
    g.add_argument(
        "--replica-config",
        type=Path,
        metavar="FILE.toml|json",
        help="heterogeneous replicas: a list of {model, device, num_kv_blocks, count}",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    """True when the flags ask for more than one replica (or a replica config)."""
    if args.num_replicas is not None and args.num_replicas < 1:
        raise CliError(f"--num-replicas must be >= 1, got {args.num_replicas}")
    cluster = (args.num_replicas or 1) > 1 or args.replica_config is not None
    if not cluster and (args.router or args.router_arg or args.router_staleness_s):
        raise CliError("--router, --router-arg and --router-staleness-s need --num-replicas N > 1")
    return cluster


def make_router(args: argparse.Namespace, registry: Registry) -> Router:
    """The ``--router`` instance with its ``--router-arg`` knobs.

    Raises:
        CliError: on a malformed ``--router-arg``.
        UnknownPolicyError: on an unknown router name.
    """
    options = {}
    for item in args.router_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CliError(f"--router-arg takes KEY=VALUE, got {item!r}")
        options[key] = value
    return registry.router(args.router or "round-robin")(seed=args.seed, options=options)


def read_replica_config(path: Path) -> list[dict[str, Any]]:
    """The replica entries of a TOML (``[[replica]]``) or JSON (list) file.

    Raises:
        CliError: if the file cannot be read or has unknown keys.
    """
    try:
        text = path.read_text()
        data: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as err:
        raise CliError(f"cannot read --replica-config {path}: {err}") from None
    entries = data.get("replica", []) if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise CliError(f"--replica-config {path} lists no replicas ([[replica]] tables or a list)")
    for entry in entries:
        unknown = set(entry) - REPLICA_KEYS
        if unknown:
            raise CliError(
                f"--replica-config {path}: unknown keys {sorted(unknown)}; known: {sorted(REPLICA_KEYS)}"
            )
    return entries


def replica_specs(
    args: argparse.Namespace, base: SchedulerConfig, base_name: str, base_cost: Any
) -> list[ReplicaSpec]:
    """The cluster's replicas: ``--num-replicas`` copies of the base setup, or the
    ``--replica-config`` entries (fields not given fall back to the flags).

    Raises:
        CliError: when ``--num-replicas`` disagrees with the config's count.
    """
    from roseinfer.simulator.cli import (
        DEFAULT_DEVICE,
        DEFAULT_MODEL,
        default_num_kv_blocks,
        load_model_spec,
    )

    if args.replica_config is None:
        return [ReplicaSpec(base_name, base, base_cost)] * (args.num_replicas or 1)
    specs: list[ReplicaSpec] = []
    for entry in read_replica_config(args.replica_config):
        model = load_model_spec(entry.get("model", args.model or DEFAULT_MODEL))
        device = get_device_spec(entry.get("device", args.device or DEFAULT_DEVICE))
        tp = int(entry.get("tensor_parallel_size", args.tensor_parallel_size))
        pp = int(entry.get("pipeline_parallel_size", args.pipeline_parallel_size))
        try:
            cost = make_cost_model(model, device, None, tp, pp,
                                   entry.get("interconnect", args.interconnect))  # fmt: skip
        except ValueError as err:
            raise CliError(f"--replica-config {args.replica_config}: {err}") from None
        blocks = entry.get("num_kv_blocks") or args.num_kv_blocks
        config = replace(
            base,
            num_kv_blocks=int(blocks or default_num_kv_blocks(args, model, device, tp, pp)),
            max_model_len=args.max_model_len or model.max_model_len,
        )
        gpus = f" x{tp * pp}" if tp * pp > 1 else ""
        name = entry.get("name", f"{model.name}@{device.name}{gpus}")
        specs += [ReplicaSpec(name, config, cost)] * int(entry.get("count", 1))
    if args.num_replicas is not None and args.num_replicas != len(specs):
        raise CliError(
            f"--num-replicas {args.num_replicas} but --replica-config lists {len(specs)}; drop one"
        )
    return specs


def run_cluster(
    args: argparse.Namespace,
    registry: Registry,
    requests: list[Request],
    specs: list[ReplicaSpec],
    *,
    title: str,
    extra: dict[str, Any],
) -> ClusterResult:
    """Simulate the cluster, print the cluster-wide and per-replica summaries and
    write the files asked for (``--save-result`` gets ``replica_summaries``)."""
    router = make_router(args, registry)
    try:
        result = simulate_cluster(
            requests,
            specs,
            router,
            registry=registry,
            jump=not args.no_jump,
            router_staleness_s=args.router_staleness_s,
            keep_token_times=args.save_records is not None,
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    per = result.replica_summaries()
    per.insert(2, "num_routed", result.info["routed"])
    extra = {
        **extra,
        "policy": result.policy,
        "num_replicas": len(specs),
        "router": router.name,
        "router_staleness_s": args.router_staleness_s,
        **config_facts(specs[0].config),
        "num_kv_blocks": [s.config.num_kv_blocks for s in specs],
        "sim_wall_s": result.wall_s,
        "num_steps": result.num_steps,
        "replica_summaries": per[["replica", "name", *PER_REPLICA_KEYS]].to_dict("records"),
    }
    title = f"{title} | {len(specs)} replicas, router {router.name}"
    report(args, result.records, duration_s=result.duration_s, title=title, extra=extra,
           itl=result.itl)  # fmt: skip
    if not args.quiet:
        print(format_replicas(per))
        print(
            f"simulated {len(requests)} requests on {len(specs)} replicas, "
            f"{result.num_steps} steps in {result.wall_s:.2f} s wall"
        )
    return result


def format_replicas(per: pd.DataFrame) -> str:
    """The per-replica table: requests routed, finished, hit rate, TTFT."""
    lines = ["replica  name                        routed  done  hit%   p99 TTFT ms  mean TTFT ms"]
    for row in per.itertuples():
        lines.append(
            f"{row.replica:>7}  {row.name:<26} {row.num_routed:>7} {row.completed:>5} "
            f"{100 * row.prefix_cache_hit_rate:>5.1f} {row.p99_ttft_ms:>12.1f} {row.mean_ttft_ms:>13.1f}"
        )
    return "\n".join(lines)
