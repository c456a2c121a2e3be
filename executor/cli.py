"""``rose-run``: replay a workload on a real model with the shared scheduler.

Takes the same workload, policy, scheduler and output flags as ``rose-sim``
and prints the same summary. Examples::

    rose-run --device cpu --model gpt2 --policy pack --prefill-max-tokens 256 \\
        --trace AzureLLMInferenceTrace_conv.csv --num-requests 64 --fit-lengths scale
    rose-run --device cuda --model /path/to/Llama-3.1-8B --policy budget --prefill-max-tokens 2048

Trace prompts longer than the model's context are fitted by ``--fit-lengths``
(``clip``: cut each request to the context; ``scale``: shrink every prompt and
output by one factor so the longest fits); the result file says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import time
from typing import Any

# NOTE: before torch loads libgomp, which reads it once. With the default (active)
# policy an idle OpenMP worker keeps spinning after every parallel region; on a CPU
# shared with other busy processes it then steals the main thread's core: a GPT-2
# decode step of one sequence with 2 threads took 1.6 s instead of 0.09 s (passive)
# on this 2-core machine while other jobs ran. Passive workers sleep instead (the
# benchmarks do the same). An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from roseinfer.cli import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FLAGS,
    ArgumentParser,
    CliError,
    add_common_args,
    add_flag,
    build_workload,
    check_args,
    config_facts,
    fit_workload,
    int_in,
    kv_blocks_from_bytes,
    policy_facts,
    policy_options,
    report,
    run_main,
    scheduler_config,
    scheduler_knobs,
)
from roseinfer.config import SchedulerConfig
from roseinfer.executor.engine import Engine, RunResult
from roseinfer.executor.facts import model_spec_of, step_log_recorder
from roseinfer.executor.model_runner import ATTENTION_BACKENDS, ModelRunner
from roseinfer.executor.models import BUILTIN_MODELS, build_model, make_adapter
from roseinfer.executor.warmup import warm_up
from roseinfer.kv_tiers import kv_tier_summary
from roseinfer.registry import Registry
from roseinfer.request import Request
from roseinfer.workloads.fit import with_token_ids

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_CACHE_GB = 1.0  # default KV pool on CPU (GiB)
GPU_MEMORY_UTILIZATION = DEFAULT_GPU_MEMORY_UTILIZATION  # vLLM's default


def build_parser() -> argparse.ArgumentParser:
    """The ``rose-run`` argument parser."""
    parser = ArgumentParser(
        prog="rose-run",
        description="Run an LLM-serving scheduling policy for real: the shared scheduler "
        "drives a PyTorch model with a paged KV cache (default: the embedded Azure conv "
        "trace sample on GPT-2 with random weights).",
        epilog="subcommand (its own --help): `rose-run profile --output PROFILE.json ...` "
        "times the executor's steps over a grid of batch shapes and fits a cost model for "
        "`rose-sim --cost-model PROFILE.json`.",
    )
    add_common_args(parser)
    g = parser.add_argument_group("executor")
    add_model_args(g)
    g.add_argument(
        "--save-token-ids",
        action="store_true",
        help="add prompt and output token ids to --save-records",
    )
    parser.set_defaults(prefix_caching_hash_algo="sha256")  # real prompts: collision-resistant
    return parser


def add_model_args(g: argparse._ArgumentGroup, *, warmup: bool = True) -> None:
    """The model, device and runner flags of ``rose-run``, ``rose-serve`` and ``rose-run
    profile`` (``warmup``: add ``--no-warmup``; a profile warms up every shape)."""
    g.add_argument(
        "--model",
        default="gpt2",
        help=f"a local transformers directory, or a built-in config with random weights "
        f"({', '.join(sorted(BUILTIN_MODELS))})",
    )
    g.add_argument(
        "--device",
        default=None,
        help="torch device: cpu or cuda[:N] (default: cuda if available). rose-sim's "
        "simulated hardware is its --hardware",
    )
    g.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="weights/KV dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    g.add_argument(
        "--attention-backend", choices=ATTENTION_BACKENDS, default="auto", help="attention kernel"
    )
    add_flag(
        g,
        "--gpu-memory-utilization",
        help=FLAGS["--gpu-memory-utilization"]["help"]
        + "; on CUDA, what is left after what the process holds once the model is loaded",
    )
    g.add_argument(
        "--num-threads",
        type=int_in(1, 4096),
        help="CPU threads for torch (torch.set_num_threads; default: torch's, one per "
        "core). On a CPU shared with other jobs 1 keeps step times steady",
    )
    if warmup:
        g.add_argument(
            "--no-warmup",
            action="store_true",
            help="skip the warm-up with the largest step shapes before the clock starts",
        )


def resolve_device(name: str | None) -> torch.device:
    """``--device`` as a torch device; CUDA asked for but absent is an error.

    Raises:
        CliError: for cuda without a CUDA device (or a missing index), another
            device type (meta, mps, ...: the runner supports cpu and cuda), or an
            unknown device string.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CliError(f"unknown --device {name[:40]!r}; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(
            f"--device {device.type} is not supported by the model runner; use cpu or cuda[:N]"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda but torch sees no CUDA device; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CliError(
            f"--device {name} but torch sees {torch.cuda.device_count()} CUDA device(s); "
            "use cuda:0 .. cuda:N-1"
        )
    return device


def check_run_args(args: argparse.Namespace, registry: Registry) -> None:
    """Every ``rose-run`` check that needs no model or workload (before torch work).

    Raises:
        CliError: naming the flag and the fix.
    """
    check_args(args, registry)
    resolve_device(args.device)


def set_num_threads(num_threads: int | None) -> None:
    """Apply ``--num-threads`` (None keeps torch's default).

    Raises:
        CliError: if it is < 1.
    """
    if num_threads is None:
        return
    if num_threads < 1:
        raise CliError(f"--num-threads must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)


def default_num_kv_blocks(
    args: argparse.Namespace,
    runner_bytes_per_token: int,
    device: torch.device,
    max_useful_blocks: int | None = None,
) -> int:
    """KV blocks from ``--kv-cache-memory-gb``, else 1 GiB on CPU, or on CUDA what
    ``--gpu-memory-utilization`` of the device's *total* memory leaves after what this
    process holds now (the model is loaded: its weights), as vLLM; capped at
    ``max_useful_blocks`` when memory decides.

    NOTE(vLLM's meaning): vLLM also subtracts a profiled activation peak; the warm-up's
    activations here come out of the ``1 - utilization`` headroom (0.1 of an H100 is 8 GB).
    Memory that other processes hold is not ours to take: a budget beyond the free memory
    is an error naming both, as vLLM refuses to start then.

    NOTE: the cap (``max_num_seqs`` requests of ``max_model_len`` tokens) only
    bites for tiny models, whose memory-derived pool would be millions of
    blocks: seconds to allocate and to index, for nothing but cache retention.
    """
    if args.kv_cache_memory_gb is not None:
        return kv_blocks_from_bytes(
            args.kv_cache_memory_gb * 2**30, runner_bytes_per_token, args.block_size
        )
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)  # this process: the weights, so far
        num_bytes = total * args.gpu_memory_utilization - held
        if num_bytes > free:
            raise CliError(
                f"--gpu-memory-utilization {args.gpu_memory_utilization:g} of {device} "
                f"({total / 2**30:.3g} GiB) leaves {num_bytes / 2**30:.3g} GiB for the KV pool, "
                f"but only {free / 2**30:.3g} GiB are free (other processes hold the rest); "
                "lower it or set --kv-cache-memory-gb"
            )
        source = (
            f"--gpu-memory-utilization {args.gpu_memory_utilization:g} of {device}'s "
            f"{total / 2**30:.3g} GiB after the weights ({held / 2**30:.3g} GiB)"
        )
    else:
        num_bytes = CPU_KV_CACHE_GB * 2**30
        source = f"the default CPU KV pool ({CPU_KV_CACHE_GB:g} GiB)"
    num_blocks = kv_blocks_from_bytes(num_bytes, runner_bytes_per_token, args.block_size, source)
    return num_blocks if max_useful_blocks is None else min(num_blocks, max_useful_blocks)


def available_memory_bytes(device: torch.device) -> int:
    """Bytes a new allocation can take on ``device``: free CUDA memory, or the
    host's ``MemAvailable`` (``/proc/meminfo``; free pages where that is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_pool_fits(num_kv_blocks: int, block_bytes: int, device: torch.device) -> None:
    """Refuse a KV pool larger than the memory ``device`` has left, before allocating it.

    Raises:
        CliError: naming the pool size, the memory available and the flags to lower.
    """
    need, have = num_kv_blocks * block_bytes, available_memory_bytes(device)
    if need > have:
        raise CliError(
            f"a KV pool of {num_kv_blocks} blocks needs {need / 2**30:.3g} GiB but {device} "
            f"has {have / 2**30:.3g} GiB available; lower --num-kv-blocks or "
            "--kv-cache-memory-gb (or --block-size)"
        )


def _kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def _max_context(model) -> int:
    """Positions the model was trained for, or its sliding window if smaller
    (the runner attends over whole contexts only)."""
    config = model.config
    context = int(getattr(config, "max_position_embeddings", None) or config.n_positions)
    window = make_adapter(model).shape.max_context_tokens
    return context if window is None else min(context, window)


def _max_model_len(args: argparse.Namespace, model) -> int:
    """``--max-model-len``, or the model's context; more than the model allows is an error."""
    context = _max_context(model)
    if args.max_model_len is None:
        return context
    if args.max_model_len > context:
        raise CliError(
            f"--max-model-len {args.max_model_len} exceeds the {context}-token context of "
            f"{args.model}; use at most {context}"
        )
    return args.max_model_len


def _fit_requests(
    args: argparse.Namespace, requests: list[Request], max_model_len: int, vocab_size: int
) -> tuple[list[Request], str, str]:
    """Fit lengths (``--fit-lengths``), make up missing token ids, and fold ids
    outside the vocabulary into it (a seed workload has GPT-2 ids; a tiny model
    has a small vocab). Returns the requests and a note on each change."""
    requests, fit_note = fit_workload(args, requests, max_model_len, default="clip")
    requests = with_token_ids(requests, vocab_size=vocab_size, seed=args.seed)
    num_folded = 0
    for i, r in enumerate(requests):
        ids = r.prompt_token_ids or ()
        if any(t >= vocab_size for t in ids):
            # NOTE: id % vocab keeps equal prompts (and prefixes) equal.
            folded = tuple(t % vocab_size for t in ids)
            requests[i] = dataclasses.replace(r, prompt_token_ids=folded)
            num_folded += 1
    vocab_note = (
        f"token ids of {num_folded} requests folded into the vocab ({vocab_size}) as id % vocab"
        if num_folded
        else "none"
    )
    return requests, fit_note, vocab_note


def _run(args: argparse.Namespace, registry: Registry) -> None:
    device = resolve_device(args.device)
    set_num_threads(args.num_threads)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    policy_options(args, registry)  # a bad policy flag fails before the model loads
    requests, workload_name = build_workload(args)
    model, config, _tokenizer = build_model(args.model, seed=args.seed, dtype=dtype, device=device)
    max_model_len = _max_model_len(args, model)
    requests, fit_note, vocab_note = _fit_requests(args, requests, max_model_len, _vocab(config))
    sched_config, runner = build_runner(args, registry, model, config, device, dtype)
    warmup_s = 0.0 if args.no_warmup else _warm_up(runner, sched_config)
    recorder = None
    if args.save_steps is not None:
        recorder = step_log_recorder(
            args.save_steps, backend="rose-run", model_name=args.model,
            model_spec=model_spec_of(args.model, config, dtype), runner=runner,
            config=sched_config, max_num_batched_tokens=sched_config.max_num_batched_tokens,
            fit_lengths=args.fit_lengths or "clip", scheduler_facts=config_facts(sched_config),
        )  # fmt: skip
    engine = Engine(runner, sched_config, registry, seed=args.seed, on_step=recorder)
    try:
        result = _replay(engine, requests, show=not args.quiet)
    finally:
        if recorder is not None and recorder.writer is not None:
            recorder.writer.close()
    records = result.records
    if not args.save_token_ids:
        records = records.drop(columns=["prompt_token_ids", "output_token_ids"])
    extra = {
        "backend": "executor",
        "policy": result.policy,
        "workload": workload_name,
        "model": args.model,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": runner.attention_backend,
        "fit_lengths": fit_note,
        "token_ids": vocab_note,
        "scheduler_preset": args.scheduler_preset or "seeds",
        **config_facts(sched_config),
        **policy_facts(sched_config, registry),
        "kv_pool_peak_utilization": result.scheduler.max_used_blocks / sched_config.num_kv_blocks,
        "peak_memory_gb": _peak_memory_gb(device),
        "num_steps": result.scheduler.step_log.num_steps,
        **kv_tier_summary([result.scheduler.block_manager.kv_tier_counters()]),
        "num_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "warmup_s": warmup_s,
    }
    title = (
        f"rose-run: {result.policy} | {workload_name} | {args.model} on {device} ({extra['dtype']})"
    )
    report(args, records, duration_s=result.duration_s, title=title, extra=extra)


def _warm_up(runner: ModelRunner, config) -> float:
    """Run the largest step shapes before the clock starts; returns the seconds spent."""
    start = time.perf_counter()
    warm_up(runner, config)
    return time.perf_counter() - start


def _vocab(config) -> int:
    return int(config.vocab_size)


def _replay(engine: Engine, requests: list, *, show: bool) -> RunResult:
    with tqdm(
        total=len(requests), desc="requests", unit="req", disable=not show, file=sys.stderr
    ) as bar:
        return engine.run(requests, progress=bar.update)


def build_runner(
    args: argparse.Namespace,
    registry: Registry,
    model: torch.nn.Module,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[SchedulerConfig, ModelRunner]:
    """The scheduler config (KV pool sized from memory unless a flag sets it,
    checked against the device's memory first) and a model runner over that
    pool, for ``rose-run`` and ``rose-serve``.

    Raises:
        CliError: on a contradictory flag or a pool that does not fit in memory.
    """
    max_model_len = _max_model_len(args, model)
    max_seqs_blocks = scheduler_knobs(args)["max_num_seqs"] * -(-max_model_len // args.block_size)
    kv_bytes = _kv_bytes_per_token(config, dtype)
    sched_config = scheduler_config(
        args,
        registry,
        num_kv_blocks=default_num_kv_blocks(args, kv_bytes, device, max_seqs_blocks),
        max_model_len=max_model_len,
        kv_bytes_per_token=kv_bytes,
    )
    check_pool_fits(sched_config.num_kv_blocks, kv_bytes * sched_config.block_size, device)
    tiers = sched_config.kv_tiers
    if tiers is not None:
        if len(tiers.tiers) > 1:
            raise CliError(
                f"the executor implements one host KV tier, got {len(tiers.tiers)} "
                "(--kv-offloading-size or one --kv-tier); simulate more with rose-sim"
            )
        need = tiers.tiers[0].num_blocks * tiers.block_bytes
        have = available_memory_bytes(torch.device("cpu"))
        if device.type == "cpu":  # the device pool took its share already
            have -= sched_config.num_kv_blocks * kv_bytes * sched_config.block_size
        if need > have:
            raise CliError(
                f"the host KV tier needs {need / 2**30:.3g} GiB but the host has "
                f"{max(have, 0) / 2**30:.3g} GiB available; lower --kv-offloading-size (or the "
                "--kv-tier capacity)"
            )
    runner = ModelRunner(
        model,
        num_kv_blocks=sched_config.num_kv_blocks,
        block_size=sched_config.block_size,
        device=device,
        dtype=dtype,
        attention_backend=args.attention_backend,
        num_tier_blocks=0 if tiers is None else tiers.tiers[0].num_blocks,
    )
    return sched_config, runner


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def main() -> int:
    """Entry point of ``rose-run`` (``rose-run profile ...`` profiles step times)."""
    if sys.argv[1:2] == ["profile"]:
        from roseinfer.executor.profiler import profile_main

        return profile_main(sys.argv[2:])
    return run_main("rose-run", build_parser(), _run, check_run_args)


if __name__ == "__main__":
    raise SystemExit(main())
