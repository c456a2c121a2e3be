"""``rose-run``: replay a workload on a real model with the shared scheduler.

Takes the same workload, policy, scheduler and output flags as ``rose-sim``
and prints the same summary. Examples::

    rose-run --device cpu --model gpt2 --policy pack --prefill-max-tokens 256 \\
        --trace AzureLLMInferenceTrace_conv.csv --num-requests 64 --fit-lengths scale
    rose-run --device cuda --model /path/to/Llama-3.1-8B --policy budget --prefill-max-tokens 2048

Trace requests longer than ``--max-model-len`` are rejected on arrival, as vLLM
and rose-sim reject them, unless ``--fit-lengths`` fits them (``clip``: cut each
request to the context; ``scale``: shrink every prompt and output by one factor
so the longest fits); the result file says which.
``rose-run profile`` is :mod:`roseinfer.cli.profile`; ``rose-run save-model`` is
:mod:`roseinfer.cli.save_model`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from roseinfer.cli.config import check_args, config_facts, policy_facts
from roseinfer.cli.executor_flags import (
    EXECUTOR_HELP,
    add_model_args,
    build,
    check_device_name,
    require_extra,
    step_recorder,
)
from roseinfer.cli.flags import ArgumentParser, run_main, say_to, warn_to
from roseinfer.cli.groups import add_common_args
from roseinfer.cli.report import report
from roseinfer.cli.workload import build_workload
from roseinfer.interface import PolicyOptions
from roseinfer.registry import Registry
from roseinfer.request import Request

if TYPE_CHECKING:
    import torch

    from roseinfer.config import SchedulerConfig
    from roseinfer.executor.engine import Engine, RunResult

PROG = "rose-run"
LONG_REPLAY_S = 3600.0
"""A trace spanning more wall time than this (s) gets a warning before the model loads."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rose-run`` argument parser."""
    parser = ArgumentParser(
        prog=PROG,
        description="Run an LLM-serving scheduling policy for real: the shared scheduler "
        "drives a PyTorch model with a paged KV cache (default: the embedded Azure conv "
        "trace sample on GPT-2 with random weights).",
        epilog="subcommands (each has its own --help): `rose-run profile --output PROFILE.json "
        "...` times the executor's steps over a grid of batch shapes and fits a cost model for "
        "`rose-sim --cost-model PROFILE.json`; `rose-run save-model --model NAME --output DIR` "
        "writes a built-in model's random weights and its synthetic tokenizer to a directory "
        "(for vLLM or transformers).",
    )
    add_common_args(parser)
    g = parser.add_argument_group("executor", EXECUTOR_HELP)
    add_model_args(g)
    g.add_argument(
        "--save-token-ids",
        action="store_true",
        help="add prompt and output token ids to --save-records",
    )
    parser.set_defaults(prefix_caching_hash_algo="sha256")  # real prompts: collision-resistant
    return parser


