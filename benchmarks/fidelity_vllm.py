"""Fidelity against vLLM: does ``rose-sim`` predict vLLM running the same policy?

The same request list goes through vLLM (its CPU build, GPT-2 shape with random
weights, token-id prompts) with ``--scheduler-cls roseinfer.integrations.vllm.Scheduler``
and ``ROSEINFER_STEP_LOG``, and through ``rose-sim --scheduler-preset vllm-v1
--cost-model <vLLM step logs>`` (the same limits given as flags), for the
policies ``fifo``, ``priority``, ``sjf --length-predictor oracle`` and ``vtc`` at
two loads. The report is ``roseinfer.experiments.fidelity``'s, unchanged: per
policy the relative error (sim - real) / real of p50/p99 TTFT, TPOT and E2EL (real
= the mean of ``--repeats`` vLLM runs), the real-vs-real noise floor (their
spread; ``*`` = the sim value lies in the real runs' bootstrap 95% CI), the rank
agreement of the policies (Kendall tau, resolved pairs), and the decomposition:
step-model error (the cost model's price of every step vLLM ran) and replay error
(rose-sim priced by each vLLM run's own step log, which names any divergence of
vLLM's scheduler from the preset's).

Calibration: vLLM step logs of the NEXT slice of the trace (fifo; once all at
t=0, once at 75% load), pooled, as ``rose-sim --cost-model A.jsonl B.jsonl``;
the capacity (requests/s) comes from that cost model, and ``--loads`` are
fractions of it. vLLM runs in its own venv (``ROSEINFER_VLLM_PYTHON``, see
``roseinfer.integrations.vllm_replay``), loaded once; each run gets a fresh
policy and an empty prefix cache. Run it through ``../shared/tools/quiet``.

    python benchmarks/fidelity_vllm.py --output fidelity-vllm          # 7 min on 2 quiet cores
    python benchmarks/fidelity_vllm.py --model tiny-gpt2 --num-requests 12 --repeats 2 \\
        --policies fifo sjf --loads 0.8 --enforce-eager              # a smoke run, ~20 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from roseinfer.experiments.fidelity import (
    Combination,
    FidelityReport,
    decomposition_table,
    markdown_table,
    run_fidelity,
    simulate_output,
)
from roseinfer.integrations.vllm_lab import WorkloadSpec, at_load, calibrate, conv_workload
from roseinfer.integrations.vllm_replay import (
    EngineSettings,
    VllmReplay,
    rose_sim_command,
    sim_config,
    vocab_size,
)

POLICIES = {
    "fifo": "--policy fifo",
    "priority": "--policy priority",
    "sjf": "--policy sjf --length-predictor oracle",
    "vtc": "--policy vtc",
}
"""ROSEINFER_POLICY_ARGS (= rose-sim's flags) of each policy compared."""
METRICS = ["p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_e2el_ms",
           "p99_e2el_ms", "output_throughput"]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """Flags of the benchmark."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", help="gpt2, gpt2-4l or tiny-gpt2 (random weights)")
    p.add_argument("--vllm-python", help="python of the vLLM venv (default: ROSEINFER_VLLM_PYTHON)")
    p.add_argument("--policies", nargs="+", choices=sorted(POLICIES), default=list(POLICIES))
    p.add_argument("--loads", nargs="+", type=float, default=[0.6, 0.9],
                   help="arrival rates as fractions of the calibrated capacity")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=40, help="requests per run")
    p.add_argument("--repeats", type=int, default=3, help="vLLM runs per policy and load")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=160, help="KV blocks of 32 tokens")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of vLLM")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM --enforce-eager")
    p.add_argument("--resamples", type=int, default=400, help="bootstrap resamples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("fidelity-vllm"),
                   help="writes OUTPUT.md, OUTPUT.json and OUTPUT/ (step logs, trace CSVs)")  # fmt: skip
    return p


def settings_of(args: argparse.Namespace) -> EngineSettings:
    """The vLLM engine both sides share."""
    return EngineSettings(
        model=args.model, max_model_len=1024, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=32,
        num_kv_blocks=args.num_kv_blocks, num_threads=args.threads,
        enforce_eager=args.enforce_eager, seed=args.seed,
    )  # fmt: skip


def real_run_of(vllm: VllmReplay, folder: Path, case: str, policies: dict[str, str]) -> Any:
    """The RealRun of ``run_fidelity``: the combination's policy in vLLM, its step log
    kept (``real_run.step_logs``: policy -> paths)."""
    step_logs: dict[str, list[Path]] = {}

    def real_run(requests: Any, config: Any) -> Any:
        name = config.policy
        logs = step_logs.setdefault(name, [])
        logs.append(folder / f"{case}-{name}-{len(logs) + 1}.steps.jsonl")
        return vllm.run(requests, policies[name], step_log=logs[-1])

    real_run.step_logs = step_logs  # type: ignore[attr-defined]
    return real_run


PRICINGS = {
    "own": "each policy priced by its own vLLM runs' step logs: `rose-sim --cost-model "
    "<those logs>`, the step-log calibration",
    "others": "each policy priced by the OTHER policies' vLLM step logs of this load "
    "(recorded minutes apart on the same machine, none of its own steps)",
    "calibration": "every policy priced by the calibration runs' step logs (the next "
    "trace slice, fifo, recorded before every run here)",
}
"""How the simulated side is priced, one report each (the vLLM runs are the same)."""


def repriced(args, timed, combos, report, cost_for) -> FidelityReport:  # type: ignore[no-untyped-def]
    """``report``'s vLLM runs again against the simulator priced by ``cost_for(name)``."""
    cached = {c.name: iter(report.real[c.name]) for c in combos}
    return run_fidelity(timed, combos, cost_for, lambda _r, config: next(cached[config.policy]),
                        repeats=args.repeats, num_resamples=args.resamples)  # fmt: skip


def write_trace(requests: Any, path: Path) -> None:
    """The request list as a plain CSV trace (what ``rose-sim --trace`` reads)."""
    with path.open("w") as f:
        f.write("arrival_s,prompt_tokens,output_tokens,tenant,priority\n")
        for r in requests:
            f.write(f"{r.arrival_time_s!r},{r.num_prompt_tokens},{r.max_output_tokens},"
                    f"{r.tenant},{r.priority}\n")  # fmt: skip


def cli_check(settings: EngineSettings, calibration: Any, trace: Path, sim: Any) -> dict[str, Any]:
    """Run the printed ``rose-sim`` command for fifo and compare its p50/p99 TTFT and E2EL
    with the in-process simulation of the same requests (they must agree)."""
    from roseinfer.calibration.report import summary_of

    result = trace.with_suffix(".rose-sim.json")
    logs = " ".join(str(p) for p in calibration.step_logs)
    cmd = rose_sim_command(settings, None, logs, str(trace)) + f" --quiet --save-result {result}"
    subprocess.run(cmd.split(), check=True, stdout=subprocess.DEVNULL)
    cli = json.loads(result.read_text())
    mine = summary_of(sim)
    keys = ["p50_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p99_e2el_ms"]
    worst = max(abs(float(cli[k]) - mine[k]) / mine[k] for k in keys)
    return {"command": cmd, "max_rel_diff": worst, "rose_sim": {k: cli[k] for k in keys}}


def run_case(args, vllm, settings, calibration, requests, load, folder):  # type: ignore[no-untyped-def]
    """One load: run_fidelity over the policies (priced by the calibration), the same
    vLLM runs against the simulator priced by their own and by the other policies'
    step logs, and the rose-sim CLI cross-check.

    Returns:
        ({pricing: FidelityReport}, facts of the case).
    """
    from roseinfer.calibration.profile import load_calibration

    timed = at_load(requests, load, calibration.capacity_req_s, seed=args.seed)
    policies = {p: POLICIES[p] for p in args.policies}
    combos = [Combination(name, sim_config(settings, flags)) for name, flags in policies.items()]
    case = f"load{load:g}"
    trace = folder / f"{case}.trace.csv"
    write_trace(timed, trace)

    def on_run(name: str, what: str) -> None:
        print(f"  {case} {name}: {what}", file=sys.stderr, flush=True)

    real_run = real_run_of(vllm, folder, case, policies)
    first = run_fidelity(timed, combos, calibration.cost_model, real_run, repeats=args.repeats,
                         on_run=on_run, num_resamples=args.resamples)  # fmt: skip
    logs: dict[str, list[Path]] = real_run.step_logs
    reports = {"own": repriced(args, timed, combos, first,
                               lambda name: load_calibration(logs[name]).cost_model())}  # fmt: skip
    if len(combos) > 1:
        others = {n: [p for o, paths in logs.items() if o != n for p in paths] for n in logs}
        reports["others"] = repriced(args, timed, combos, first,
                                     lambda name: load_calibration(others[name]).cost_model())  # fmt: skip
    reports["calibration"] = first
    fifo = simulate_output(timed, sim_config(settings, None), calibration.cost_model)
    check = cli_check(settings, calibration, trace, fifo)
    commands = {n: rose_sim_command(settings, f, " ".join(map(str, logs[n])), str(trace))
                for n, f in policies.items()}  # fmt: skip
    return reports, {"trace": str(trace), "rate_req_s": load * calibration.capacity_req_s,
                     "cli": check, "commands": commands}  # fmt: skip


def machine() -> dict[str, Any]:
    """Machine facts and the load average now."""
    return {"machine": f"{platform.machine()} nproc={os.cpu_count()}",
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}  # fmt: skip


def main() -> int:
    """Entry point: calibrate on vLLM, run every load, write OUTPUT.md / OUTPUT.json."""
    args = build_parser().parse_args()
    if args.repeats < 2 or args.num_requests < 4:
        raise SystemExit(
            "fidelity_vllm: error: need --repeats >= 2 (a noise floor) and --num-requests >= 4"
        )
    start, before = time.perf_counter(), machine()
    settings = settings_of(args)
    folder = args.output.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec(num_requests=args.num_requests, seed=args.seed)
    requests, note = conv_workload(spec, vocab_size(args.model))
    calib_reqs, _ = conv_workload(WorkloadSpec(num_requests=args.num_requests, skip=args.num_requests,
                                               seed=args.seed), vocab_size(args.model))  # fmt: skip
    md, cases = [], []
    with VllmReplay(settings, python=args.vllm_python, workdir=folder / "vllm") as vllm:
        print(f"vLLM started in {vllm.startup_s:.0f} s: {vllm.engine}", file=sys.stderr)
        calibration = calibrate(vllm, settings, requests, calib_reqs, folder)
        print(f"calibrated: {calibration.describe}; capacity {calibration.capacity_req_s:.3f} req/s",
              file=sys.stderr)  # fmt: skip
        for load in args.loads:
            reports, extra = run_case(args, vllm, settings, calibration, requests, load, folder)
            md += case_markdown(reports, extra, load, len(requests))
            cases.append({"load": load, **extra,
                          "reports": {k: r.to_json() for k, r in reports.items()}})  # fmt: skip
            doc = {"engine": vllm.engine, "settings": settings.to_json(), "workload": note,
                   "calibration": {"cost_model": calibration.describe,
                                   "step_logs": [str(p) for p in calibration.step_logs],
                                   "capacity_req_s": calibration.capacity_req_s},
                   "machine_before": before, "machine_after": machine(),
                   "wall_s": time.perf_counter() - start, "cases": cases}  # fmt: skip
            write_outputs(args.output, doc, md)
    print(args.output.with_suffix(".md").read_text())
    return 0


def case_markdown(
    reports: dict[str, FidelityReport], extra: dict[str, Any], load: float, n: int
) -> list[str]:
    """The tables of one load: end to end and decomposition, per pricing."""
    cli = extra["cli"]
    md = [f"### {n} requests, {load:.0%} load ({extra['rate_req_s']:.3f} req/s)", ""]
    for pricing, report in reports.items():
        md += [
            f"**{pricing}**: {PRICINGS[pricing]}. (sim - real) / real (± real-vs-real noise "
            "floor; * = inside the vLLM runs' 95% CI):", "", markdown_table(report, METRICS), "",
            decomposition_table(report), "",
        ]  # fmt: skip
    md += [
        f"`rose-sim` CLI on the same trace (fifo, calibration pricing) vs the in-process "
        f"simulation: largest relative difference of p50/p99 TTFT and E2EL {cli['max_rel_diff']:.1e}.",
        "",
    ]  # fmt: skip
    return md


def write_outputs(output: Path, doc: dict[str, Any], md: list[str]) -> None:
    """OUTPUT.json (everything) and OUTPUT.md (header + the tables of each load)."""
    before, after = doc["machine_before"], doc["machine_after"]
    head = [
        f"`{before['command']}`", "",
        f"{before['machine']}; load average (1 min) {before['load_average'][0]:.2f} before, "
        f"{after['load_average'][0]:.2f} after; {doc['wall_s']:.0f} s wall.", "",
        f"vLLM: {doc['engine']}.", "", f"Workload: {doc['workload']}.", "",
        f"Cost model (vLLM step logs {', '.join(Path(p).name for p in doc['calibration']['step_logs'])}): "
        f"{doc['calibration']['cost_model']}; capacity {doc['calibration']['capacity_req_s']:.3f} req/s.", "",
    ]  # fmt: skip
    output.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    output.with_suffix(".md").write_text("\n".join(head + md) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
