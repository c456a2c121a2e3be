"""The host work of a decode step: what rose-run does on the CPU before a CUDA graph replays.

On a GPU a decode step replays one CUDA graph, so the step's wall time is the host
work that comes before the replay plus the graph's GPU time: the host work is not
hidden behind anything. On one H100 that host part was 0.6 ms at 1 sequence and
2.4 ms at 256 (9-11% of the step; ``gpu_throughput.py``'s step table), which is
the margin by which decodes missed 1.3x their floor. This benchmark times that
host work alone, on any machine: ``rose-run``'s engine (scheduler, runner inputs,
the runner's checks, the input batch, the static buffers of the CUDA-graph path,
sampling) over the Triton backend's graph path, with the model's body and LM head
replaced by stubs that return zeros, so no model is computed (Triton's
interpreter on a CPU only builds metadata). A decode batch of B sequences at
contexts of about 1,024 tokens (64 blocks of 16) takes a decode step per
measured step; the Engine's own step timing splits it into planning (the
scheduler), inputs (building ``SeqInput`` s), the runner's forward (checks, input
batch, static-buffer loads) and the rest (sampling, applying the result).

``--baseline-python`` runs the same measurement with another checkout's python
(its installed roseinfer) in the same run, alternating, and prints the ratios.
``--balanced`` adds a side of this checkout with the Triton backend's balanced
key splits on for every unsplit decode launch (the warm-up's choice on a GPU
that keeps them; the interpreter tunes nothing), so the host cost of building
the work list is timed against the plain side; ``--skew 4`` makes the first
request's prompt 4x longer, so the work list splits it.

    python benchmarks/decode_host.py                       # B = 1, 32, 64, 128, 256
    python benchmarks/decode_host.py --baseline-python ../base/.venv/bin/python
"""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:  # before anything imports triton: CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PROMPT_TOKENS = 1000
BLOCK_SIZE = 16
MAX_NUM_SEQS = 256  # the capture sizes of a default run


def measure(
    batch: int, steps: int, warmup: int, balanced: bool = False, skew: int = 1
) -> dict[str, float]:
    """Median milliseconds of each host part of a decode step at ``batch`` sequences
    (``balanced``: balanced key splits on; ``skew``: the first prompt that many
    times longer)."""
    import numpy as np
    import torch

    from roseinfer.config import SchedulerConfig
    from roseinfer.executor.builder import RunnerChoice, new_runner
    from roseinfer.executor.engine import Engine
    from roseinfer.executor.graph_runner import capture_sizes
    from roseinfer.executor.models import build_model
    from roseinfer.request import Request

    model, cfg, _ = build_model("tiny-llama", seed=0, dtype=torch.float32, device="cpu")
    output_tokens = warmup + steps + 4
    per_seq = -(-(PROMPT_TOKENS + output_tokens) // BLOCK_SIZE) + 1
    config = SchedulerConfig(
        num_kv_blocks=(batch + skew - 1) * per_seq, block_size=BLOCK_SIZE,
        max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=False, max_model_len=2048 * skew,
    )  # fmt: skip
    runner = new_runner(model, config, device="cpu", dtype=torch.float32,
                        choice=RunnerChoice("triton"))  # fmt: skip
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    runner._body = lambda b, meta: torch.zeros(b.num_tokens, hidden)  # type: ignore[method-assign]
    runner.adapter.logits = lambda h: torch.zeros(h.shape[0], vocab)  # type: ignore[method-assign]
    if balanced:
        backend = runner.backend
        for size in capture_sizes(MAX_NUM_SEQS):
            key = (backend.block_q(1), backend.num_splits(size, 1))
            if key[1] == 1:
                backend.balanced.add(key)
    runner.capture_cuda_graphs(MAX_NUM_SEQS, config.max_model_len)
    engine = Engine(runner, config, seed=0, record_timings=True)
    rng = np.random.default_rng(0)
    for i in range(batch):
        length = PROMPT_TOKENS * (skew if i == 0 else 1)
        prompt = tuple(rng.integers(1, vocab, length).tolist())
        engine.add_request(Request(f"r{i}", 0.0, length, output_tokens, prompt))
    while engine.scheduler.waiting:  # the prefills
        engine.step()
    parts: dict[str, list[float]] = {"plan": [], "inputs": [], "forward": [], "rest": []}
    runner.host_times_s = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        out, _ = engine.step()
        wall = time.perf_counter() - start
        if len(out.decodes) != batch or out.prefills:
            raise RuntimeError(f"step {i} was not a decode of {batch}")
        t = engine.timings[-1]
        forward = runner.host_times_s[-1]
        if i >= warmup:
            parts["plan"].append(t.host_s)
            parts["inputs"].append(t.prepare_s)
            parts["forward"].append(forward)
            parts["rest"].append(wall - t.host_s - t.prepare_s - forward)
    out = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def run_in(python: str, batch: int, steps: int, warmup: int, *extra: object) -> dict[str, float]:
    """:func:`measure` in a fresh process of ``python`` (one torch thread: the host
    work is single-threaded Python and numpy); ``extra``: its further arguments."""
    if os.sep in python:  # a path: the child runs in benchmarks/, so not relative to it
        python = os.path.abspath(python)
    call = ", ".join(repr(a) for a in (batch, steps, warmup, *extra))
    code = (
        f"import json, sys, torch; torch.set_num_threads(1); "
        f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import decode_host; "
        f"print(json.dumps(decode_host.measure({call})))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd: not the checkout (its roseinfer/ would shadow the other side's install)
    done = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, check=False,
        cwd=Path(__file__).parent,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{python}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, measure each batch size (alternating with the baseline), print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,32,64,128,256")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per side")
    p.add_argument("--baseline-python", help="python of another checkout to compare with")
    p.add_argument("--balanced", action="store_true", help="add a side with balanced splits")
    p.add_argument("--skew", type=int, default=1, help="the first prompt this many times longer")
    args = p.parse_args(argv)
    if args.skew < 1:
        p.error(f"--skew must be >= 1, got {args.skew}")
    sides: dict[str, tuple[str, bool]] = {"this": (sys.executable, False)}
    if args.baseline_python:
        sides["baseline"] = (args.baseline_python, False)
    if args.balanced:
        sides["balanced"] = (sys.executable, True)
    print("decode host work per step (ms; median of steps, best of rounds), model stubbed")
    header = f"{'B':>4} {'side':<9}" + "".join(
        f"{k:>9}" for k in ("plan", "inputs", "forward", "rest", "total")
    )
    print(header)
    for batch in (int(b) for b in args.batch_sizes.split(",") if b):
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for side, (python, balanced) in sides.items():
                extra = (balanced, args.skew) if balanced or args.skew > 1 else ()
                got = run_in(python, batch, args.steps, args.warmup, *extra)
                if side not in best or got["total"] < best[side]["total"]:
                    best[side] = got
        for side, r in best.items():
            print(f"{batch:>4} {side:<9}" + "".join(f"{r[k]:9.3f}" for k in r))
        for side, base, label in (("this", "baseline", "this/base"),
                                  ("balanced", "this", "bal/this")):  # fmt: skip
            if side in best and base in best:
                b, r = best[base], best[side]
                ratios = "".join(f"{r[k] / b[k]:9.2f}" if b[k] > 0 else f"{'-':>9}" for k in r)
                print(f"{batch:>4} {label:<9}" + ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
