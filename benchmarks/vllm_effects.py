"""Policy effects in vLLM, side by side with what rose-sim predicted.

vLLM's CPU build serves GPT-2 (124M shape, random weights, token-id prompts)
through ``--scheduler-cls roseinfer.integrations.vllm.Scheduler``; the requests
are a slice of the Azure LLM inference 2023 conv trace (prompts x0.25 clipped to
8..512, outputs x0.15 clipped to 2..64), every 11th request the ``light``
tenant's and the rest ``heavy``'s (a 10:1 load), 10% of them urgent (priority
0, the rest 1), replayed with Poisson arrivals at ``--load`` (0.9) of the
capacity calibrated on vLLM's own step logs (the next slice of the trace, fifo).
Each policy runs on the same requests, ``--rounds`` times in vLLM (the order
rotates each round; ratios are taken within a round) and once in rose-sim
(``--scheduler-preset vllm-v1 --cost-model <those step logs>``):

* vtc vs fifo: the light tenant's p99 TTFT;
* priority vs fifo: the urgent class's p99 TTFT;
* sjf (``--length-predictor oracle``) vs fifo: mean E2EL.

Each must move the same way (ratio < 1) in vLLM and in rose-sim. Writes
``OUTPUT.md`` and ``OUTPUT.json``; run it through ``../shared/tools/quiet``.

    python benchmarks/vllm_effects.py --output vllm-effects          # 6 min on 2 quiet cores
    python benchmarks/vllm_effects.py --load 1.3 --output vllm-effects-130   # the same past capacity
    python benchmarks/vllm_effects.py --model tiny-gpt2 --num-requests 22 --rounds 1 \\
        --enforce-eager                                             # a smoke run, ~25 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from roseinfer.integrations.vllm_lab import WorkloadSpec, effect_markdown, run_effects
from roseinfer.integrations.vllm_replay import EngineSettings


def build_parser() -> argparse.ArgumentParser:
    """Flags of the benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2-4l or tiny-gpt2 (random weights)")
    p.add_argument("--vllm-python", help="python of the vLLM venv (default: ROSEINFER_VLLM_PYTHON)")
    p.add_argument("--num-requests", type=int, default=66, help="requests replayed (6 light)")
    p.add_argument("--load", type=float, default=0.9, help="fraction of the calibrated capacity")
    p.add_argument("--rounds", type=int, default=3, help="vLLM runs of each policy")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=160, help="KV blocks of 32 tokens")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of vLLM")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("vllm-effects"),
                   help="writes OUTPUT.md, OUTPUT.json and OUTPUT/ (step logs)")  # fmt: skip
    return p


def main() -> int:
    """Entry point."""
    args = build_parser().parse_args()
    if args.rounds < 1 or args.num_requests < 12 or not args.load > 0:
        raise SystemExit(
            "vllm_effects: error: need --rounds >= 1, --num-requests >= 12, --load > 0"
        )
    settings = EngineSettings(
        model=args.model, max_model_len=1024, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        num_threads=args.threads, enforce_eager=args.enforce_eager, seed=args.seed,
    )  # fmt: skip
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    folder = args.output.with_suffix("")
    result = run_effects(
        settings, WorkloadSpec(num_requests=args.num_requests, seed=args.seed), load=args.load,
        rounds=args.rounds, folder=folder, python=args.vllm_python,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    md = [
        f"`{command}`", "",
        f"nproc={os.cpu_count()}; load average (1 min) {load_before:.2f} before, {load_after:.2f} "
        f"after; {result.wall_s:.0f} s wall. vLLM: {result.engine}.", "",
        f"Workload: {result.workload}; Poisson arrivals at {args.load:.0%} of "
        f"{result.calibration.capacity_req_s:.3f} req/s = {result.rate_req_s:.3f} req/s.", "",
        f"rose-sim's cost model: {result.calibration.describe}.", "",
        "Ratios are policy / fifo (< 1: the policy lowers the figure); vLLM's is the median over "
        f"{args.rounds} rounds, each pair run back to back, [min, max] over rounds.", "",
        effect_markdown(result.table), "",
    ]  # fmt: skip
    doc = {"command": command, "settings": settings.to_json(), "engine": result.engine,
           "workload": result.workload, "rate_req_s": result.rate_req_s,
           "capacity_req_s": result.calibration.capacity_req_s,
           "cost_model": result.calibration.describe, "load_average": [load_before, load_after],
           "wall_s": result.wall_s, "figures": result.figures,
           "table": result.table.to_dict(orient="records")}  # fmt: skip
    args.output.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    args.output.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
