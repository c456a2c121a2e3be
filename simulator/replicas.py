"""A cluster's replicas: copies of one setup, or the entries of a replica config.

A replica config lists the replicas (TOML or JSON), each with optional
``model``, ``hardware`` (``device`` is the same key), ``num_kv_blocks``,
``name``, ``count`` (default 1), ``tensor_parallel_size``,
``pipeline_parallel_size``, ``interconnect`` and ``role`` (``mixed``, the
default, or ``prefill`` / ``decode`` for a disaggregated cluster); missing
fields take the command line's values. Each entry is priced by the roofline of
its model and hardware::

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

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from roseinfer.argtypes import clip
from roseinfer.calibration.cost_model import CostModel, RooflineCostModel, make_cost_model
from roseinfer.calibration.graph_replay import DECODE_GRAPHS, GraphReplay
from roseinfer.config import MAX_NUM_KV_BLOCKS, SchedulerConfig
from roseinfer.simulator.cluster import ReplicaSpec
from roseinfer.simulator.setup import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    MAX_REPLICAS,
    KVPool,
    SetupError,
    default_num_kv_blocks,
    hardware_spec,
    load_model_spec,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPLICA_KEYS = {
    "model", "hardware", "device", "num_kv_blocks", "count", "name",
    "tensor_parallel_size", "pipeline_parallel_size", "interconnect", "role",
}  # fmt: skip
REPLICA_INT_RANGES = {
    "count": (1, MAX_REPLICAS),
    "num_kv_blocks": (1, MAX_NUM_KV_BLOCKS),
    "tensor_parallel_size": (1, 1024),
    "pipeline_parallel_size": (1, 1024),
}
"""The integer keys of a replica entry and their ranges (the flags' ranges)."""


@dataclass(frozen=True, slots=True)
class ReplicaDefaults:
    """The command line's values, which a replica entry's missing keys take.

    Attributes:
        model: model name or config.json (None: :data:`DEFAULT_MODEL`).
        hardware: hardware spec name (None: :data:`DEFAULT_HARDWARE`).
        tensor_parallel: GPUs a replica's layers are sharded over.
        pipeline_parallel: pipeline stages of a replica.
        interconnect: link between a replica's GPUs (None: the hardware's).
        pool: how the KV pool is sized.
        max_model_len: longest request (None: each model's).
        step_jitter: add a measured spec's eager step jitter (``--step-jitter
            measured``).
        graphs: which steps replay CUDA graphs (``--cudagraph-mode``).
    """

    model: str | None = None
    hardware: str | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    interconnect: str | None = None
    pool: KVPool = KVPool()
    max_model_len: int | None = None
    step_jitter: bool = False
    graphs: GraphReplay = DECODE_GRAPHS


def copies(
    base: SchedulerConfig,
    name: str,
    cost: CostModel,
    kv_bytes_per_token: float,
    num_gpus: int,
    counts: dict[str, int],
) -> list[ReplicaSpec]:
    """``counts[role]`` copies of one setup per role (``mixed``, or ``prefill`` and
    ``decode``: a disaggregated cluster, whose replicas are named by role)."""
    specs: list[ReplicaSpec] = []
    for role, count in counts.items():
        label = name if role == "mixed" else f"{name} {role}"
        specs += [ReplicaSpec(label, base, cost, role, kv_bytes_per_token, num_gpus)] * count
    return specs


def read_replica_config(path: Path) -> list[dict[str, Any]]:
    """The replica entries of a TOML (``[[replica]]``) or JSON (list) file.

    Raises:
        SetupError: if the file cannot be read, has unknown keys or bad values, or
            lists more than :data:`MAX_REPLICAS` replicas.
    """
    try:
        text = path.read_text()
        data: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError, RecursionError) as err:
        raise SetupError(f"cannot read --replica-config {path}: {str(err)[:200]}") from None
    entries = data.get("replica", []) if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise SetupError(
            f"--replica-config {path} lists no replicas ([[replica]] tables or a list)"
        )
    total = 0
    for i, entry in enumerate(entries, 1):
        _check_entry(path, i, entry)
        total += entry.get("count", 1)
    if total > MAX_REPLICAS:
        raise SetupError(
            f"--replica-config {path} lists {total} replicas, more than {MAX_REPLICAS}; "
            "simulate a smaller cluster"
        )
    return entries


def _check_entry(path: Path, index: int, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise SetupError(f"--replica-config {path}: replica {index} is not a table of keys")
    unknown = set(entry) - REPLICA_KEYS
    if unknown:
        raise SetupError(
            f"--replica-config {path}: unknown keys {sorted(map(clip, map(str, unknown)))}; "
            f"known: {sorted(REPLICA_KEYS)}"
        )
    for key, value in entry.items():
        _check_value(path, index, key, value)
    if "hardware" in entry and "device" in entry:
        raise SetupError(
            f"--replica-config {path}: replica {index} gives both hardware and device (the "
            "same key, old name); keep hardware"
        )


def _check_value(path: Path, index: int, key: str, value: Any) -> None:
    """One replica entry's value: an integer in range, or a string.

    Raises:
        SetupError: naming the file, the replica and the key (``num_kv_blocks = 1.5``
            and ``count = "2"`` were truncated or silently misread before).
    """
    where = f"--replica-config {path}: replica {index}: {key}"
    if key in REPLICA_INT_RANGES:
        lo, hi = REPLICA_INT_RANGES[key]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise SetupError(f"{where} must be an integer in [{lo}, {hi}], got {clip(repr(value))}")
    elif not isinstance(value, str):
        raise SetupError(f"{where} must be a string, got {clip(repr(value))}")


def configured_replicas(
    path: Path, base: SchedulerConfig, defaults: ReplicaDefaults
) -> list[ReplicaSpec]:
    """The replicas of the config at ``path``: each entry priced by the roofline of
    its model and hardware, its pool sized as ``defaults.pool`` says, its KV tiers
    (from ``base``) resized to its block bytes.

    Raises:
        SetupError: on a bad file, spec, parallel layout or role.
    """
    specs: list[ReplicaSpec] = []
    for entry in read_replica_config(path):
        model = load_model_spec(entry.get("model", defaults.model or DEFAULT_MODEL))
        hardware = entry.get("hardware", entry.get("device", defaults.hardware))
        device = hardware_spec(hardware or DEFAULT_HARDWARE)
        tp = entry.get("tensor_parallel_size", defaults.tensor_parallel)
        pp = entry.get("pipeline_parallel_size", defaults.pipeline_parallel)
        try:
            cost = make_cost_model(model, device, None, tp, pp,
                                   entry.get("interconnect", defaults.interconnect),
                                   defaults.graphs)  # fmt: skip
        except ValueError as err:
            raise SetupError(f"--replica-config {path}: {err}") from None
        if defaults.step_jitter and isinstance(cost, RooflineCostModel):
            cost = cost.with_step_jitter()
        blocks = entry.get("num_kv_blocks") or defaults.pool.num_kv_blocks
        config = replace(
            base,
            num_kv_blocks=int(
                blocks or default_num_kv_blocks(defaults.pool, model, device, tp, pp)
            ),
            max_model_len=defaults.max_model_len or model.max_model_len,
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
            raise SetupError(f"--replica-config {path}: {err}") from None
        specs += [spec] * entry.get("count", 1)
    return specs
