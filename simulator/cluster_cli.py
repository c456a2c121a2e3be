"""``rose-sim --num-replicas N``: the cluster flags and run.

Example::

    rose-sim --num-replicas 8 --router prefix-aware --trace synthetic_trace.jsonl \\
        --model llama-3.1-8b --hardware h100-sxm --enable-prefix-caching
    rose-sim --replica-config replicas.toml --router least-loaded
    rose-sim --num-prefill-replicas 1 --num-decode-replicas 3 --kv-transfer-link rdma-400g

A replica config lists the replicas (TOML or JSON), each with optional
``model``, ``hardware`` (``device`` is the same key), ``num_kv_blocks``, ``name``, ``count`` (default 1),
``tensor_parallel_size``, ``pipeline_parallel_size``, ``interconnect`` and
``role`` (``mixed``, the default, or ``prefill`` / ``decode`` for a
disaggregated cluster); missing fields take the command line's values. Each entry is priced by the
roofline of its model and device (a ``--cost-model`` profile prices only
``--num-replicas`` copies of the profiled setup)::

    [[replica]]
    model = "llama-3.1-8b"
    hardware = "h100-sxm"
    count = 4

    [[replica]]
    hardware = "a100-80gb"
    num_kv_blocks = 20000

``examples/replicas.toml`` is a complete one.
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
from roseinfer.calibration.specs import LINKS, LinkSpec, get_device_spec, get_link_spec
from roseinfer.cli import MAX_NUM_KV_BLOCKS, CliError, config_facts, float_in, int_in, report
from roseinfer.cli import clip as _clip
from roseinfer.config import SchedulerConfig
from roseinfer.kv_tiers import kv_tier_summary
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.routing import Router, build_router
from roseinfer.simulator.cluster import MAX_REPLICAS, ClusterResult, ReplicaSpec, simulate_cluster
from roseinfer.simulator.disaggregation import DEFAULT_KV_TRANSFER_LINK

REPLICA_KEYS = {
    "model", "hardware", "device", "num_kv_blocks", "count", "name",
    "tensor_parallel_size", "pipeline_parallel_size", "interconnect", "role",
}  # fmt: skip
PER_REPLICA_KEYS = (
    "role",
    "utilization",
    "num_routed",
    "completed",
    "prefix_cache_hit_rate",
    "p99_ttft_ms",
    "mean_ttft_ms",
    "p99_tpot_ms",
)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--num-replicas``, ``--router``, ``--router-arg``, ``--router-staleness-s``
    and ``--replica-config`` to ``parser``."""
    g = parser.add_argument_group("cluster (rose-sim only; rose-run serves one replica)")
    g.add_argument(
        "--num-replicas",
        type=int_in(1, MAX_REPLICAS),
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
        type=float_in(0),
        default=0.0,
        help="the router sees replica load as of its last refresh, at most this old "
        "(simulated s; default 0 = fresh at every arrival)",
    )
    g.add_argument(
        "--replica-config",
        type=Path,
        metavar="FILE.toml|json",
        help="heterogeneous replicas: a list of {model, device, num_kv_blocks, count, role, ...}",
    )
    g.add_argument(
        "--num-prefill-replicas",
        type=int_in(1, MAX_REPLICAS),
        default=None,
        help="disaggregated serving: replicas that only prefill and hand the KV on "
        "(with --num-decode-replicas; DistServe, vLLM's disaggregated prefill)",
    )
    g.add_argument(
        "--num-decode-replicas",
        type=int_in(1, MAX_REPLICAS),
        default=None,
        help="disaggregated serving: replicas that only decode, from handed-over KV",
    )
    g.add_argument(
        "--decode-router",
        help="routing policy of the decode stage (default: --router's)",
    )
    g.add_argument(
        "--kv-transfer-link",
        default=None,
        help="link KV handoffs cross between replicas, one per GPU: "
        f"{', '.join(LINKS)} (default {DEFAULT_KV_TRANSFER_LINK})",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    """True when the flags ask for more than one replica, a replica config, or
    prefill and decode replicas.

    Raises:
        CliError: on a replica count < 1, only one of the prefill/decode counts,
            both them and --num-replicas, or cluster flags without a cluster.
    """
    counts = {
        "--num-replicas": args.num_replicas,
        "--num-prefill-replicas": args.num_prefill_replicas,
        "--num-decode-replicas": args.num_decode_replicas,
    }
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}")
    disagg = _wants_disaggregation(args)
    cluster = (args.num_replicas or 1) > 1 or args.replica_config is not None or disagg
    if not cluster and (args.router or args.router_arg or args.router_staleness_s):
        raise CliError("--router, --router-arg and --router-staleness-s need --num-replicas N > 1")
    if not disagg and args.replica_config is None and (args.decode_router or args.kv_transfer_link):
        raise CliError(
            "--decode-router and --kv-transfer-link need prefill and decode replicas "
            "(--num-prefill-replicas and --num-decode-replicas, or roles in --replica-config)"
        )
    return cluster


