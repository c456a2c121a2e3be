"""Engine overhead: one decode iteration of the Engine vs bare model forwards.

What it measures: at decode batch B (default 8 and 32), the wall time of one
``Engine.step()`` (scheduler planning + building the runner inputs + model
forward + sampling + scheduler update) against a *bare* step that calls only
``ModelRunner.forward`` + ``ModelRunner.sample`` on prebuilt ``SeqInput`` s of
the very same batch (same tokens, positions, block tables and context
lengths; no scheduler). Overhead share = (engine - bare) / engine on the
median step times. The Engine's own ``StepTiming`` (``record_timings=True``)
splits its step into schedule (``host_s``: planning) / prepare / forward; update
is the rest of the step's wall time (applying the result, records); the
bookkeeping share is (schedule + prepare + update) / step. Target: <= 5% at B = 8 and 32.

How: B requests with short prompts (16 tokens) and long outputs are all
admitted in the first (prefill) step; after ``--warmup`` decode steps, each of
``--steps`` measured decode steps is run by the Engine, then at once by the
bare loop with inputs copied from the Engine's sequences (built outside the
timed region), so the two alternate step by step on the same machine state.
The bare step recomputes the Engine's step exactly and writes the same K/V
values into the same slots, so it disturbs nothing. Same model, same
``ModelRunner``, GPT-2 124M shapes with random weights, float32, CPU by
default, ``torch.set_num_threads(--threads)`` (default 2) for both sides.

    python benchmarks/overhead.py             # B = 8 and 32, 100 steps each (~1-2 min)
    python benchmarks/overhead.py --quick     # < 1 minute
    python benchmarks/overhead.py --batch-sizes 1,8,32,64 --steps 200
"""

from __future__ import annotations

import os

# Before torch loads libgomp: see _common.OMP_NOTE (spinning OpenMP workers on a shared CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import time
from array import array
from collections.abc import Sequence

import numpy as np
import torch
from _common import machine_line, set_threads, table

from roseinfer.config import SchedulerConfig
from roseinfer.executor.builder import new_runner
from roseinfer.executor.engine import Engine, StepTiming, synchronize
from roseinfer.executor.model_runner import SeqInput
from roseinfer.executor.models import build_model
from roseinfer.interface import Phase
from roseinfer.request import Request

BLOCK_SIZE = 16
PROMPT_TOKENS = 16


def make_requests(batch: int, output_tokens: int) -> list[Request]:
    rng = np.random.default_rng(0)
    return [
        Request(
            f"r{i}",
            0.0,
            PROMPT_TOKENS,
            output_tokens,
            tuple(rng.integers(0, 50257, size=PROMPT_TOKENS).tolist()),
        )
        for i in range(batch)
    ]


