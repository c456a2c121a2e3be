"""Fidelity report: does ``rose-sim`` predict ``rose-run`` on the same requests, and why not?

Runs the simulator (priced by a calibration: a ``rose-run profile`` file and/or
step logs) and the real executor on the SAME request lists for the chosen
policy x loop order combinations (``mixed`` with chunked prefill), on slices of
the Azure conv and code traces at two loads, and writes ``OUTPUT.md`` and
``OUTPUT.json`` with the four-part report of ``roseinfer.experiments.fidelity``:

* end to end: (sim - real) / real of p50/p90/p99 TTFT, TPOT, ITL, E2EL and of
  output throughput, real = the mean of ``--repeats`` real runs; the noise floor
  (their spread) and a bootstrap 95% CI of the real value (``*`` = sim inside it);
* step-model error: the cost model's price of every real step vs its duration;
* replay error: the simulator priced by each real run's own step log vs that run;
* rank agreement: Kendall tau and resolved pairs across combinations.

Workload: each trace slice's prompts are scaled by ``--prompt-scale`` and
clipped to 8..``--max-prompt-tokens``, outputs clipped to 4..``--max-output-tokens``
(the acceptance check's recipe: a real conversation scaled to GPT-2's context),
with made-up token ids. Load: the slice's capacity is estimated with the
simulator (all requests at t=0 under fifo/prefill-first, capacity = requests /
makespan) and ``--loads 0.6 1.0`` replay it with Poisson arrivals at 60% and
100% of it. Run it through ``../shared/tools/quiet`` and keep its QUIET line.

    python benchmarks/fidelity.py --model gpt2-4l --profile gpt2-4l-cpu.json \\
        --num-requests 200 --only fifo/prefill-first budget/decode-first pack/mixed
    python benchmarks/fidelity.py --model tiny-gpt2 --profile tiny.json --num-requests 8

A missing ``--profile`` file is made first (``rose-run profile`` machinery).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp (see rose-run)

import torch  # noqa: E402

from roseinfer import workloads  # noqa: E402
from roseinfer.calibration import Profile, load_profile  # noqa: E402
from roseinfer.calibration.cost_model import CostModel  # noqa: E402
from roseinfer.calibration.profile import cost_model_from_steps, load_calibration  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor import cli as run_cli  # noqa: E402
from roseinfer.executor.facts import model_spec_of  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.executor.profiler import run_profile  # noqa: E402
from roseinfer.executor.replay import ExecutorReplay  # noqa: E402
from roseinfer.experiments.fidelity import (  # noqa: E402
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_PREFILL_MAX_TOKENS,
    LOOP_ORDERS,
    POLICIES,
    FidelityReport,
    decomposition_table,
    default_combinations,
    estimate_capacity,
    markdown_table,
    run_fidelity,
)
from roseinfer.request import Request  # noqa: E402

TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces"
TRACES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}
SUMMARY_METRICS = ["p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms",
                   "p99_itl_ms", "p50_e2el_ms", "p99_e2el_ms", "output_throughput"]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Flags of the fidelity benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True, help="PROFILE.json (made if absent)")
    p.add_argument("--cost-model", type=Path, nargs="+",
                   help="price the simulation with these calibration files instead "
                   "(profiles and/or step logs, pooled as rose-sim --cost-model does)")  # fmt: skip
    p.add_argument("--model", default="gpt2", help="as rose-run --model (must match the profile)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--traces", nargs="+", choices=sorted(TRACES), default=["conv", "code"])
    p.add_argument("--trace-dir", type=Path, default=TRACE_DIR, help="where the Azure CSVs are")
    p.add_argument("--num-requests", type=int, default=200, help="requests per trace slice")
    p.add_argument("--skip", type=int, default=0, help="trace rows skipped before the slice")
    p.add_argument("--prompt-scale", type=float, default=0.25, help="prompt length factor")
    p.add_argument("--max-prompt-tokens", type=int, default=900)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--loads", nargs="+", type=float, default=[0.6, 1.0],
                   help="arrival rates as fractions of the simulated capacity")  # fmt: skip
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--loop-orders", nargs="+", default=list(LOOP_ORDERS))
    p.add_argument("--only", nargs="+", metavar="POLICY/ORDER",
                   help="keep only these combinations of the grid, e.g. fifo/mixed")  # fmt: skip
    p.add_argument("--prefill-max-tokens", type=int, default=DEFAULT_PREFILL_MAX_TOKENS,
                   help="budget/pack admission budget")  # fmt: skip
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="mixed: --max-num-batched-tokens with chunked prefill")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, help="default: the profile's")
    p.add_argument("--repeats", type=int, default=3, help="real runs per combination")
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples")
    p.add_argument("--profile-repetitions", type=int, default=3, help="when profiling here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loo-steps", action="store_true",
                   help="also price each combination by a fit of the OTHER combinations' "
                   "step logs of the same case (calibrated from runs you have), a second table")  # fmt: skip
    p.add_argument("--save-steps-dir", type=Path,
                   help="write every real run's step log there (TRACE-LOAD-POLICY-ORDER-K.jsonl)")  # fmt: skip
    p.add_argument("--output", type=Path, default=Path("fidelity"),
                   help="writes OUTPUT.md and OUTPUT.json (default ./fidelity)")  # fmt: skip
    return p


def ensure_profile(args: argparse.Namespace, model, hf_config, dtype) -> Profile:  # type: ignore[no-untyped-def]
    """Load ``--profile``, or profile the model now with rose-run's defaults and save it."""
    if args.profile.exists():
        return load_profile(args.profile)
    print(f"no {args.profile}: profiling {args.model} first", file=sys.stderr)
    device = torch.device(args.device)
    max_len = run_cli._max_context(model)
    kv_bytes = run_cli._kv_bytes_per_token(hf_config, dtype)
    num_seqs = args.max_num_seqs or 256
    ns = argparse.Namespace(kv_cache_memory_gb=None, block_size=16, gpu_memory_utilization=0.9)
    blocks = run_cli.default_num_kv_blocks(ns, kv_bytes, device, num_seqs * -(-max_len // 16))
    config = SchedulerConfig(num_kv_blocks=blocks, max_num_seqs=num_seqs, max_model_len=max_len)
    runner = run_cli.ModelRunner(model, num_kv_blocks=blocks, block_size=16, device=device,
                                 dtype=dtype)  # fmt: skip
    profile = run_profile(
        runner, config, model_name=args.model, hf_config=hf_config,
        model_spec=model_spec_of(args.model, hf_config, dtype),
        max_num_batched_tokens=max(max_len, 2048), repetitions=args.profile_repetitions,
        seed=args.seed,
    )  # fmt: skip
    profile.save(args.profile)
    return profile


def trace_slice(args: argparse.Namespace, trace: str, vocab: int) -> tuple[list[Request], str]:
    """``--num-requests`` rows of a trace with lengths scaled and clipped (see the
    module docstring) and token ids made up; the embedded conv sample when absent."""
    path = args.trace_dir / TRACES[trace]
    if path.exists():
        reqs, name = workloads.load_trace(path), f"Azure {trace} ({path.name})"
    else:
        reqs = workloads.load_default_trace()
        name = f"{workloads.DEFAULT_TRACE_NAME} ({trace} absent)"
    reqs = workloads.select(reqs, num_requests=args.num_requests, skip=args.skip)
    reqs = [
        dataclasses.replace(
            r,
            num_prompt_tokens=max(
                8, min(args.max_prompt_tokens, int(r.num_prompt_tokens * args.prompt_scale))
            ),
            max_output_tokens=max(4, min(args.max_output_tokens, r.max_output_tokens)),
            prompt_token_ids=None,
            prefix_hash_ids=None,
        )  # fmt: skip
        for r in reqs
    ]
    note = (
        f"prompts x{args.prompt_scale:g} clipped to 8..{args.max_prompt_tokens}, outputs "
        f"clipped to 4..{args.max_output_tokens}"
    )
    return workloads.with_token_ids(reqs, vocab_size=vocab, seed=args.seed), f"{name}; {note}"


def machine_facts() -> dict[str, Any]:
    """Machine, versions, threads and the 1/5/15-min load average now."""
    return {
        "machine": f"{platform.machine()} nproc={os.cpu_count()}",
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def base_config(profile: Profile, args: argparse.Namespace) -> SchedulerConfig:
    """The profiled executor's pool, block size and max model length."""
    d = profile.scheduler_defaults()
    num_seqs = args.max_num_seqs or int(profile.executor.get("max_num_seqs", 256))
    return SchedulerConfig(num_kv_blocks=d["num_kv_blocks"], block_size=d["block_size"],
                           max_num_seqs=num_seqs, max_model_len=d["max_model_len"])  # fmt: skip


def timed_requests(args, reqs, load, capacity):  # type: ignore[no-untyped-def]
    """The slice with Poisson arrivals at ``load`` x capacity (seeded)."""
    return workloads.rescale_arrivals(reqs, request_rate=load * capacity, seed=args.seed)


def leave_one_out(args, timed, combos, report) -> FidelityReport | None:  # type: ignore[no-untyped-def]
    """The same real runs, each combination simulated with a step model fitted to
    the step logs of the case's OTHER combinations (``--loo-steps``)."""
    if not args.loo_steps or len(combos) < 2:
        return None
    steps = {name: [s for run in runs for s in (run.steps or [])]
             for name, runs in report.real.items()}  # fmt: skip

    def cost_for(name: str) -> CostModel:
        others = [s for other, recs in steps.items() if other != name for s in recs]
        return cost_model_from_steps(others, f"{len(others)} steps of the other combinations")

    cached = {id(c.config): iter(report.real[c.name]) for c in combos}
    return run_fidelity(timed, combos, cost_for, lambda _r, config: next(cached[id(config)]),
                        repeats=args.repeats, num_resamples=args.resamples)  # fmt: skip


def run_case(args, reqs, load, capacity, combos, cost_model, real) -> FidelityReport:  # type: ignore[no-untyped-def]
    """One trace slice at one load: Poisson arrivals at ``load`` x capacity."""
    timed = timed_requests(args, reqs, load, capacity)

    def on_run(name: str, what: str) -> None:
        print(f"  {name}: {what}", file=sys.stderr, flush=True)

    return run_fidelity(timed, combos, cost_model, real, repeats=args.repeats, on_run=on_run,
                        num_resamples=args.resamples)  # fmt: skip


def main() -> int:
    """Entry point: profile if needed, run every case, write OUTPUT.md / OUTPUT.json."""
    args = build_parser().parse_args()
    device = run_cli.resolve_device(args.device)
    run_cli.set_num_threads(args.num_threads)
    start, facts_before = time.perf_counter(), machine_facts()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, hf_config, _ = build_model(args.model, seed=args.seed, dtype=dtype, device=device)
    profile = ensure_profile(args, model, hf_config, dtype)
    calibration = load_calibration(args.cost_model) if args.cost_model else profile
    cost_model, base = calibration.cost_model(), base_config(profile, args)
    combos = default_combinations(base, args.policies, args.loop_orders,
                                  prefill_max_tokens=args.prefill_max_tokens,
                                  chunk_tokens=args.chunk_tokens)  # fmt: skip
    if args.only:
        unknown = set(args.only) - {c.name for c in combos}
        if unknown:
            raise SystemExit(f"fidelity: error: --only {sorted(unknown)} not in the grid")
        combos = [c for c in combos if c.name in args.only]
    real = ExecutorReplay(model, device=device, dtype=dtype, seed=args.seed)
    cases, md = [], []
    for trace in args.traces:
        reqs, name = trace_slice(args, trace, int(hf_config.vocab_size))
        capacity = estimate_capacity(reqs, base, cost_model)
        for load in args.loads:
            print(f"{name} @ {load:.0%} of {capacity:.3f} req/s", file=sys.stderr)
            report = run_case(args, reqs, load, capacity, combos, cost_model, real)
            title = f"{name}, {len(reqs)} requests, {load:.0%} load ({load * capacity:.3f} req/s)"
            md += [f"### {title}", "", "End to end (sim - real) / real (± noise floor; * = "
                   "inside the real runs' 95% CI):", "", markdown_table(report, SUMMARY_METRICS),
                   "", "Decomposition:", "", decomposition_table(report), ""]  # fmt: skip
            loo = leave_one_out(args, timed_requests(args, reqs, load, capacity), combos, report)
            if loo is not None:
                md += ["Calibrated from the other combinations' step logs of this case "
                       "(`rose-sim --cost-model THEIR_STEPS.jsonl`):", "",
                       markdown_table(loo, SUMMARY_METRICS), "", decomposition_table(loo), ""]  # fmt: skip
            if args.save_steps_dir is not None:
                save_steps(args.save_steps_dir, f"{trace}-{load:g}", report)
            cases.append({"trace": trace, "workload": name, "load": load,
                          "capacity_req_s": capacity, "request_rate": load * capacity,
                          **report.to_json(),
                          "leave_one_out": None if loo is None else loo.to_json()})  # fmt: skip
            write_outputs(args.output, _doc(args, cost_model, facts_before, start, cases), md)
    print(args.output.with_suffix(".md").read_text())
    return 0


def save_steps(folder: Path, case: str, report: FidelityReport) -> None:
    """Every real run's step log of ``report`` as ``folder/CASE-POLICY-ORDER-K.jsonl``."""
    from roseinfer.calibration.steplog import StepLogWriter, make_header

    folder.mkdir(parents=True, exist_ok=True)
    for combo, runs in report.real.items():
        for k, run in enumerate(runs, start=1):
            name = f"{case}-{combo.replace('/', '-')}-{k}.jsonl"
            with StepLogWriter(folder / name, make_header("rose-run", environment=run.info)) as w:
                for record in run.steps or []:
                    w.write(record)


def _doc(args, cost_model, facts_before, start, cases) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The JSON document so far (written after every case, so a cut run keeps its cases)."""
    return {"profile": str(args.profile), "cost_model": cost_model.describe(),
            "machine_before": facts_before, "machine_after": machine_facts(),
            "wall_s": time.perf_counter() - start, "cases": cases}  # fmt: skip


def write_outputs(output: Path, doc: dict[str, Any], md: list[str]) -> None:
    """OUTPUT.json (everything) and OUTPUT.md (header + one table pair per case)."""
    before, after = doc["machine_before"], doc["machine_after"]
    load = f"{before['load_average'][0]:.2f} before, {after['load_average'][0]:.2f} after"
    header = [
        f"`{before['command']}`", "",
        f"{before['machine']}, torch {before['torch']}, {before['num_threads']} thread(s), "
        f"load average (1 min) {load}; {doc['wall_s']:.0f} s wall. Cost model: {doc['cost_model']}.",
        "",
    ]  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    output.with_suffix(".md").write_text("\n".join(header + md) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
