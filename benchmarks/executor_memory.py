"""Executor memory: peak process/device memory and KV pool utilisation on a trace.

What it measures, for one replay of an Azure conv trace slice through the
Engine (shared scheduler, FIFO, prefill-first, prefix caching on):

* peak memory: on CPU the process's peak RSS (``ru_maxrss``), also read after
  the model is built and after the KV pool is allocated, so the table shows
  what the weights, the pool and the run's activations add; on CUDA
  ``torch.cuda.max_memory_allocated`` (peak of tensors), with the same split.
* KV pool: its bytes (``ModelRunner.kv_cache_bytes``), its blocks, the peak
  blocks in use (``scheduler.max_used_blocks``) and utilisation =
  ``max_used_blocks / num_kv_blocks``; preemptions show whether it bound.
* the run itself: duration, finished requests, output tokens/s, p50/p99 TTFT.

Workload: the first ``--num-requests`` rows of the embedded Azure conv 2023
trace, lengths fitted to GPT-2's 1024-token context (``--fit``), arrivals
either the trace's own times multiplied by ``--time-scale`` or re-drawn at
``--request-rate`` req/s (Poisson); the pool is ``--kv-cache-gb`` GiB (rose-run's
CPU default is 1 GiB) or ``--num-kv-blocks`` blocks. GPT-2 124M shapes with
random weights; float32 on CPU, bfloat16 on CUDA unless ``--dtype``.

Note: the KV pool is ``torch.zeros``; on Linux a large zeroed allocation is
mapped lazily, so RSS grows only as blocks are first written, and the RSS
after allocation understates the pool. The ``kv pool bytes`` row is the
reserved size.

    python benchmarks/executor_memory.py                    # CPU, a few minutes
    python benchmarks/executor_memory.py --quick            # < 1 minute
    python benchmarks/executor_memory.py --device cuda --num-requests 512 --time-scale 0.1
"""

from __future__ import annotations

import os

# Before torch loads libgomp: see _common.OMP_NOTE (spinning OpenMP workers on a shared CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import resource
import time
from collections.abc import Sequence

import torch
from _common import GPT2_CONTEXT, describe, machine_line, set_threads, table, trace_slice

from roseinfer import workloads
from roseinfer.calibration.specs import ModelSpec
from roseinfer.config import SchedulerConfig, kv_blocks_from_bytes
from roseinfer.executor.builder import new_runner
from roseinfer.executor.engine import Engine
from roseinfer.executor.models import build_model
from roseinfer.metrics.summary import summarize

BLOCK_SIZE = 16
MIB = 2**20


def rss_peak_bytes() -> int:
    """Peak resident set of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now_bytes() -> int:
    """Current resident set (from /proc; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return rss_peak_bytes()


class Meter:
    """Memory readings on one device: current and peak, in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else rss_now_bytes()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else rss_peak_bytes()

    @property
    def name(self) -> str:
        return "torch.cuda.max_memory_allocated" if self.cuda else "ru_maxrss (peak RSS)"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64, help="trace requests")
    parser.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    parser.add_argument(
        "--fit", choices=["clip", "scale"], default="scale", help="fit_lengths mode"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=GPT2_CONTEXT, help="fit requests to this many tokens"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply the trace's arrival times (0.5 = twice as fast)",
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="instead: Poisson arrivals at this rate (req/s; inf = all at t=0)",
    )
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size (GiB)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool in blocks")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--prefill-max-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 requests scaled to 256 tokens, arrivals x0.25 (< 1 minute)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_model_len, args.time_scale = 16, 256, 0.25

    set_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    meter = Meter(device)
    if meter.cuda:
        torch.cuda.reset_peak_memory_stats(device)

    reqs, desc = trace_slice(
        args.num_requests,
        skip=args.skip,
        fit=args.fit,
        max_model_len=args.max_model_len,
        arrivals_at_zero=False,
    )
    if args.request_rate is not None:
        reqs = workloads.rescale_arrivals(reqs, request_rate=args.request_rate, seed=0)
        arrivals = f"Poisson at {args.request_rate} req/s"
    else:
        reqs = workloads.time_scale(reqs, args.time_scale)
        arrivals = f"trace arrival times x {args.time_scale}"
    desc = describe(reqs, desc.splitlines()[0] + f"; {arrivals}")

    base = meter.now()
    model, config, _tok = build_model("gpt2", seed=0, dtype=dtype, device=device)
    after_model = meter.now()
    spec = ModelSpec.from_hf_config(config, dtype_bytes=torch.finfo(dtype).bits // 8)
    kv_bytes_per_token = spec.kv_bytes_per_token
    num_blocks = args.num_kv_blocks or kv_blocks_from_bytes(
        args.kv_cache_gb * 2**30, kv_bytes_per_token, BLOCK_SIZE
    )
    sched = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=args.max_num_seqs,
        prefill_max_tokens=args.prefill_max_tokens,
        max_model_len=args.max_model_len,
    )
    runner = new_runner(model, sched, device=device, dtype=dtype)
    after_pool = meter.now()
    engine = Engine(runner, sched, seed=0)
    t0 = time.perf_counter()
    result = engine.run(reqs)
    wall = time.perf_counter() - t0
    peak = meter.peak()
    after_run = meter.now()

    s = result.scheduler
    summ = summarize(result.records, duration_s=result.duration_s)
    print("executor_memory: peak memory and KV pool utilisation of one Engine replay")
    print(machine_line(args.threads))
    print(
        f"model: gpt2 124M random weights, {str(dtype).removeprefix('torch.')}, device {device}, "
        f"attention {runner.attention_backend}; policy fifo, prefill-first, prefix caching on, "
        f"max_num_seqs {args.max_num_seqs}, prefill_max_tokens {args.prefill_max_tokens}"
    )
    print(f"workload: {desc}\n")
    mib = lambda b: f"{b / MIB:,.1f}"  # noqa: E731
    pool_tokens = num_blocks * BLOCK_SIZE
    rows = [
        ["memory meter", meter.name],
        ["at start (MiB)", mib(base)],
        ["after model build (MiB)", mib(after_model)],
        ["after KV pool alloc (MiB)", mib(after_pool)],
        ["after run (MiB)", mib(after_run)],
        ["PEAK (MiB)", mib(peak)],
        ["peak - after pool alloc (MiB)", mib(peak - after_pool)],
        ["model weights (MiB)", mib(sum(p.numel() * p.element_size() for p in model.parameters()))],
        ["kv pool bytes (MiB)", mib(runner.kv_cache_bytes)],
        ["kv bytes per token", f"{kv_bytes_per_token:,}"],
        ["kv pool blocks x block size", f"{num_blocks} x {BLOCK_SIZE} = {pool_tokens:,} tokens"],
        ["peak used blocks", s.max_used_blocks],
        ["KV POOL PEAK UTILISATION", f"{s.max_used_blocks / num_blocks:.1%}"],
        ["peak used KV (MiB)", mib(s.max_used_blocks * BLOCK_SIZE * kv_bytes_per_token)],
        ["preemptions", s.num_preemptions],
        ["steps", len(s.step_end_s)],
        ["finished / requests", f"{summ['completed']} / {summ['num_requests']}"],
        ["run wall (s)", f"{wall:.1f}"],
        ["output tok/s", f"{summ['output_throughput']:.1f}"],
        ["TTFT p50 / p99 (ms)", f"{summ['median_ttft_ms']:.0f} / {summ['p99_ttft_ms']:.0f}"],
    ]
    print(table(["figure", "value"], rows))


if __name__ == "__main__":
    main()
