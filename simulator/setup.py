"""What prices a simulation: the model shape, the hardware, the cost model and the
KV pool that goes with them.

Two setups: the roofline of a model on a built-in hardware spec (optionally a
replica sharded over GPUs), or a calibration (a ``rose-run profile`` file or
step logs) whose fitted step times price the calibrated model and whose
calibrated roofline prices another shape. ``rose-sim``, its sweeps and capacity
searches and the benchmarks build their runs from these. Errors are
``ValueError`` lines naming the setting (its flag) and the fix.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roseinfer.calibration.cost_model import (
    CostModel,
    RooflineCostModel,
    cost_model_source,
    make_cost_model,
)
from roseinfer.calibration.graph_replay import DECODE_GRAPHS, GraphReplay
from roseinfer.calibration.specs import (
    DEVICES,
    DeviceSpec,
    ModelSpec,
    UnknownSpecError,
    get_device_spec,
    get_model_spec,
    model_spec_from_hf_config,
)
from roseinfer.config import DEFAULT_BLOCK_SIZE, kv_blocks_from_bytes

if TYPE_CHECKING:
    from roseinfer.calibration.profile import Profile

DEFAULT_MODEL = "llama-3.1-8b"
"""The model ``rose-sim`` simulates when none is named."""
DEFAULT_HARDWARE = "h100-sxm"
"""The hardware spec ``rose-sim`` simulates when none is named."""

MAX_REPLICAS = 4096
"""Most replicas in one simulated cluster (the replica flags, a replica config's total, a
sweep's replica axis): each keeps its own scheduler, KV pool and prefix cache, so 100,000
took minutes and gigabytes before the first request; a larger fleet is a sweep of smaller ones."""


class SetupError(ValueError):
    """A setup that cannot be priced (the message names the setting and the fix)."""


@dataclass(frozen=True, slots=True)
class KVPool:
    """How the flags size a replica's KV pool.

    Attributes:
        block_size: tokens per block (None: the calibration's, else the default).
        kv_cache_memory_gb: the pool in GiB per GPU (None: from memory).
        gpu_memory_utilization: share of each GPU's memory for weights and KV.
        num_kv_blocks: the pool in blocks, when given (wins; recorded only).
    """

    block_size: int | None = None
    kv_cache_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class SimSetup:
    """What prices the run and the scheduler defaults that come with it.

    Attributes:
        cost_model: prices each step.
        model: the simulated model's shape.
        device_name: the hardware as a result file and a header name it.
        num_kv_blocks: the default KV pool (blocks).
        block_size: tokens per block.
        max_model_len: the default longest request.
        extra: facts for the result file.
        fit_lengths: the default ``--fit-lengths`` (a calibration's run's).
    """

    cost_model: CostModel
    model: ModelSpec
    device_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    extra: dict[str, Any] = field(default_factory=dict)
    fit_lengths: str = "off"


def load_model_spec(name: str) -> ModelSpec:
    """A built-in model spec, or one read from a transformers ``config.json`` (a
    file, or a directory holding one).

    Raises:
        SetupError: if the file cannot be read or holds no valid model shape.
        UnknownSpecError: for an unknown built-in name (lists the known ones).
    """
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        try:
            return model_spec_from_hf_config(json.loads(file.read_text()))
        except (OSError, ValueError, KeyError, RecursionError) as err:
            detail = str(err).strip()[:200] or type(err).__name__
            raise SetupError(f"cannot read a model config from {file}: {detail}") from None
    return get_model_spec(name)


def hardware_spec(name: str) -> DeviceSpec:
    """The built-in hardware spec ``name`` (``--hardware``).

    Raises:
        SetupError: for an unknown name, listing the known ones.
    """
    try:
        return get_device_spec(name)
    except UnknownSpecError:
        known = ", ".join(sorted(DEVICES))
        raise SetupError(
            f"unknown --hardware spec {name[:40]!r}; known hardware specs: {known} (or "
            "calibrate one: --cost-model PROFILE.json)"
        ) from None


def default_num_kv_blocks(
    pool: KVPool,
    model: ModelSpec,
    device: DeviceSpec,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """KV blocks from ``kv_cache_memory_gb`` (per GPU) or from each GPU's memory
    left after its share of the weights.

    With ``tensor_parallel`` x ``pipeline_parallel`` GPUs, each holds ``1 / (tp x
    pp)`` of the weights and, per token, ``1 / (min(tp, kv heads) x pp)`` of the KV
    (KV heads are replicated past their count, as vLLM does), so the pool holds
    as many tokens as one GPU's free memory over its share of a token's KV.

    Raises:
        SetupError: if the weights alone do not fit, or the memory holds no block.
    """
    block_size = DEFAULT_BLOCK_SIZE if pool.block_size is None else pool.block_size
    num_gpus = tensor_parallel * pipeline_parallel
    kv_per_token = model.kv_bytes_per_token / (
        min(tensor_parallel, model.num_kv_heads) * pipeline_parallel
    )
    if pool.kv_cache_memory_gb is not None:
        return _blocks(pool.kv_cache_memory_gb * 2**30, kv_per_token, block_size)
    weights = model.weight_bytes / num_gpus
    num_bytes = device.mem_bytes * pool.gpu_memory_utilization - weights
    if num_bytes <= 0:
        gpus = f" x{num_gpus}" if num_gpus > 1 else ""
        raise SetupError(
            f"{model.name} weights ({model.weight_bytes / 2**30:.1f} GiB, "
            f"{weights / 2**30:.1f} GiB per GPU) do not fit {device.name}{gpus}; raise "
            "--tensor-parallel-size, pick a larger --hardware or set --kv-cache-memory-gb"
        )
    source = f"--gpu-memory-utilization {pool.gpu_memory_utilization:g} of {device.name}"
    return _blocks(num_bytes, kv_per_token, block_size, source)


def _blocks(num_bytes: float, kv_per_token: float, block_size: int, source: str = "") -> int:
    try:
        if source:
            return kv_blocks_from_bytes(num_bytes, kv_per_token, block_size, source)
        return kv_blocks_from_bytes(num_bytes, kv_per_token, block_size)
    except ValueError as err:
        raise SetupError(str(err)) from None


def roofline_setup(
    model_name: str | None,
    hardware: str | None,
    pool: KVPool,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    interconnect: str | None = None,
    *,
    step_jitter: bool = False,
    graphs: GraphReplay = DECODE_GRAPHS,
) -> SimSetup:
    """The roofline of ``model_name`` on ``hardware`` (defaults: :data:`DEFAULT_MODEL`
    on :data:`DEFAULT_HARDWARE`), sharded over ``tensor_parallel`` x
    ``pipeline_parallel`` GPUs joined by ``interconnect``. ``step_jitter``: add a
    measured spec's eager step jitter (``RooflineCostModel.with_step_jitter``).
    ``graphs``: which steps the priced executor replays from CUDA graphs
    (``GraphReplay.of_mode`` of ``--cudagraph-mode`` at the run's limits).

    Raises:
        SetupError: on an unknown spec, a bad parallel layout, or weights that do
            not fit.
    """
    model = load_model_spec(model_name or DEFAULT_MODEL)
    device = hardware_spec(hardware or DEFAULT_HARDWARE)
    tp, pp = tensor_parallel, pipeline_parallel
    try:
        cost_model = make_cost_model(model, device, None, tp, pp, interconnect, graphs)
    except ValueError as err:
        raise SetupError(f"--tensor-parallel-size/--pipeline-parallel-size: {err}") from None
    if step_jitter and isinstance(cost_model, RooflineCostModel):
        cost_model = cost_model.with_step_jitter()
    num_blocks = default_num_kv_blocks(pool, model, device, tp, pp)
    name = device.name if tp * pp == 1 else f"{device.name} x{tp * pp} (TP{tp} PP{pp})"
    extra = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_gpus": tp * pp,
             "cost_model_source": cost_model_source(cost_model), "cudagraph_mode": graphs.mode}  # fmt: skip
    block_size = DEFAULT_BLOCK_SIZE if pool.block_size is None else pool.block_size
    return SimSetup(cost_model, model, name, num_blocks, block_size, model.max_model_len, extra)


def calibrated_setup(
    files: Sequence[Path],
    model_name: str | None,
    pool: KVPool,
    max_num_seqs: int,
    max_model_len: int | None = None,
    *,
    step_jitter: bool = True,
    cudagraph_mode: str | None = None,
) -> SimSetup:
    """The calibration in ``files``: its fitted step times price the calibrated
    model, its calibrated roofline another ``model_name``; the calibrated KV pool,
    block size, model length and ``--fit-lengths`` are the defaults. Settings that
    differ from the calibrated run are recorded as ``profile_overrides``.
    ``step_jitter`` False prices fitted medians only (no
    :class:`~roseinfer.calibration.jitter.StepJitter`). The steps priced as replayed
    from CUDA graphs are those the calibrated executor replayed; ``cudagraph_mode``
    (the flag) must name its mode when given.

    Raises:
        SetupError: on a bad file, a calibration without a model shape and no
            ``model_name``, or a ``cudagraph_mode`` the calibration did not run.
    """
    # NOTE: imported here: a roofline run never loads the profile readers and fitters
    from roseinfer.calibration.profile import load_calibration
    from roseinfer.calibration.step_model import ProfiledCostModel, ProfileError

    try:
        profile = load_calibration(files)
    except ProfileError as err:
        raise SetupError(str(err)) from None
    model, other = _calibrated_model(files, model_name, profile)
    graphs = _calibrated_graphs(profile, cudagraph_mode)
    try:
        defaults = _pool_defaults(profile, other, pool, max_num_seqs)
        cost_model = profile.cost_model(other)
        if not step_jitter and isinstance(cost_model, ProfiledCostModel):
            cost_model = cost_model.without_jitter()
    except ProfileError as err:
        raise SetupError(str(err)) from None
    block_size, num_blocks = defaults["block_size"], defaults["num_kv_blocks"]
    if pool.kv_cache_memory_gb is not None:
        num_blocks = _blocks(pool.kv_cache_memory_gb * 2**30, model.kv_bytes_per_token, block_size)
    wanted = {
        "model": None if other is None else model.name,
        "block_size": block_size,
        "num_kv_blocks": num_blocks if pool.num_kv_blocks is None else pool.num_kv_blocks,
        "max_model_len": max_model_len,
    }
    profiled = {"model": None, **profile.scheduler_defaults()}
    overrides = {
        k: {"profile": profile.model_name if k == "model" else profiled[k], "used": v}
        for k, v in wanted.items()
        if v is not None and v != profiled[k]
    }
    extra = {"cost_model_file": ",".join(map(str, files)), "profile_overrides": overrides,
             "cost_model_source": cost_model_source(cost_model), "cudagraph_mode": graphs.mode}  # fmt: skip
    how = "fitted step times" if other is None else "calibrated roofline"
    device = f"{profile.executor.get('device', '?')} ({how})"
    return SimSetup(cost_model, model, device, num_blocks, block_size,
                    defaults["max_model_len"], extra, profile.fit_lengths)  # fmt: skip


def _calibrated_graphs(profile: Profile, mode: str | None) -> GraphReplay:
    """Which steps of the simulated run replay graphs: the calibration's.

    Raises:
        SetupError: when ``mode`` (``--cudagraph-mode``) is not the calibration's.
    """
    measured = profile.graphs
    if mode is not None and mode != measured.mode:
        ran = "every step eagerly (a CPU, or --enforce-eager)" if not measured.any else (
            f"--cudagraph-mode {measured.mode}")  # fmt: skip
        raise SetupError(
            f"--cudagraph-mode {mode}: the calibration ran {ran}, so its step times price "
            "that; drop --cudagraph-mode, or calibrate a run of that mode"
        )
    return measured


def _pool_defaults(
    profile: Profile, other: ModelSpec | None, pool: KVPool, max_num_seqs: int
) -> dict[str, int]:
    """The calibration's scheduler defaults for ``other``'s pool; when the calibration
    cannot resize its pool for another model (no KV pool bytes recorded) but the flags
    size it (``--num-kv-blocks``, ``--kv-cache-memory-gb``), the calibrated block size
    and that model's length, the flags' pool replacing the calibrated one.

    Raises:
        ProfileError: when the pool can be sized neither way.
    """
    from roseinfer.calibration.step_model import ProfileError

    try:
        return profile.scheduler_defaults(other, pool.block_size, max_num_seqs)
    except ProfileError:
        if other is None or (pool.num_kv_blocks is None and pool.kv_cache_memory_gb is None):
            raise
    calibrated = profile.scheduler_defaults()
    return {
        "block_size": pool.block_size or calibrated["block_size"],
        "num_kv_blocks": pool.num_kv_blocks or calibrated["num_kv_blocks"],
        "max_model_len": other.max_model_len,
    }


def _calibrated_model(
    files: Sequence[Path], model_name: str | None, profile: Profile
) -> tuple[ModelSpec, ModelSpec | None]:
    """The model to simulate, and that model again when it is *another* shape than
    the calibrated one (priced by the calibrated roofline), else None.

    A calibration without a model shape (an engine's step log) prices its own
    model only: ``model_name`` then names that model's shape.

    Raises:
        SetupError: without a model shape in the calibration or a ``model_name``.
    """
    if profile.model_spec is None:
        if model_name is None:
            raise SetupError(
                f"{files[0]} records no model shape; name it with --model (a built-in name "
                "or a transformers config.json)"
            )
        return load_model_spec(model_name), None
    if model_name is None:
        return profile.model_spec, None
    model = dataclasses.replace(
        load_model_spec(model_name), dtype_bytes=profile.model_spec.dtype_bytes
    )
    return model, None if profile.same_shape(model) else model