def _wants_disaggregation(args: argparse.Namespace) -> bool:
    """True with --num-prefill-replicas and --num-decode-replicas.

    Raises:
        CliError: with one of them only, or with --num-replicas / --replica-config too.
    """
    given = (args.num_prefill_replicas is not None, args.num_decode_replicas is not None)
    if given == (False, False):
        return False
    if given != (True, True):
        raise CliError(
            "disaggregated serving needs both --num-prefill-replicas and --num-decode-replicas"
        )
    if args.num_replicas is not None or args.replica_config is not None:
        raise CliError(
            "--num-prefill-replicas/--num-decode-replicas count the replicas: drop "
            "--num-replicas (or give roles in --replica-config instead)"
        )
    return True


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
            raise CliError(f"--router-arg takes KEY=VALUE, got {_clip(item)!r}")
        options[key] = value
    cls = registry.router(args.router or "round-robin")
    try:
        return build_router(cls, seed=args.seed, options=options)
    except ValueError as err:
        raise CliError(str(err)) from None


def make_decode_router(args: argparse.Namespace, registry: Registry) -> Router:
    """The decode stage's router: ``--decode-router`` (with the ``--router-arg``
    knobs) or another instance of ``--router``."""
    if args.decode_router is None:
        return make_router(args, registry)
    return make_router(argparse.Namespace(**{**vars(args), "router": args.decode_router}), registry)


def kv_transfer_link(args: argparse.Namespace) -> LinkSpec:
    """The ``--kv-transfer-link`` preset (default :data:`DEFAULT_KV_TRANSFER_LINK`).

    Raises:
        CliError: on an unknown link name.
    """
    try:
        return get_link_spec(args.kv_transfer_link or DEFAULT_KV_TRANSFER_LINK)
    except ValueError as err:
        raise CliError(f"--kv-transfer-link: {err}") from None


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
    total = 0
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, dict):
            raise CliError(f"--replica-config {path}: replica {i} is not a table of keys")
        unknown = set(entry) - REPLICA_KEYS
        if unknown:
            raise CliError(
                f"--replica-config {path}: unknown keys {sorted(map(_clip, map(str, unknown)))}; "
                f"known: {sorted(REPLICA_KEYS)}"
            )
        for key, value in entry.items():
            _check_replica_value(path, i, key, value)
        if "hardware" in entry and "device" in entry:
            raise CliError(
                f"--replica-config {path}: replica {i} gives both hardware and device (the "
                "same key, old name); keep hardware"
            )
        total += entry.get("count", 1)
    if total > MAX_REPLICAS:
        raise CliError(
            f"--replica-config {path} lists {total} replicas, more than {MAX_REPLICAS}; "
            "simulate a smaller cluster"
        )
    return entries


REPLICA_INT_RANGES = {
    "count": (1, MAX_REPLICAS),
    "num_kv_blocks": (1, MAX_NUM_KV_BLOCKS),
    "tensor_parallel_size": (1, 1024),
    "pipeline_parallel_size": (1, 1024),
}
"""The integer keys of a replica entry and their ranges (the flags' ranges)."""