def measure(model, batch: int, steps: int, warmup: int, device: torch.device, dtype) -> dict:
    """Engine vs bare decode steps at one batch size; returns the figures."""
    output_tokens = warmup + steps + 4
    per_seq_blocks = -(-(PROMPT_TOKENS + output_tokens) // BLOCK_SIZE) + 1
    num_blocks = batch * per_seq_blocks
    config = SchedulerConfig(
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        max_model_len=1024,
    )
    runner = new_runner(model, config, device=device, dtype=dtype)
    engine = Engine(runner, config, seed=0, record_timings=True)
    for r in make_requests(batch, output_tokens):
        engine.add_request(r)
    out, _ = engine.step()
    assert out.phase is Phase.PREFILL and len(out.prefills) == batch, "all must prefill at once"
    bm = engine.scheduler.block_manager
    params = [s.request.sampling for s in engine.scheduler.running]
    gens = [engine.generator] * batch

    eng_s: list[float] = []
    bare_s: list[float] = []
    timings: list[StepTiming] = []
    for i in range(warmup + steps):
        running = list(engine.scheduler.running)
        snap = [(s, s.output_token_ids[-1], s.num_tokens - 1) for s in running]
        t0 = time.perf_counter()
        out, finished = engine.step()
        t1 = time.perf_counter()
        assert out.phase is Phase.DECODE and len(out.decodes) == batch and not finished
        # Same batch for the bare loop, prebuilt outside its timed region.
        # array('i') tables, as the engine passes them (a list costs a numpy read each)
        inputs = [SeqInput([tok], pos, array("i", bm.block_ids(s))) for s, tok, pos in snap]
        t2 = time.perf_counter()
        logits = runner.forward(inputs)
        runner.sample(logits, params, gens)
        synchronize(runner.device)
        t3 = time.perf_counter()
        if i >= warmup:
            eng_s.append(t1 - t0)
            bare_s.append(t3 - t2)
            timings.append(engine.timings[-1])
    ctx = engine.scheduler.running[0].num_tokens
    med_e, med_b = statistics.median(eng_s), statistics.median(bare_s)
    sched = statistics.median(t.host_s for t in timings)
    prep = statistics.median(t.prepare_s for t in timings)
    fwd = statistics.median(t.forward_s for t in timings)
    upd = statistics.median(
        max(0.0, e - t.host_s - t.prepare_s - t.forward_s) for e, t in zip(eng_s, timings)
    )
    book = [e - t.forward_s for e, t in zip(eng_s, timings)]
    tot = eng_s
    paired = [(e - b) / e for e, b in zip(eng_s, bare_s)]
    return {
        "batch": batch,
        "ctx": f"{PROMPT_TOKENS + warmup}-{ctx}",
        "engine_ms": med_e * 1e3,
        "bare_ms": med_b * 1e3,
        "overhead": (med_e - med_b) / med_e,
        "paired_overhead": statistics.median(paired),
        "sched_ms": sched * 1e3,
        "prep_ms": prep * 1e3,
        "fwd_ms": fwd * 1e3,
        "upd_ms": upd * 1e3,
        "book_share": sum(book) / sum(tot),
        "book_ms": statistics.median(book) * 1e3,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--batch-sizes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8, 32],
        help="comma-separated decode batch sizes",
    )
    parser.add_argument("--steps", type=int, default=100, help="measured decode steps per side")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps before measuring")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="20 steps, 2 warm-up (< 1 minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 20, 2

    set_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model, _cfg, _tok = build_model("gpt2", seed=0, dtype=dtype, device=device)
    print("overhead: Engine.step() vs bare ModelRunner.forward + sample, decode steps")
    print(machine_line(args.threads))
    print(
        f"model: gpt2 124M random weights, {args.dtype}, device {device}; workload: B requests "
        f"x {PROMPT_TOKENS}-token prompts, all admitted, {args.warmup} warm-up + {args.steps} "
        "measured decode steps, engine and bare alternating step by step"
    )
    rows = []
    for b in args.batch_sizes:
        m = measure(model, b, args.steps, args.warmup, device, dtype)
        target = "ok" if m["overhead"] <= 0.05 and m["book_share"] <= 0.05 else "OVER"
        rows.append(
            [
                m["batch"],
                m["ctx"],
                f"{m['engine_ms']:.2f}",
                f"{m['bare_ms']:.2f}",
                f"{m['overhead'] * 100:.1f}%",
                f"{m['paired_overhead'] * 100:.1f}%",
                f"{m['sched_ms']:.3f}",
                f"{m['prep_ms']:.3f}",
                f"{m['fwd_ms']:.2f}",
                f"{m['upd_ms']:.3f}",
                f"{m['book_ms']:.3f}",
                f"{m['book_share'] * 100:.2f}%",
                target,
            ]
        )
        print(f"  batch {b}: done", flush=True)
    print()
    print(
        table(
            [
                "batch",
                "context",
                "engine ms (med)",
                "bare ms (med)",
                "overhead",
                "paired ovh",
                "sched ms",
                "prep ms",
                "fwd ms",
                "upd ms",
                "bookkeep ms",
                "bookkeep share",
                "<=5%",
            ],
            rows,
        )
    )
    print(
        "\noverhead = (engine - bare) / engine of the median step times; paired ovh = median "
        "of the per-step (engine - bare) / engine. sched/prep/fwd: medians of the Engine's "
        "StepTiming (fwd includes sampling); upd: the rest of the engine step; bookkeep share = sum(sched + prep + upd) / "
        "sum(step) over the measured steps."
    )


if __name__ == "__main__":
    main()
