"""Which step model reproduces a run from its own step log, and the other policy's run.

The workload of the step-log acceptance check (``../shared/checks/11-fidelity-steplog``),
rebuilt from the embedded Azure conv sample: its first 16 requests, prompts / 4
clipped to 8..900 tokens, outputs clipped to 4..64, Poisson arrivals at 0.12 req/s
(seed 7; ``--request-rate``). Each round runs ``rose-run --device cpu --model gpt2 --save-steps`` under
``fifo`` and under ``pack --prefill-max-tokens 256 --force-fifo-every 8
--loop-order decode-first``, in fresh processes. Then every step log prices
``rose-sim`` on the same requests, under its own policy ("same": the check) and
the other one ("cross": a what-if), once per step-model candidate (the selection
rule replaced by the candidate's name), once as the plain rule chooses (the
held-out rule, which a profile's grid gets) and once as shipped (step logs use
:data:`~roseinfer.calibration.step_model.STEP_LOG_MODEL`).

The table gives, per model, the mean and the worst relative error over p50/p99
TTFT, TPOT and E2EL, and how many same-policy simulations meet the check's bars
(p50 within 5%, p99 within 10%). Run it on a quiet machine::

    ../shared/tools/quiet -- python benchmarks/steplog_candidates.py --rounds 4
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

POLICIES = {
    "fifo": ["--policy", "fifo"],
    "pack/decode-first": ["--policy", "pack", "--prefill-max-tokens", "256",
                          "--force-fifo-every", "8", "--loop-order", "decode-first"],
}  # fmt: skip
METRICS = [f"{q}_{m}_ms" for m in ("ttft", "tpot", "e2el") for q in ("median", "p99")]
BARS = {k: 0.05 if k.startswith("median") else 0.10 for k in METRICS}
MODELS = ("plain rule", "shipped", "linear", "hinge", "interp")


def write_workload(path: Path, num_requests: int, rate: float) -> None:
    """The check's requests, from the embedded trace (its first ``num_requests`` rows),
    Poisson arrivals at ``rate`` requests/s."""
    from roseinfer.workloads.traces import load_default_trace

    rng, t = random.Random(7), 0.0
    with path.open("w") as f:
        f.write("arrival_s,prompt_tokens,output_tokens\n")
        for r in load_default_trace()[:num_requests]:
            prompt = max(8, min(900, r.num_prompt_tokens // 4))
            output = max(4, min(64, r.max_output_tokens))
            f.write(f"{t:.3f},{prompt},{output}\n")
            t += rng.expovariate(rate)


def real_run(trace: Path, policy: str, out: Path, model: str) -> tuple[Path, dict]:
    """One ``rose-run --save-steps`` in a fresh process: its step log and result."""
    steps, result = out / "steps.jsonl", out / "result.json"
    cmd = [sys.executable, "-m", "roseinfer.cli.run", "--device", "cpu", "--model", model,
           "--trace", str(trace), *POLICIES[policy], "--save-steps", str(steps),
           "--save-result", str(result), "--quiet", "--no-summary"]  # fmt: skip
    subprocess.run(cmd, check=True)
    return steps, json.loads(result.read_text())


def simulate(steps: Path, trace: Path, policy: str, model: str, out: Path) -> dict:
    """``rose-sim --cost-model STEPS`` in this process, priced by step model ``model``."""
    import roseinfer.calibration.profile as profile
    import roseinfer.calibration.step_model as step_model
    from roseinfer.cli.sim import main

    select, use = step_model._select, profile.STEP_LOG_MODEL
    if model == "plain rule":
        profile.STEP_LOG_MODEL = None  # type: ignore[misc]
    elif model != "shipped":
        profile.STEP_LOG_MODEL = None  # type: ignore[misc]
        step_model._select = lambda held_out: model
    sys.argv = ["rose-sim", "--cost-model", str(steps), "--trace", str(trace),
                *POLICIES[policy], "--save-result", str(out), "--quiet", "--no-summary"]  # fmt: skip
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            code = main()
    except SystemExit as stop:
        code = stop.code
    finally:
        step_model._select, profile.STEP_LOG_MODEL = select, use
    if code:
        raise SystemExit(f"rose-sim --cost-model {steps} failed ({code})")
    return json.loads(out.read_text())


def errors(sim: dict, real: dict) -> dict[str, float]:
    """(sim - real) / real of every metric."""
    return {k: (sim[k] - real[k]) / real[k] for k in METRICS}


def main() -> int:
    """Run ``--rounds`` rounds of both policies, price every log, print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="real runs per policy (default 2)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--model", default="gpt2")
    p.add_argument("--request-rate", type=float, default=0.12, help="req/s (default 0.12)")
    args = p.parse_args()
    same: dict[str, list[dict[str, float]]] = {m: [] for m in MODELS}
    cross: dict[str, list[dict[str, float]]] = {m: [] for m in MODELS}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "w.csv"
        write_workload(trace, args.num_requests, args.request_rate)
        for i in range(args.rounds):
            runs = {}
            for policy in POLICIES:
                out = Path(tmp) / f"{i}-{policy.replace('/', '-')}"
                out.mkdir()
                runs[policy] = real_run(trace, policy, out, args.model)
            for policy, (_, real) in runs.items():
                for source, (steps, _) in runs.items():
                    into = same if source == policy else cross
                    for m in MODELS:
                        sim = simulate(steps, trace, policy, m, Path(tmp) / "sim.json")
                        into[m].append(errors(sim, real))
    print(f"{args.rounds} rounds x {len(POLICIES)} policies, {args.num_requests} requests, "
          f"{args.model} on {platform.machine()} CPU, Python {platform.python_version()}")  # fmt: skip
    print(
        "| step model | same: mean / worst error | same: check bars met | "
        "cross: mean / worst error |"
    )
    print("|---|---|---|---|")
    for m in MODELS:
        s = np.abs([[e[k] for k in METRICS] for e in same[m]])
        c = np.abs([[e[k] for k in METRICS] for e in cross[m]])
        met = sum(all(abs(e[k]) <= BARS[k] for k in METRICS) for e in same[m])
        print(
            f"| {m} | {s.mean():.1%} / {s.max():.1%} | {met}/{len(same[m])} | "
            f"{c.mean():.1%} / {c.max():.1%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
