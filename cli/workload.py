"""From a run's workload flags to its requests (``rose-sim``, ``rose-run``, sweeps)."""

from __future__ import annotations

import argparse
from typing import Any

from roseinfer import workloads
from roseinfer.cli.config import check_workload_flags
from roseinfer.cli.flags import MAX_INT_FLAG, CliError, clip
from roseinfer.request import Request

DEFAULT_BURSTINESS = 1.0
"""``--burstiness`` when not given: Poisson arrivals, as vLLM bench."""


def build_workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    """The requests the flags describe, and a one-line description.

    Raises:
        CliError: on contradictory or invalid workload flags.
        workloads.WorkloadError: on a bad trace file.
    """
    check_workload_flags(args)
    if args.trace is not None:
        reqs = workloads.load_trace(args.trace, args.trace_format)
        name = str(args.trace)
    elif args.workload in (None, "azure-conv-sample"):
        reqs, name = workloads.load_default_trace(), workloads.DEFAULT_TRACE_NAME
    elif args.workload == "two-tenant":
        reqs, name = workloads.two_tenant(seed=args.seed), args.workload
    else:
        reqs, name = _synthetic(args), args.workload
    reqs = workloads.select(
        reqs, num_requests=args.num_requests, start_s=args.start_s, end_s=args.end_s
    )
    if args.request_rate is not None:
        burstiness = burstiness_of(args)
        reqs = workloads.rescale_arrivals(
            reqs, request_rate=args.request_rate, burstiness=burstiness, seed=args.seed
        )
        name += f" @ {args.request_rate} req/s (burstiness {burstiness})"
    if not reqs:
        raise CliError("the workload selection is empty; check --num-requests/--start-s/--end-s")
    return reqs, name


def burstiness_of(args: argparse.Namespace) -> float:
    """``--burstiness``, or :data:`DEFAULT_BURSTINESS` when not given."""
    value = getattr(args, "burstiness", None)
    return DEFAULT_BURSTINESS if value is None else float(value)


def fit_workload(
    args: argparse.Namespace, requests: list[Request], max_model_len: int, default: str
) -> tuple[list[Request], str]:
    """Apply ``--fit-lengths`` (``default`` when not given) to ``requests``.

    Both backends fit a workload with this one rule, so the same flags replay
    the same requests in rose-sim and rose-run.

    Returns:
        The requests and a note for the result file (``fit_lengths``).
    """
    return workloads.fit_lengths(requests, max_model_len, mode=args.fit_lengths or default)


def _synthetic(args: argparse.Namespace) -> list[Request]:
    overrides: dict[str, Any] = {"seed": args.seed}
    for dest, key in (
        ("prompt_tokens", "prompt_tokens"),
        ("output_tokens", "output_tokens"),
        ("unique_prompts", "unique_prompts"),
        ("num_requests", "num_requests"),
    ):
        if getattr(args, dest) is not None:
            overrides[key] = getattr(args, dest)
    if args.prompt_repeats is not None:
        overrides["prompt_repeats"] = _parse_repeats(args.prompt_repeats)
    if args.submit_interval_ms is not None:
        overrides["submit_interval_s"] = args.submit_interval_ms / 1e3
    if args.workload == "synthetic":
        return workloads.synthetic(**{"num_requests": 32, "output_tokens": 32, **overrides})
    return workloads.seed_workload(args.workload.removeprefix("seed-"), **overrides)


def _parse_repeats(text: str) -> list[int]:
    try:
        repeats = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(
            f"--prompt-repeats must be comma-separated integers, got {clip(text)!r}"
        ) from None
    if not repeats or min(repeats) <= 0 or max(repeats) > MAX_INT_FLAG:
        raise CliError(f"--prompt-repeats needs positive integers, got {clip(text)!r}")
    return repeats