def _check_replica_value(path: Path, index: int, key: str, value: Any) -> None:
    """One replica entry's value: an integer in range, or a string.

    Raises:
        CliError: naming the file, the replica and the key (``num_kv_blocks = 1.5``
            and ``count = "2"`` were truncated or silently misread before).
    """
    where = f"--replica-config {path}: replica {index}: {key}"
    if key in REPLICA_INT_RANGES:
        lo, hi = REPLICA_INT_RANGES[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise CliError(f"{where} must be an integer in [{lo}, {hi}], got {_clip(repr(value))}")
    elif not isinstance(value, str):
        raise CliError(f"{where} must be a string, got {_clip(repr(value))}")


def replica_specs(
    args: argparse.Namespace,
    base: SchedulerConfig,
    base_name: str,
    base_cost: Any,
    base_kv_bytes_per_token: float = 0.0,
) -> list[ReplicaSpec]:
    """The cluster's replicas: ``--num-replicas`` copies of the base setup,
    ``--num-prefill-replicas`` + ``--num-decode-replicas`` of it, or the
    ``--replica-config`` entries (fields not given fall back to the flags).

    Raises:
        CliError: when ``--num-replicas`` disagrees with the config's count, or
            an entry's role is unknown.
    """
    from roseinfer.simulator.cli import (
        DEFAULT_DEVICE,
        DEFAULT_MODEL,
        default_num_kv_blocks,
        load_model_spec,
    )

    gpus = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.replica_config is None:
        if _wants_disaggregation(args):
            return [
                ReplicaSpec(f"{base_name} {role}", base, base_cost, role, base_kv_bytes_per_token, gpus)
                for role, count in (("prefill", args.num_prefill_replicas),
                                    ("decode", args.num_decode_replicas))
                for _ in range(count)
            ]  # fmt: skip
        spec = ReplicaSpec(base_name, base, base_cost, "mixed", base_kv_bytes_per_token, gpus)
        return [spec] * (args.num_replicas or 1)
    specs: list[ReplicaSpec] = []
    for entry in read_replica_config(args.replica_config):
        model = load_model_spec(entry.get("model", args.model or DEFAULT_MODEL))
        device = get_device_spec(
            entry.get("hardware", entry.get("device", args.device or DEFAULT_DEVICE))
        )
        tp = entry.get("tensor_parallel_size", args.tensor_parallel_size)
        pp = entry.get("pipeline_parallel_size", args.pipeline_parallel_size)
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
        if base.kv_tiers is not None:  # the same GiB hold blocks of this model's size
            block_bytes = int(model.kv_bytes_per_token) * base.block_size
            config = replace(config, kv_tiers=base.kv_tiers.for_block_bytes(block_bytes))
        label = f" x{tp * pp}" if tp * pp > 1 else ""
        name = entry.get("name", f"{model.name}@{device.name}{label}")
        try:
            spec = ReplicaSpec(name, config, cost, entry.get("role", "mixed"),
                               model.kv_bytes_per_token, tp * pp)  # fmt: skip
        except ValueError as err:
            raise CliError(f"--replica-config {args.replica_config}: {err}") from None
        specs += [spec] * entry.get("count", 1)
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
    disagg = any(s.role != "mixed" for s in specs)
    try:
        result = simulate_cluster(
            requests,
            specs,
            router,
            registry=registry,
            jump=not args.no_jump,
            router_staleness_s=args.router_staleness_s,
            keep_token_times=args.save_records is not None,
            decode_router=make_decode_router(args, registry) if disagg else None,
            kv_transfer_link=kv_transfer_link(args) if disagg else None,
        )
    except ValueError as err:
        raise CliError(str(err)) from None
    per = result.replica_summaries()
    per.insert(2, "num_routed", result.info["routed"])
    tier_keys = add_kv_tier_columns(per, result)
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
        **kv_tier_summary(s.block_manager.kv_tier_counters() for s in result.schedulers),
        "replica_summaries": per[["replica", "name", *PER_REPLICA_KEYS, *tier_keys]].to_dict(
            "records"
        ),
    }
    if result.disaggregation is not None:
        extra["num_prefill_replicas"] = sum(s.role == "prefill" for s in specs)
        extra["num_decode_replicas"] = sum(s.role == "decode" for s in specs)
        extra["disaggregation"] = result.disaggregation
    title = f"{title} | {len(specs)} replicas, router {router.name}"
    report(args, result.records, duration_s=result.duration_s, title=title, extra=extra,
           itl=result.itl)  # fmt: skip
    if not args.no_summary:
        if result.disaggregation is not None:
            print(format_disaggregation(result.disaggregation))
        print(format_replicas(per))
        print(
            f"simulated {len(requests)} requests on {len(specs)} replicas, "
            f"{result.num_steps} steps in {result.wall_s:.2f} s wall"
        )
    return result


