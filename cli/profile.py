"""``rose-run profile``: time the executor's real steps over a grid of batch shapes
and fit a cost model for ``rose-sim --cost-model PROFILE.json``.

The grid, the timing and the fit are :mod:`roseinfer.executor.profiler`; the
model and its KV pool are built as ``rose-run`` builds them
(:mod:`roseinfer.executor.builder`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from roseinfer.cli.config import check_output_paths, check_pool_flags
from roseinfer.cli.executor_flags import (
    add_model_args,
    check_device_name,
    load,
    pool_choice,
    prepare_torch,
    require_extra,
    runner_choice,
)
from roseinfer.cli.flags import (
    POSITIVE,
    ArgumentParser,
    CliError,
    add_flag,
    add_quiet_args,
    friendly_errors,
    int_in,
    say_to,
)
from roseinfer.config import DEFAULT_MAX_NUM_SEQS, SchedulerConfig

if TYPE_CHECKING:
    from roseinfer.calibration import Profile

PROG = "rose-run profile"
DEFAULT_PROFILE_TOKENS = 2048
"""Default per-step token limit of the grid: vLLM's ``max_num_batched_tokens`` for
chunked prefill (or the model's context if longer)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``rose-run profile`` argument parser."""
    parser = ArgumentParser(
        prog=PROG,
        description="Time the executor's real steps over a grid of batch shapes and fit a "
        "cost model for `rose-sim --cost-model PROFILE.json`.",
    )
    parser.add_argument("--output", type=Path, required=True, help="PROFILE.json to write")
    g = parser.add_argument_group("executor (as rose-run)")
    add_model_args(g, warmup=False)
    add_flag(g, "--seed")
    g.add_argument("--repetitions", type=POSITIVE, help="timed runs per shape; the median "
                   "is kept (default: the profiler's, 3)")  # fmt: skip
    g.add_argument("--served-requests", type=int_in(0), metavar="N",
                   help="after the grid, serve N requests (all at t=0, log-normal lengths with "
                   "medians of a quarter and a 32nd of --max-model-len, at most 1024 and 128; "
                   "fifo at --max-num-batched-tokens) and fit their "
                   "logged steps with the grid's: the shapes and timing of a real run "
                   "(default: 2 x --max-num-seqs on CUDA, 0 on CPU, where a run's "
                   "--save-steps log calibrates as well)")  # fmt: skip
    g = parser.add_argument_group("limits (as rose-run; they set the grid and the KV pool)")
    add_flag(g, "--max-num-batched-tokens", help="most tokens per step (on CUDA one pass of "
             "the runner, which the memory planner profiles; default: max(--max-model-len, "
             f"{DEFAULT_PROFILE_TOKENS}))")  # fmt: skip
    add_flag(g, "--max-num-seqs", default=DEFAULT_MAX_NUM_SEQS)
    add_flag(g, "--max-model-len")
    for flag in ("--block-size", "--num-kv-blocks", "--kv-cache-memory-gb"):
        add_flag(g, flag)
    add_quiet_args(parser, summary=False)
    return parser


def profile_main(argv: Sequence[str]) -> int:
    """Entry point of ``rose-run profile`` (flags after ``profile``)."""
    args = build_parser().parse_args(list(argv))
    with friendly_errors(PROG):
        check_pool_flags(args)
        check_device_name(args.device)
        check_output_paths(args, ("output",))
        require_extra(PROG, "executor", ("torch", "transformers"))
        profile = _profile(args)
        profile.save(args.output)
        print(summary_lines(profile, args.output))
    return 0


def _profile(args: argparse.Namespace) -> Profile:
    prepare_torch()
    from roseinfer.executor import builder
    from roseinfer.executor.profiler import run_profile

    say = say_to(PROG, args.quiet)
    loaded = load(args, say)
    max_model_len = builder.resolve_max_model_len(args.max_model_len, loaded)
    tokens = args.max_num_batched_tokens or max(max_model_len, DEFAULT_PROFILE_TOKENS)
    cap = builder.max_useful_blocks(args.max_num_seqs, max_model_len, args.block_size)
    size = builder.size_kv_pool(pool_choice(args), loaded, cap)
    try:
        # NOTE: on CUDA the grid's largest step is one pass of the runner (and the
        # memory planner's profile pass), as in a rose-run with this token budget
        config = SchedulerConfig(
            num_kv_blocks=size.num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=tokens, enable_chunked_prefill=True,
        )  # fmt: skip
    except ValueError as err:
        raise CliError(str(err)) from None
    built = builder.build_runner(loaded, config, size, runner_choice(args), say)
    served = args.served_requests
    if served is None:
        served = 2 * args.max_num_seqs if built.runner.device.type == "cuda" else 0
    # NOTE: the budget before rose-run's cap is recorded, so rose-sim sizes another
    # model's pool from the same memory.
    return run_profile(
        built.runner, built.config, model_name=args.model, model_spec=loaded.spec,
        hf_config=loaded.hf_config, max_num_batched_tokens=tokens, seed=args.seed,
        show_progress=not args.quiet, kv_cache_budget_bytes=built.pool.budget_bytes,
        served_requests=served,
        **({} if args.repetitions is None else {"repetitions": args.repetitions}),
    )  # fmt: skip


def summary_lines(profile: Profile, path: Path) -> str:
    """What ``rose-run profile`` prints: samples, fit choice, held-out errors, roofline."""
    fit, roof = profile.step_fit, profile.roofline
    served = profile.extra.get("served") or {}
    steps = served.get("num_steps", 0)
    lines = [
        f"profiled {profile.label}: {len(profile.samples) - steps} step shapes"
        + (f" and {steps} steps of {served['num_requests']} served requests" if steps else "")
        + f" in {profile.extra.get('profile_wall_s', float('nan')):.0f} s -> {path}",
        "held-out relative error (median / p90 / max):",
    ]
    for name, err in fit.held_out.items():
        mark = " <- chosen" if name == fit.model.name else ""
        lines.append(f"  {name:8s} {err.median:6.1%} / {err.p90:6.1%} / {err.max:6.1%}{mark}")
    for group, err in fit.held_out_groups.items():
        lines.append(
            f"    {group:6s} {err.median:6.1%} / {err.p90:6.1%} / {err.max:6.1%}  "
            f"(the chosen fit on {err.num_samples} held-out {group} steps)"
        )
    if roof is None:  # a profile always has a model shape; a pooled calibration may not
        return "\n".join(lines)
    dev, err = roof.device, roof.held_out
    lines.append(
        f"  roofline {err.median:6.1%} / {err.p90:6.1%} / {err.max:6.1%}  "
        f"(calibrated: {roof.combine} of {dev.achievable_flops / 1e9:.3g} GFLOP/s and "
        f"{dev.achievable_bandwidth / 1e9:.3g} GB/s, overhead {dev.overhead_s * 1e3:.2f} ms)"
    )
    return "\n".join(lines)
