"""What the roseinfer scheduler class costs inside vLLM (against its overhead targets).

1. Throughput on W2-32 (32 requests at t=0, prompts 992, 4, 4, 4 tokens repeated,
   32 output tokens each; GPT-2 124M shape, random weights, float32, vLLM's CPU
   build, ``OMP_NUM_THREADS=2``): vLLM with ``--scheduler-cls
   roseinfer.integrations.vllm.Scheduler`` running ``fifo`` against vLLM's
   default scheduler, two engines loaded side by side and run alternately
   (ABBA order), ``--rounds`` times; output tok/s = output tokens / (last token
   - first arrival). Target: plugin / default >= 0.97 (median of the per-round
   ratios; the spread is their min..max).
2. The policy's time per step with >= 256 requests waiting: 400 short requests
   at t=0 through a tiny GPT-2 (8 seats, so the queue stays long for hundreds of
   steps); per step the wall time of the class's own work (the policy driver's
   ``before_schedule``, ``note_step`` and ``after_update``: the policy's calls,
   the checks of its answer, the gate, the step log's bookkeeping; timer
   included), over every such step and over those that admitted a request (the
   policy's ``admit`` ran and its answer was checked; in the others every seat
   was taken), and the whole ``schedule()`` + ``update_from_output()`` of the
   class and of vLLM's default scheduler on the same requests. Target: <= 100 us
   (fifo). Other policies are shown for reference.

Run it through ``../shared/tools/quiet``: ``python benchmarks/vllm_overhead.py``
(the README's figures: ``--rounds 4 --step-rounds 2 --policies fifo sjf vtc pack``,
4.5 minutes on 2 quiet cores; ``--rounds 1 --policies fifo`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from roseinfer import workloads
from roseinfer.integrations.vllm_replay import EngineSettings, VllmReplay, vocab_size
from roseinfer.request import Request

W2_PROMPTS = (992, 4, 4, 4)
POLICIES = {
    "fifo": "--policy fifo",
    "sjf": "--policy sjf --length-predictor oracle",
    "priority": "--policy priority",
    "vtc": "--policy vtc",
    "pack": "--policy pack --prefill-max-tokens 256 --force-fifo-every 8",
}
"""ROSEINFER_POLICY_ARGS timed per step (``fifo`` is the target's)."""
MIN_WAITING = 256


def w2_32() -> list[Request]:
    """W2-32 (``benchmarks/executor_vs_hf.py``'s): 32 requests at t=0, prompts 992, 4,
    4, 4 tokens repeated, 32 output tokens, made-up token ids (no shared prefix)."""
    reqs = [Request(f"w2-{i}", 0.0, W2_PROMPTS[i % 4], 32, None) for i in range(32)]
    return workloads.with_token_ids(reqs, vocab_size=vocab_size("gpt2"), seed=0)


def long_queue(num: int = 400) -> list[Request]:
    """``num`` requests at t=0 of 8..23 prompt tokens and 16 output tokens, two
    tenants, two priority classes (so vtc and priority have work)."""
    reqs = [Request(f"q-{i}", 0.0, 8 + i % 16, 16, None, tenant="ab"[i % 2], priority=i % 2)
            for i in range(num)]  # fmt: skip
    return workloads.with_token_ids(reqs, vocab_size=vocab_size("tiny-gpt2"), seed=0)


def throughput(run: Any) -> float:
    """Output tokens per second of one run."""
    return float(run.records["num_output_tokens"].sum() / run.duration_s)


def throughput_rounds(args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: plugin (fifo) and default engines alternately, ABBA."""
    base = EngineSettings(model="gpt2", max_model_len=1024, max_num_seqs=32,
                          max_num_batched_tokens=4096, num_kv_blocks=320,
                          num_threads=args.threads)  # fmt: skip
    reqs = w2_32()
    tok_s: dict[str, list[float]] = {"plugin": [], "default": []}
    with VllmReplay(base, python=args.vllm_python) as plugin, \
            VllmReplay(EngineSettings(**{**base.to_json(), "roseinfer": False}),
                       python=args.vllm_python) as default:  # fmt: skip
        engines = {"plugin": plugin, "default": default}
        print(f"engines started: plugin {plugin.startup_s:.0f} s, default {default.startup_s:.0f} s "
              f"({default.engine['scheduler_cls']})", flush=True)  # fmt: skip
        for r in range(args.rounds):
            order = ("plugin", "default") if r % 2 == 0 else ("default", "plugin")
            for name in order:
                tok_s[name].append(throughput(engines[name].run(reqs)))
            print(f"  round {r + 1}: plugin {tok_s['plugin'][-1]:.1f} tok/s, default "
                  f"{tok_s['default'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    ratios = [p / d for p, d in zip(tok_s["plugin"], tok_s["default"])]
    return {"tok_s": tok_s, "ratios": ratios}


def step_times(args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: per-step times with >= MIN_WAITING requests waiting."""
    tiny = EngineSettings(model="tiny-gpt2", max_model_len=256, max_num_seqs=8,
                          max_num_batched_tokens=512, num_kv_blocks=128,
                          num_threads=args.threads, enforce_eager=True)  # fmt: skip
    reqs = long_queue()
    out: dict[str, Any] = {}
    with VllmReplay(tiny, python=args.vllm_python) as plugin, \
            VllmReplay(EngineSettings(**{**tiny.to_json(), "roseinfer": False}),
                       python=args.vllm_python) as default:  # fmt: skip
        for _ in range(args.step_rounds or args.rounds):
            timing = default.run(reqs, timing=True).info["timing"]
            out.setdefault("default", []).append(_long(timing, "scheduler_s"))
            for name in args.policies:
                timing = plugin.run(reqs, POLICIES[name], timing=True).info["timing"]
                out.setdefault(name, []).append(_long(timing, "policy_s"))
                out.setdefault(f"{name}, admitting steps", []).append(
                    _long(timing, "policy_s", admitting=True)
                )
                out.setdefault(f"{name} schedule+update", []).append(_long(timing, "scheduler_s"))
    return out


def _long(timing: dict[str, list[float]], key: str, admitting: bool = False) -> list[float]:
    """The ``key`` seconds of the steps with at least MIN_WAITING requests waiting
    (``admitting``: only those that admitted a request, where the policy's ``admit``
    ran and its answer was checked; the others had no free seat)."""
    return [s for n, a, s in zip(timing["num_waiting"], timing["num_admitted"], timing[key])
            if n >= MIN_WAITING and (a > 0 or not admitting)]  # fmt: skip


def summary(tp: dict[str, Any] | None, st: dict[str, Any] | None) -> dict[str, Any]:
    """Both parts' figures as JSON (``--output``): per-round throughputs and ratios,
    and per timed series the median of the rounds' medians and the p90 of all steps (s)."""
    doc: dict[str, Any] = {}
    if tp is not None:
        r = tp["ratios"]
        doc["throughput"] = {"tok_s": tp["tok_s"], "ratios": r, "median_ratio": statistics.median(r),
                             "min_ratio": min(r), "max_ratio": max(r)}  # fmt: skip
    if st is not None:
        steps = {}
        for name, rounds in st.items():
            flat = sorted(x for run in rounds for x in run)
            if flat:
                steps[name] = {
                    "median_s": statistics.median(statistics.median(run) for run in rounds if run),
                    "round_medians_s": [statistics.median(run) for run in rounds if run],
                    "p90_s": flat[int(0.9 * (len(flat) - 1))], "steps": len(flat),
                }  # fmt: skip
        doc["steps"] = {"min_waiting": MIN_WAITING, "series": steps}
    return doc


def report(tp: dict[str, Any] | None, st: dict[str, Any] | None) -> None:
    """Print both parts."""
    if tp is not None:
        r = tp["ratios"]
        med = {k: statistics.median(v) for k, v in tp["tok_s"].items()}
        print(f"\n1. W2-32 throughput, GPT-2 124M fp32 on vLLM CPU, {len(r)} rounds (ABBA):")
        print(f"   plugin (fifo) median {med['plugin']:.1f} tok/s, default scheduler "
              f"{med['default']:.1f} tok/s")  # fmt: skip
        print(f"   plugin / default per round: {', '.join(f'{x:.3f}' for x in r)}")
        print(f"   median {statistics.median(r):.3f} (min {min(r):.3f}, max {max(r):.3f}); "
              f"target >= 0.97: {'met' if statistics.median(r) >= 0.97 else 'MISSED'}")  # fmt: skip
    if st is not None:
        print(f"\n2. Per step with >= {MIN_WAITING} waiting (tiny GPT-2, 8 seats, 400 requests), us; "
              "median of the rounds' medians [p90 of all steps] (steps):")  # fmt: skip
        for name, rounds in st.items():
            flat = sorted(x for run in rounds for x in run)
            if not flat:
                print(f"   {name:<28} no step with {MIN_WAITING} waiting")
                continue
            med = statistics.median(statistics.median(run) for run in rounds if run)
            p90 = flat[int(0.9 * (len(flat) - 1))]
            what = "vLLM default schedule+update" if name == "default" else name
            print(f"   {what:<28} {med * 1e6:8.1f} [{p90 * 1e6:8.1f}] ({len(flat)})")
        if "fifo" in st:
            fifo = statistics.median(statistics.median(run) for run in st["fifo"] if run)
            print(f"   target: fifo <= 100 us per step: {'met' if fifo <= 100e-6 else 'MISSED'}")


def main() -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", help="python of the vLLM venv (default: ROSEINFER_VLLM_PYTHON)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of each part (ABBA in part 1)")
    p.add_argument("--step-rounds", type=int, help="rounds of part 2 (default: --rounds)")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of vLLM")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    p.add_argument("--only", choices=["throughput", "steps"], help="run one part")
    p.add_argument("--output", type=Path, help="also write the figures as JSON there")
    args = p.parse_args()
    if args.rounds < 1 or (args.step_rounds is not None and args.step_rounds < 1):
        raise SystemExit("vllm_overhead: error: --rounds and --step-rounds must be >= 1")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: nproc={os.cpu_count()} load1={load:.2f}; vLLM OMP_NUM_THREADS={args.threads}",
          flush=True)  # fmt: skip
    start = time.perf_counter()
    tp = throughput_rounds(args) if args.only in (None, "throughput") else None
    st = step_times(args) if args.only in (None, "steps") else None
    report(tp, st)
    end_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    wall = time.perf_counter() - start
    print(f"\n{wall:.0f} s wall; load1 at the end {end_load:.2f}")
    if args.output is not None:
        doc = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "machine": f"nproc={os.cpu_count()}", "load_average": [load, end_load],
               "wall_s": wall, "threads": args.threads, **summary(tp, st)}  # fmt: skip
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
