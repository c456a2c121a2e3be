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

A profile with step jitter (``roseinfer.calibration.jitter``) is also priced at
its medians, against the same real runs (``--step-jitter off``'s table).

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
from roseinfer.calibration.cost_model import (  # noqa: E402
    CostModel,
    RooflineCostModel,
    cost_model_source,
    make_cost_model,
)
from roseinfer.calibration.profile import cost_model_from_steps, load_calibration  # noqa: E402
from roseinfer.calibration.specs import ModelSpec  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor import builder  # noqa: E402
from roseinfer.executor.profiler import run_profile  # noqa: E402
from roseinfer.executor.replay import ExecutorReplay  # noqa: E402
from roseinfer.experiments.fidelity import (  # noqa: E402
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_PREFILL_MAX_TOKENS,
    LOOP_ORDERS,
    POLICIES,
    SERVING_BUDGET_TOKENS,
    Combination,
    FidelityReport,
    decomposition_table,
    default_combinations,
    estimate_capacity,
    markdown_table,
    run_fidelity,
    serving_combinations,
    simulate_output,
)
from roseinfer.request import Request  # noqa: E402

TRACES = {"conv": "azure-conv-2023", "code": "azure-code-2023"}  # public traces, fetched once
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
    p.add_argument("--trace-dir", type=Path,
                   help="a folder holding the Azure CSVs (default: the public traces, cached)")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=200, help="requests per trace slice")
    p.add_argument("--skip", type=int, default=0, help="trace rows skipped before the slice")
    p.add_argument("--prompt-scale", type=float, default=0.25, help="prompt length factor")
    p.add_argument("--max-prompt-tokens", type=int, default=900)
    p.add_argument("--max-output-tokens", type=int, default=64)
    p.add_argument("--loads", nargs="+", type=float, default=[0.6, 1.0],
                   help="arrival rates as fractions of the simulated capacity")  # fmt: skip
    p.add_argument("--grid", choices=["policies", "serving"], default="policies",
                   help="policies: every --policies x --loop-orders; serving: fifo, budget B, "
                   "pack B + force-FIFO 8, budget B decode-first, mixed + chunked B "
                   "(B = --budget-tokens)")  # fmt: skip
    p.add_argument("--budget-tokens", type=int, default=SERVING_BUDGET_TOKENS,
                   help="the serving grid's token budget B (default 2048)")  # fmt: skip
    p.add_argument("--roofline", metavar="SPEC",
                   help="also price every case with the built-in roofline of --model on this "
                   "hardware (e.g. h100-sxm), against the same real runs: a second report, "
                   "and a third with its measured eager step jitter when the spec has one "
                   "(--step-jitter measured)")  # fmt: skip
    p.add_argument("--time-budget-s", type=float,
                   help="cut --num-requests (never combinations) so that the real runs, as "
                   "the simulator prices them, fit this many seconds")  # fmt: skip
    p.add_argument("--run-overhead-s", type=float, default=5.0,
                   help="seconds each real run costs besides its requests (warm-up, replay)")  # fmt: skip
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--loop-orders", nargs="+", default=list(LOOP_ORDERS))
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help="keep only these combinations of the grid, e.g. fifo/mixed "
                   "(policies) or budget-2048/decode-first (serving)")  # fmt: skip
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


