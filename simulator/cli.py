"""``rose-sim``: replay a workload through the shared scheduler with a cost model.

Example::

    rose-sim --policy pack --prefill-max-tokens 256 --force-fifo-every 8
    rose-sim --policy budget --prefill-max-tokens 2048 \\
        --trace AzureLLMInferenceTrace_conv.csv --model llama-3.1-8b --hardware h100-sxm
    rose-sim --num-replicas 8 --router prefix-aware --trace synthetic_trace.jsonl
    rose-sim sweep grid.toml --backend ray
    rose-sim capacity --goodput ttft:2000 tpot:100 --policy budget --prefill-max-tokens 2048
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from roseinfer.calibration import Profile, ProfileError
from roseinfer.calibration.cost_model import CostModel, make_cost_model
from roseinfer.calibration.profile import load_calibration
from roseinfer.calibration.specs import (
    DEVICES,
    LINKS,
    MODELS,
    DeviceSpec,
    ModelSpec,
    get_device_spec,
    get_model_spec,
    model_spec_from_hf_config,
)
from roseinfer.calibration.steplog import StepLogWriter, StepRecorder, make_header
from roseinfer.cli import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    ArgumentParser,
    CliError,
    DeprecatedAlias,
    add_common_args,
    add_flag,
    build_workload,
    config_facts,
    fit_workload,
    int_in,
    kv_blocks_from_bytes,
    policy_facts,
    report,
    run_main,
    scheduler_config,
    scheduler_knobs,
)
from roseinfer.config import DEFAULT_BLOCK_SIZE, SchedulerConfig
from roseinfer.kv_tiers import kv_tier_summary
from roseinfer.registry import Registry
from roseinfer.sequence import Sequence
from roseinfer.simulator.cluster_cli import (
    add_cluster_args,
    replica_specs,
    run_cluster,
    wants_cluster,
)
from roseinfer.simulator.engine import simulate

DEFAULT_MODEL = "llama-3.1-8b"
DEFAULT_DEVICE = "h100-sxm"
GPU_MEMORY_UTILIZATION = DEFAULT_GPU_MEMORY_UTILIZATION  # vLLM's default


def build_parser() -> argparse.ArgumentParser:
    """The ``rose-sim`` argument parser."""
    parser = ArgumentParser(
        prog="rose-sim",
        description="Simulate an LLM-serving scheduling policy on a workload with a cost "
        "model (default: the embedded Azure conv trace sample, Llama-3.1-8B on one H100).",
        epilog="subcommands (each has its own --help): `rose-sim sweep GRID.toml` simulates "
        "every point of a grid (policies x knobs x rates x replicas) into one table; "
        "`rose-sim capacity --goodput METRIC:MS ...` finds the highest steady-state "
        "request rate meeting the SLOs (these flags plus the search's).",
    )
    add_common_args(parser)
    g = parser.add_argument_group("cost model")
    g.add_argument(
        "--model",
        help=f"model shape (default {DEFAULT_MODEL}, or the profiled model with "
        f"--cost-model): a built-in name ({', '.join(sorted(MODELS))}) or a transformers "
        "config.json",
    )
    g.add_argument(
        "--hardware",
        dest="device",
        metavar="SPEC",
        help=f"simulated hardware, one GPU's spec (default {DEFAULT_DEVICE}): "
        f"{', '.join(sorted(DEVICES))}",
    )
    g.add_argument(
        "--device",
        dest="device",
        action=DeprecatedAlias,
        new="--hardware",
        metavar="SPEC",
        help="deprecated name of --hardware, kept for this release (rose-run's --device is "
        "the torch device)",
    )
    g.add_argument(
        "--cost-model",
        type=Path,
        nargs="+",
        action="extend",
        metavar="FILE",
        help="price steps with a calibration: a profile from `rose-run profile` (PROFILE.json) "
        "and/or step logs of real runs (`--save-steps FILE.jsonl`; several are pooled and "
        "fitted together). Its fitted step times price the calibrated model, its calibrated "
        "roofline another --model; the calibrated KV pool, block size, max model length and "
        "--fit-lengths become the defaults",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int_in(1, 1024),
        default=1,
        help="GPUs a replica's layers are sharded over, as vLLM (default 1): weights and KV "
        "split, two all-reduces per layer over --interconnect",
    )
    g.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int_in(1, 1024),
        default=1,
        help="pipeline stages a replica's layers are split into, as vLLM (default 1): "
        "weights and KV split, one activation handoff per stage",
    )
    g.add_argument(
        "--interconnect",
        choices=sorted(LINKS),
        help="link between a replica's GPUs (default: the device's: NVLink on "
        "A100/H100/H200); bandwidths and sources in calibration/specs.py",
    )
    add_flag(g, "--gpu-memory-utilization")
    g.add_argument(
        "--no-jump",
        action="store_true",
        help="plan every decode step alone (slower; same result, for checking)",
    )
    add_cluster_args(parser)
    parser.set_defaults(block_size=None)  # None: the profile's, else DEFAULT_BLOCK_SIZE
    # NOTE: nobody crafts colliding prompts in a simulation, and SHA-256 made a 2,000-request
    # synthetic run with 1,024-token prompts 1.45-1.59x slower (benchmarks/input_costs.py).
    parser.set_defaults(prefix_caching_hash_algo="builtin")
    return parser


def load_model_spec(name: str) -> ModelSpec:
    """A built-in model spec, or one read from a transformers ``config.json``.

    Raises:
        CliError: if the file cannot be read or holds no valid model shape.
    """
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        try:
            return model_spec_from_hf_config(json.loads(file.read_text()))
        except (OSError, ValueError, KeyError, RecursionError) as err:
            detail = str(err).strip()[:200] or type(err).__name__
            raise CliError(f"cannot read a model config from {file}: {detail}") from None
    return get_model_spec(name)


def default_num_kv_blocks(
    args: argparse.Namespace,
    model: ModelSpec,
    device: DeviceSpec,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
) -> int:
    """KV blocks from ``--kv-cache-memory-gb`` (per GPU) or from each GPU's memory
    left after its share of the weights.

    With ``tensor_parallel`` x ``pipeline_parallel`` GPUs, each holds ``1 / (tp x
    pp)`` of the weights and, per token, ``1 / (min(tp, kv heads) x pp)`` of the KV
    (KV heads are replicated past their count, as vLLM does), so the pool holds
    as many tokens as one GPU's free memory over its share of a token's KV.

    Raises:
        CliError: if the weights alone do not fit, or the memory holds no block.
    """
    block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
    num_gpus = tensor_parallel * pipeline_parallel
    kv_per_token = model.kv_bytes_per_token / (
        min(tensor_parallel, model.num_kv_heads) * pipeline_parallel
    )
    if args.kv_cache_memory_gb is not None:
        num_bytes = args.kv_cache_memory_gb * 2**30
        return kv_blocks_from_bytes(num_bytes, kv_per_token, block_size)
    weights = model.weight_bytes / num_gpus
    num_bytes = device.mem_bytes * args.gpu_memory_utilization - weights
    if num_bytes <= 0:
        gpus = f" x{num_gpus}" if num_gpus > 1 else ""
        raise CliError(
            f"{model.name} weights ({model.weight_bytes / 2**30:.1f} GiB, "
            f"{weights / 2**30:.1f} GiB per GPU) do not fit {device.name}{gpus}; raise "
            "--tensor-parallel-size, pick a larger --hardware or set --kv-cache-memory-gb"
        )
    source = f"--gpu-memory-utilization {args.gpu_memory_utilization:g} of {device.name}"
    return kv_blocks_from_bytes(num_bytes, kv_per_token, block_size, source)


@dataclass(frozen=True)
class _Setup:
    """What prices the run and the scheduler defaults that come with it."""

    cost_model: CostModel
    model: ModelSpec
    device_name: str
    num_kv_blocks: int
    max_model_len: int
    extra: dict[str, Any]
    fit_lengths: str = "off"


def _roofline_setup(args: argparse.Namespace) -> _Setup:
    model = load_model_spec(args.model or DEFAULT_MODEL)
    device = get_device_spec(args.device or DEFAULT_DEVICE)
    if args.block_size is None:
        args.block_size = DEFAULT_BLOCK_SIZE
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    try:
        cost_model = make_cost_model(model, device, None, tp, pp, args.interconnect)
    except ValueError as err:
        raise CliError(f"--tensor-parallel-size/--pipeline-parallel-size: {err}") from None
    num_blocks = default_num_kv_blocks(args, model, device, tp, pp)
    name = device.name if tp * pp == 1 else f"{device.name} x{tp * pp} (TP{tp} PP{pp})"
    extra = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "num_gpus": tp * pp}
    return _Setup(cost_model, model, name, num_blocks, model.max_model_len, extra)


def _profile_setup(args: argparse.Namespace) -> _Setup:
    """The calibration's cost model and scheduler defaults; explicit flags that differ
    from the calibrated executor are recorded as ``profile_overrides``.

    Raises:
        CliError: with --device (the calibration is the device), a bad file, or a
            calibration without a model shape and no --model.
    """
    if args.device is not None:
        raise CliError("--cost-model prices the profiled device; drop --hardware")
    if args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1 or args.interconnect:
        raise CliError(
            "--cost-model prices what was measured on one device; drop "
            "--tensor-parallel-size/--pipeline-parallel-size/--interconnect (or price a "
            "parallel replica with the roofline: --model and --hardware)"
        )
    try:
        profile = load_calibration(args.cost_model)
    except ProfileError as err:
        raise CliError(str(err)) from None
    model, other = _calibrated_model(args, profile)
    max_num_seqs = scheduler_knobs(args)["max_num_seqs"]
    try:
        defaults = profile.scheduler_defaults(other, args.block_size, max_num_seqs)
        cost_model = profile.cost_model(other)
    except ProfileError as err:
        raise CliError(str(err)) from None
    args.block_size = defaults["block_size"]
    num_blocks = defaults["num_kv_blocks"]
    if args.kv_cache_memory_gb is not None:
        num_blocks = kv_blocks_from_bytes(
            args.kv_cache_memory_gb * 2**30, model.kv_bytes_per_token, args.block_size
        )
    wanted = {
        "model": None if other is None else model.name,
        "block_size": args.block_size,
        "num_kv_blocks": num_blocks if args.num_kv_blocks is None else args.num_kv_blocks,
        "max_model_len": args.max_model_len,
    }
    profiled = {"model": None, **profile.scheduler_defaults()}
    overrides = {
        k: {"profile": profile.model_name if k == "model" else profiled[k], "used": v}
        for k, v in wanted.items()
        if v is not None and v != profiled[k]
    }
    extra = {
        "cost_model_file": ",".join(str(p) for p in args.cost_model),
        "profile_overrides": overrides,
    }
    device = f"{profile.executor.get('device', '?')} (profiled)"
    return _Setup(cost_model, model, device, num_blocks, defaults["max_model_len"], extra,
                  profile.fit_lengths)  # fmt: skip


def _calibrated_model(
    args: argparse.Namespace, profile: Profile
) -> tuple[ModelSpec, ModelSpec | None]:
    """The model to simulate, and that model again when it is *another* shape than
    the calibrated one (priced by the calibrated roofline), else None.

    A calibration without a model shape (an engine's step log) prices its own
    model only: ``--model`` then names that model's shape.

    Raises:
        CliError: without a model shape in the calibration or from --model.
    """
    if profile.model_spec is None:
        if args.model is None:
            raise CliError(
                f"{args.cost_model[0]} records no model shape; name it with --model (a "
                "built-in name or a transformers config.json)"
            )
        return load_model_spec(args.model), None
    if args.model is None:
        return profile.model_spec, None
    model = replace(load_model_spec(args.model), dtype_bytes=profile.model_spec.dtype_bytes)
    return model, None if profile.same_shape(model) else model


def _run(args: argparse.Namespace, registry: Registry) -> None:
    requests, workload_name = build_workload(args)
    setup = _profile_setup(args) if args.cost_model is not None else _roofline_setup(args)
    model, cost_model = setup.model, setup.cost_model
    max_model_len = args.max_model_len or setup.max_model_len
    requests, fit_note = fit_workload(args, requests, max_model_len, default=setup.fit_lengths)
    config = scheduler_config(
        args,
        registry,
        num_kv_blocks=setup.num_kv_blocks,
        max_model_len=setup.max_model_len,
        kv_bytes_per_token=model.kv_bytes_per_token,
    )
    if wants_cluster(args):
        name = f"{model.name}@{setup.device_name}"
        specs = replica_specs(args, config, name, cost_model, model.kv_bytes_per_token)
        facts = {"backend": "sim", "workload": workload_name, **setup.extra}
        title = f"rose-sim: {config.policy} | {workload_name}"
        run_cluster(args, registry, requests, specs, title=title, extra=facts)
        return
    recorder = _step_recorder(args, model, setup, config)
    try:
        with _progress(len(requests), quiet=args.quiet) as on_ended:
            result = simulate(
                requests, config, cost_model, registry=registry, jump=not args.no_jump,
                keep_token_times=args.save_records is not None, on_ended=on_ended,
                on_step=recorder,
            )  # fmt: skip
    finally:
        if recorder is not None and recorder.writer is not None:
            recorder.writer.close()
    extra = {
        "backend": "sim",
        "policy": result.policy,
        "workload": workload_name,
        "model": model.name,
        "device": setup.device_name,
        "cost_model": cost_model.describe(),
        "cost_model_kind": cost_model.name,
        **setup.extra,
        "fit_lengths": fit_note,
        "scheduler_preset": args.scheduler_preset or "seeds",
        **config_facts(config),
        **policy_facts(config, registry),
        "sim_wall_s": result.wall_s,
        "num_steps": result.num_steps,
        **kv_tier_summary([result.scheduler.block_manager.kv_tier_counters()]),
    }
    title = f"rose-sim: {result.policy} | {workload_name} | {model.name} on {setup.device_name}"
    report(
        args, result.records, duration_s=result.duration_s, title=title, extra=extra,
        itl=result.itl,
    )  # fmt: skip
    if not args.no_summary:
        print(
            f"simulated {len(requests)} requests, {result.num_steps} steps "
            f"in {result.wall_s:.2f} s wall"
        )


def _step_recorder(
    args: argparse.Namespace, model: ModelSpec, setup: _Setup, config: SchedulerConfig
) -> StepRecorder | None:
    """``--save-steps``: a step log of the simulated steps, in the schema real runs write."""
    if args.save_steps is None:
        return None
    header = make_header(
        "rose-sim",
        model={"name": model.name, "spec": dataclasses.asdict(model)},
        executor={
            "device": setup.device_name,
            "cost_model": setup.cost_model.describe(),
            "num_kv_blocks": config.num_kv_blocks,
            "block_size": config.block_size,
            "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "fit_lengths": args.fit_lengths or setup.fit_lengths,
        },
        scheduler=config_facts(config),
    )
    return StepRecorder(StepLogWriter(args.save_steps, header))


@contextlib.contextmanager
def _progress(num_requests: int, *, quiet: bool) -> Iterator[Callable[[list[Sequence]], None]]:
    """A progress bar on stderr (requests ended, simulated time) that appears
    only when a run lasts more than 2 s wall; none with ``--quiet``."""
    with tqdm(
        total=num_requests, desc="simulating", unit="req", disable=quiet, delay=2.0,
        file=sys.stderr, mininterval=0.5,
    ) as bar:  # fmt: skip

        def on_ended(seqs: list[Sequence]) -> None:
            bar.update(len(seqs))
            last = seqs[-1].finish_s
            if last is not None and bar.n % 512 < len(seqs):
                bar.set_postfix_str(f"sim time {last:,.0f} s", refresh=False)

        yield on_ended


def main() -> int:
    """Entry point of ``rose-sim`` (``rose-sim sweep ...`` and ``rose-sim capacity ...``
    are subcommands; see ``roseinfer.experiments.sweep_cli``)."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("sweep", "capacity"):
        from roseinfer.experiments import sweep_cli

        command = sweep_cli.sweep_main if argv[0] == "sweep" else sweep_cli.capacity_main
        return command(argv[1:])
    return run_main("rose-sim", build_parser(), _run)


if __name__ == "__main__":
    raise SystemExit(main())