def check_run_args(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """Every ``rose-run`` check that needs no model, workload or torch.

    Raises:
        CliError: naming the flag and the fix.
    """
    options = check_args(args, registry)
    check_device_name(args.device)
    require_extra(PROG, "executor", ("torch", "transformers"))
    return options


def warn_long_replay(requests: list[Request], warn: Callable[[str], None]) -> None:
    """A real run waits for each arrival in wall time: warn before the model loads
    when the trace spans more than :data:`LONG_REPLAY_S`."""
    span = max(r.arrival_time_s for r in requests) - min(r.arrival_time_s for r in requests)
    if span > LONG_REPLAY_S:
        warn(
            f"the requests arrive over {span:,.0f} s ({span / 3600:,.1f} h) and rose-run waits "
            "for each in real time; re-draw arrivals with --request-rate, or keep a window "
            "with --start-s/--end-s (or --num-requests)"
        )


def _run(args: argparse.Namespace, registry: Registry, options: PolicyOptions) -> None:
    requests, workload_name = build_workload(args)
    warn_long_replay(requests, warn_to(PROG))
    built = build(args, registry, options, say_to(PROG, args.quiet))
    from roseinfer.executor.builder import fit_requests, runner_facts
    from roseinfer.executor.engine import Engine

    loaded, config, runner = built.loaded, built.config, built.runner
    requests, fit_note, vocab_note = fit_requests(
        requests, config.max_model_len, loaded.vocab_size, args.fit_lengths or "off", args.seed
    )
    recorder = step_recorder(args, built, PROG, args.fit_lengths or "off")
    engine = Engine(runner, config, registry, seed=args.seed, on_step=recorder)
    try:
        result = _replay(engine, requests, show=not args.quiet)
    finally:
        if recorder is not None and recorder.writer is not None:
            recorder.writer.close()
    records = result.records
    if not args.save_token_ids:
        records = records.drop(columns=["prompt_token_ids", "output_token_ids"])
    dtype = str(loaded.dtype).removeprefix("torch.")
    extra = {
        "backend": "executor", "policy": result.policy, "workload": workload_name,
        "model": args.model, "device": str(loaded.device), "dtype": dtype,
        "fit_lengths": fit_note, "token_ids": vocab_note,
        "scheduler_preset": args.scheduler_preset or "seeds", **config_facts(config),
        **policy_facts(config, registry), **runner_facts(runner, built.pool),
        **_run_facts(result, config, loaded.device, built.warmup_s),
    }  # fmt: skip
    warn_stalls(extra, warn_to(PROG))
    title = f"{PROG}: {result.policy} | {workload_name} | {args.model} on {loaded.device} ({dtype})"
    report(args, records, duration_s=result.duration_s, title=title, extra=extra)


def _run_facts(
    result: RunResult, config: SchedulerConfig, device: torch.device, warmup_s: float
) -> dict[str, Any]:
    """What the run measured beyond the records: pool peak, memory, steps, threads,
    the collector's pauses and the CUDA allocator's retries (the causes of a stalled step)."""
    import torch  # noqa: F811 - loaded by now

    from roseinfer.executor.builder import allocator_retries, peak_memory_gb
    from roseinfer.kv_tiers import kv_tier_summary

    return {
        "kv_pool_peak_utilization": result.scheduler.max_used_blocks / config.num_kv_blocks,
        "peak_memory_gb": peak_memory_gb(device),
        "num_steps": result.scheduler.step_log.num_steps,
        **kv_tier_summary([result.scheduler.block_manager.kv_tier_counters()]),
        "num_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "warmup_s": warmup_s,
        **result.gc.facts(),
        "cuda_alloc_retries": allocator_retries(device),
    }


GC_PAUSE_WARN_S = 0.05  # a pause this long moves a step's time past its noise


def warn_stalls(facts: dict[str, Any], warn: Callable[[str], None]) -> None:
    """Say when something outside the model stalled steps of the run: a garbage
    collection of at least :data:`GC_PAUSE_WARN_S`, or CUDA allocator retries."""
    if facts["gc_pause_max_s"] >= GC_PAUSE_WARN_S:
        warn(
            f"a garbage collection paused the run for {facts['gc_pause_max_s'] * 1e3:.0f} ms "
            f"({facts['gc_full_collections']} full collections, "
            f"{facts['gc_pause_s'] * 1e3:.0f} ms in all); the steps it fell in are that much longer"
        )
    if facts["cuda_alloc_retries"]:
        warn(
            f"the CUDA allocator retried {facts['cuda_alloc_retries']} allocations after freeing "
            "its cache, which stalls a step each time; lower --gpu-memory-utilization"
        )


def _replay(engine: Engine, requests: list[Request], *, show: bool) -> RunResult:
    from tqdm import tqdm

    with tqdm(
        total=len(requests), desc="requests", unit="req", disable=not show, file=sys.stderr
    ) as bar:
        return engine.run(requests, progress=bar.update)


def main() -> int:
    """Entry point of ``rose-run`` (``rose-run profile ...`` profiles step times,
    ``rose-run save-model ...`` writes a built-in model to a directory)."""
    if sys.argv[1:2] == ["profile"]:
        from roseinfer.cli.profile import profile_main

        return profile_main(sys.argv[2:])
    if sys.argv[1:2] == ["save-model"]:
        from roseinfer.cli.save_model import save_model_main

        return save_model_main(sys.argv[2:])
    return run_main(PROG, build_parser(), check_run_args, _run)


if __name__ == "__main__":
    raise SystemExit(main())