def ensure_profile(args: argparse.Namespace, loaded: builder.LoadedModel) -> Profile:
    """Load ``--profile``, or profile the model now with rose-run's defaults and save it."""
    if args.profile.exists():
        return load_profile(args.profile)
    print(f"no {args.profile}: profiling {args.model} first", file=sys.stderr)
    max_len, num_seqs = loaded.max_context, args.max_num_seqs or 256
    pool = builder.size_kv_pool(builder.KVPoolChoice(block_size=16), loaded,
                                num_seqs * -(-max_len // 16))  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=pool.num_blocks, max_num_seqs=num_seqs,
                             max_model_len=max_len)  # fmt: skip
    built = builder.build_runner(loaded, config, pool)
    profile = run_profile(
        built.runner, built.config, model_name=args.model,
        hf_config=loaded.hf_config, model_spec=loaded.spec,
        max_num_batched_tokens=max(max_len, 2048), repetitions=args.profile_repetitions,
        seed=args.seed,
    )  # fmt: skip
    profile.save(args.profile)
    return dataclasses.replace(profile, path=str(args.profile))


def trace_slice(args: argparse.Namespace, trace: str, vocab: int) -> tuple[list[Request], str]:
    """``--num-requests`` rows of a trace with lengths scaled and clipped (see the
    module docstring) and token ids made up; the embedded conv sample when the trace
    cannot be had (offline, nothing cached)."""
    public = workloads.CATALOGUE[TRACES[trace]]
    try:
        path = (args.trace_dir / public.file_name if args.trace_dir
                else workloads.resolve_trace(public.name))  # fmt: skip
        reqs, name = workloads.load_trace(path), f"Azure {trace} ({path.name})"
    except workloads.WorkloadError as err:
        print(f"fidelity.py: {err}; using the embedded sample", file=sys.stderr)
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
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
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

    return reprice(args, timed, combos, report, cost_for)


def reprice(args, timed, combos, report, cost_model) -> FidelityReport:  # type: ignore[no-untyped-def]
    """``report``'s real runs (not run again) against the simulator priced by
    ``cost_model`` (one, or one per combination name)."""
    cached = {id(c.config): iter(report.real[c.name]) for c in combos}
    return run_fidelity(timed, combos, cost_model, lambda _r, config: next(cached[id(config)]),
                        repeats=args.repeats, num_resamples=args.resamples)  # fmt: skip


def choose_combinations(args: argparse.Namespace, base: SchedulerConfig) -> list[Combination]:
    """The ``--grid``'s combinations, cut to ``--only``."""
    if args.grid == "serving":
        combos = serving_combinations(base, args.budget_tokens)
    else:
        combos = default_combinations(base, args.policies, args.loop_orders,
                                      prefill_max_tokens=args.prefill_max_tokens,
                                      chunk_tokens=args.chunk_tokens)  # fmt: skip
    if args.only:
        unknown = set(args.only) - {c.name for c in combos}
        if unknown:
            raise SystemExit(f"fidelity: error: --only {sorted(unknown)} not in the grid "
                             f"({', '.join(c.name for c in combos)})")  # fmt: skip
        combos = [c for c in combos if c.name in args.only]
    return combos


def planned_wall_s(args, slices, base, combos, cost_model) -> float:  # type: ignore[no-untyped-def]
    """Seconds the real runs take as the simulator prices them: every slice x load x
    combination x repeat, each run its simulated duration plus ``--run-overhead-s``."""
    total = 0.0
    for reqs, _ in slices:
        capacity = estimate_capacity(reqs, base, cost_model)
        for load in args.loads:
            timed = timed_requests(args, reqs, load, capacity)
            for combo in combos:
                duration = simulate_output(timed, combo.config, cost_model).duration_s
                total += args.repeats * (duration + args.run_overhead_s)
    return total


def fit_time_budget(args, vocab, base, combos, cost_model) -> list[tuple[list[Request], str]]:  # type: ignore[no-untyped-def]
    """The trace slices, with ``--num-requests`` cut (in place) until the planned real
    runs fit ``--time-budget-s``; a run's duration grows with its request count."""
    slices = [trace_slice(args, trace, vocab) for trace in args.traces]
    if args.time_budget_s is None:
        return slices
    for _ in range(4):  # durations are close to linear in requests: a few rounds settle
        planned = planned_wall_s(args, slices, base, combos, cost_model)
        if planned <= args.time_budget_s or args.num_requests <= 8:
            break
        wanted = int(args.num_requests * args.time_budget_s / planned * 0.95)
        print(f"fidelity: {planned:.0f} s planned > --time-budget-s {args.time_budget_s:.0f}: "
              f"cutting requests {args.num_requests} -> {max(8, wanted)} (combinations kept)",
              file=sys.stderr)  # fmt: skip
        args.num_requests = max(8, wanted)
        slices = [trace_slice(args, trace, vocab) for trace in args.traces]
    return slices


def run_case(args, reqs, load, capacity, combos, cost_model, real) -> FidelityReport:  # type: ignore[no-untyped-def]
    """One trace slice at one load: Poisson arrivals at ``load`` x capacity."""
    timed = timed_requests(args, reqs, load, capacity)

    start = time.perf_counter()

    def on_run(name: str, what: str) -> None:
        elapsed = time.perf_counter() - start
        print(f"  {name}: {what} (case {elapsed:.0f} s)", file=sys.stderr, flush=True)

    return run_fidelity(timed, combos, cost_model, real, repeats=args.repeats, on_run=on_run,
                        num_resamples=args.resamples)  # fmt: skip


def main() -> int:
    """Entry point: profile if needed, run every case, write OUTPUT.md / OUTPUT.json."""
    args = build_parser().parse_args()
    start, facts_before = time.perf_counter(), machine_facts()
    loaded = builder.load_model(
        builder.ModelChoice(args.model, args.device, seed=args.seed, num_threads=args.num_threads)
    )
    model, hf_config, device, dtype = loaded.model, loaded.hf_config, loaded.device, loaded.dtype
    profile = ensure_profile(args, loaded)
    calibration = load_calibration(args.cost_model) if args.cost_model else profile
    cost_model, base = calibration.cost_model(), base_config(profile, args)
    spec = loaded.spec
    roofline = make_cost_model(spec, args.roofline, spec.dtype_bytes) if args.roofline else None
    jittered = roofline.with_step_jitter() if isinstance(roofline, RooflineCostModel) else None
    jittered = None if jittered is None or jittered.jitter is None else jittered
    combos = choose_combinations(args, base)
    slices = fit_time_budget(args, int(hf_config.vocab_size), base, combos, cost_model)
    real = ExecutorReplay(model, device=device, dtype=dtype, seed=args.seed)
    cases, md = [], []
    for trace, (reqs, name) in zip(args.traces, slices):
        capacity = estimate_capacity(reqs, base, cost_model)
        for load in args.loads:
            print(f"{name} @ {load:.0%} of {capacity:.3f} req/s", file=sys.stderr)
            report = run_case(args, reqs, load, capacity, combos, cost_model, real)
            timed = timed_requests(args, reqs, load, capacity)
            title = f"{name}, {len(reqs)} requests, {load:.0%} load ({load * capacity:.3f} req/s)"
            md += [f"### {title}", ""] + report_md(report, cost_model_source(cost_model))
            loo = leave_one_out(args, timed, combos, report)
            if loo is not None:
                md += report_md(loo, "the other combinations' step logs of this case "
                                "(`rose-sim --cost-model THEIR_STEPS.jsonl`)")  # fmt: skip
            by_roofline = (
                None if roofline is None else reprice(args, timed, combos, report, roofline)
            )
            if by_roofline is not None:
                md += report_md(by_roofline, cost_model_source(roofline))
            by_jittered = (
                None if jittered is None else reprice(args, timed, combos, report, jittered)
            )
            if by_jittered is not None:
                md += report_md(
                    by_jittered, cost_model_source(jittered) + " (--step-jitter measured)"
                )
            medians = getattr(cost_model, "jitter", None) and cost_model.without_jitter()
            by_medians = None if not medians else reprice(args, timed, combos, report, medians)
            if by_medians is not None:
                md += report_md(by_medians, "the same profile at its medians (--step-jitter off)")
            if args.save_steps_dir is not None:
                save_steps(args.save_steps_dir, f"{trace}-{load:g}", report, spec)
            cases.append({"trace": trace, "workload": name, "load": load,
                          "capacity_req_s": capacity, "request_rate": load * capacity,
                          **report.to_json(),
                          "leave_one_out": None if loo is None else loo.to_json(),
                          "roofline": None if by_roofline is None else by_roofline.to_json(),
                          "roofline_step_jitter":
                              None if by_jittered is None else by_jittered.to_json(),
                          "medians": None if by_medians is None else by_medians.to_json()})  # fmt: skip
            doc = _doc(args, [cost_model, roofline], facts_before, start, cases)
            write_outputs(args.output, doc, md)
    print(args.output.with_suffix(".md").read_text())
    return 0


def report_md(report: FidelityReport, priced_by: str) -> list[str]:
    """One report's markdown: what priced it, the end-to-end table, the decomposition."""
    return [f"Priced by {priced_by}. End to end (sim - real) / real (± noise floor; * = "
            "inside the real runs' 95% CI):", "", markdown_table(report, SUMMARY_METRICS),
            "", "Decomposition:", "", decomposition_table(report), ""]  # fmt: skip


def save_steps(folder: Path, case: str, report: FidelityReport, spec: ModelSpec) -> None:
    """Every real run's step log of ``report`` as ``folder/CASE-POLICY-ORDER-K.jsonl``
    (with the model's shape, so a log calibrates alone: ``rose-sim --cost-model``,
    ``benchmarks/fit_device_spec.py``)."""
    from roseinfer.calibration.steplog import StepLogWriter, make_header

    model = {"name": spec.name, "spec": dataclasses.asdict(spec)}

    folder.mkdir(parents=True, exist_ok=True)
    for combo, runs in report.real.items():
        for k, run in enumerate(runs, start=1):
            name = f"{case}-{combo.replace('/', '-')}-{k}.jsonl"
            header = make_header("rose-run", model=model, environment=run.info)
            with StepLogWriter(folder / name, header) as w:
                for record in run.steps or []:
                    w.write(record)


def _doc(args, cost_models, facts_before, start, cases) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """The JSON document so far (written after every case, so a cut run keeps its cases)."""
    cost_model, roofline = cost_models
    return {"profile": str(args.profile), "cost_model": cost_model.describe(),
            "cost_model_source": cost_model_source(cost_model),
            "roofline_source": None if roofline is None else cost_model_source(roofline),
            "num_requests": args.num_requests,
            "machine_before": facts_before, "machine_after": machine_facts(),
            "wall_s": time.perf_counter() - start, "cases": cases}  # fmt: skip


def write_outputs(output: Path, doc: dict[str, Any], md: list[str]) -> None:
    """OUTPUT.json (everything) and OUTPUT.md (header + one table pair per case)."""
    before, after = doc["machine_before"], doc["machine_after"]
    load = f"{before['load_average'][0]:.2f} before, {after['load_average'][0]:.2f} after"
    header = [
        f"`{before['command']}`", "",
        f"{before['machine']}{', ' + before['gpu'] if before.get('gpu') else ''}, "
        f"torch {before['torch']}, {before['num_threads']} thread(s), "
        f"load average (1 min) {load}; {doc['wall_s']:.0f} s wall. Cost model: {doc['cost_model']} "
        f"({doc['cost_model_source']}).",
        "",
    ]  # fmt: skip
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    output.with_suffix(".md").write_text("\n".join(header + md) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
