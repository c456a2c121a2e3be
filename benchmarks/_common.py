"""Shared helpers of the executor benchmarks (not a benchmark itself).

Workload building (a slice of the embedded Azure conv trace fitted to GPT-2's
context), the machine line every benchmark prints, and a plain-text table.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
from collections.abc import Sequence

import torch

from roseinfer import workloads
from roseinfer.request import Request
from roseinfer.workloads.fit import fit_lengths, with_token_ids

GPT2_CONTEXT = 1024
OMP_NOTE = """\
Each benchmark sets OMP_WAIT_POLICY=PASSIVE (unless the environment sets it) before
torch loads libgomp. With the default (active) policy, libgomp's idle worker keeps
spinning after every parallel region; on a 2-core machine shared with other
CPU-bound processes it then competes with the main thread, and small ops (layer
norm, tanh on a decode batch) took ~16 ms instead of ~0.09 ms here: a 5x slower
GPT-2 decode on the main thread. transformers' continuous batching runs its loop
in a non-main thread, which did not show the effect, so leaving the default
would have biased the comparison. Run with OMP_WAIT_POLICY=ACTIVE to see it."""
KV_BYTES_PER_TOKEN_GPT2_FP32 = 2 * 12 * 768 * 4  # K and V, 12 layers, 768 channels, float32


def machine_line(threads: int) -> str:
    """One line naming the machine, torch/transformers versions and torch threads."""
    import transformers

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"machine: {platform.machine()} nproc={os.cpu_count()} load1={load:.2f} | "
        f"python {platform.python_version()} | torch {torch.__version__} "
        f"(torch.set_num_threads({threads}); get_num_threads()={torch.get_num_threads()}) | "
        f"transformers {transformers.__version__} | "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}"
    )


def set_threads(threads: int) -> None:
    """Same intra-op thread count for every side of a comparison."""
    torch.set_num_threads(threads)


def trace_slice(
    num_requests: int,
    *,
    skip: int = 0,
    fit: str = "clip",
    max_model_len: int = GPT2_CONTEXT,
    arrivals_at_zero: bool = True,
    seed: int = 0,
) -> tuple[list[Request], str]:
    """The first ``num_requests`` requests (after ``skip``) of the embedded Azure conv
    trace, fitted to ``max_model_len`` (:func:`roseinfer.workloads.fit.fit_lengths`),
    with made-up token ids; all arriving at t=0 unless ``arrivals_at_zero`` is False.

    Returns:
        (requests, a one-line description of the workload).
    """
    reqs = workloads.select(workloads.load_default_trace(), num_requests=num_requests, skip=skip)
    reqs, fit_note = fit_lengths(reqs, max_model_len, mode=fit)
    if arrivals_at_zero:
        reqs = [dataclasses.replace(r, arrival_time_s=0.0) for r in reqs]
    reqs = with_token_ids(reqs, vocab_size=workloads.GPT2_VOCAB_SIZE, seed=seed)
    return reqs, describe(
        reqs, f"Azure conv 2023 (embedded) rows {skip}..{skip + len(reqs) - 1}; {fit_note}"
    )


def describe(reqs: Sequence[Request], name: str) -> str:
    """Workload name plus prompt/output length statistics."""
    p = [r.num_prompt_tokens for r in reqs]
    o = [r.max_output_tokens for r in reqs]
    span = reqs[-1].arrival_time_s - reqs[0].arrival_time_s if reqs else 0.0
    return (
        f"{name}\n  {len(reqs)} requests over {span:.2f} s | prompt tokens sum {sum(p)} "
        f"(mean {statistics.fmean(p):.0f}, max {max(p)}) | output tokens sum {sum(o)} "
        f"(mean {statistics.fmean(o):.0f}, min {min(o)}, max {max(o)})"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (floats as given, already formatted by the caller)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if n else c.ljust(w) for c, w in zip(row, widths)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def blocks_needed(reqs: Sequence[Request], block_size: int) -> int:
    """KV blocks that hold every request at full length at once (plus one spare each)."""
    return sum(-(-(r.num_prompt_tokens + r.max_output_tokens) // block_size) + 1 for r in reqs)