def add_kv_tier_columns(per: pd.DataFrame, result: ClusterResult) -> list[str]:
    """Add each replica's KV tier hit rates and bytes moved to the per-replica table
    (``kv_hit_rate_device``, ``kv_hit_rate_<tier>``, ``kv_offloaded_bytes``,
    ``kv_loaded_bytes``); returns the columns added (none without tiers)."""
    rows = [kv_tier_summary([s.block_manager.kv_tier_counters()]) for s in result.schedulers]
    if not rows or not rows[0]:
        return []
    keys = [k for k in rows[0] if k.startswith("kv_hit_rate_")]
    keys += ["kv_offloaded_bytes", "kv_loaded_bytes"]
    for key in keys:
        per[key] = [row.get(key, 0.0) for row in rows]
    return keys


def format_replicas(per: pd.DataFrame) -> str:
    """The per-replica table: role, busy fraction, requests routed and finished, hit
    rate (and per KV tier, with tiers), TTFT and TPOT (a disaggregated replica's of
    its own stage)."""
    tiers = [c for c in per.columns if c.startswith("kv_hit_rate_")]
    head = "".join(f" {c.removeprefix('kv_hit_rate_')[:8]:>8}%" for c in tiers)
    lines = [
        "replica  name                           role     busy%  routed   done  hit%"
        + head
        + "  p99 TTFT ms  mean TTFT ms  p99 TPOT ms"
    ]
    for row in per.itertuples():
        cells = "".join(f" {100 * getattr(row, c):>9.1f}" for c in tiers)
        lines.append(
            f"{row.replica:>7}  {row.name[:30]:<30} {row.role:<8} {100 * row.utilization:>5.1f} "
            f"{row.num_routed:>7} {row.completed:>6} {100 * row.prefix_cache_hit_rate:>5.1f}"
            f"{cells} {row.p99_ttft_ms:>12.1f} {row.mean_ttft_ms:>13.1f} {row.p99_tpot_ms:>12.1f}"
        )
    return "\n".join(lines)


def format_disaggregation(report: dict[str, Any]) -> str:
    """Two lines: per-stage queueing and the KV handoffs."""
    return (
        f"stages: prefill queue mean {report['mean_prefill_queue_ms']:.1f} / p99 "
        f"{report['p99_prefill_queue_ms']:.1f} ms, decode queue mean "
        f"{report['mean_decode_queue_ms']:.1f} / p99 {report['p99_decode_queue_ms']:.1f} ms\n"
        f"KV handoffs over {report['kv_transfer_link']}: {report['num_kv_transfers']} moved "
        f"{report['kv_transfer_gb']:.2f} GB, transfer mean {report['mean_kv_transfer_ms']:.2f} / "
        f"p99 {report['p99_kv_transfer_ms']:.2f} ms (waiting for a busy link "
        f"{report['mean_kv_transfer_wait_ms']:.2f} ms mean)"
    )
