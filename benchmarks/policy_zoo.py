"""The policy-family figures of the README, each from CLI runs.

1. Fairness: two tenants (heavy 20 req/s, light 2 req/s, same lengths, 120 s)
   in rose-sim (llama-3.1-8b on a100-80gb): light tenant's p99 TTFT, fifo vs vtc.
2. Same direction in rose-run on tiny-llama (CPU): a scaled two-tenant trace
   (heavy 100 req/s, light 10 req/s for 3 s, prompts 32-128, outputs 8-32,
   --max-num-seqs 8). Skip with --no-run (about 2 minutes on 2 shared cores).
3. Priority under overload: 3,000 requests at 25 req/s, 10% priority 0, the
   rest priority 1 (rose-sim, llama-3.1-8b, a100-80gb): urgent vs other p99 TTFT.
4. Length-aware: the embedded Azure conv sample (2,000 requests) re-drawn at
   10 req/s (rose-sim, llama-3.1-8b, a100-80gb): mean E2EL of fifo and sjf with
   the oracle, noisy-oracle (sigma 0.5) and bucket (fitted on the first 20%,
   which are replayed too) predictors.

Usage: ``python benchmarks/policy_zoo.py [--no-run]``. The simulator is
deterministic, so its figures repeat exactly; rose-run's are wall-clock.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from roseinfer import workloads

SIM = ["rose-sim", "--model", "llama-3.1-8b", "--hardware", "a100-80gb", "--quiet", "--no-summary"]


def run(cmd: list[str], out: Path) -> pd.DataFrame:
    """Run a CLI writing records to ``out``; its records."""
    print("$", " ".join(cmd + ["--save-records", out.name]), flush=True)
    subprocess.run([*cmd, "--save-records", str(out)], check=True, stdout=subprocess.DEVNULL)
    return pd.read_csv(out)


def p99_ttft_ms(df: pd.DataFrame) -> float:
    """p99 TTFT (ms) of the finished rows."""
    return float(((df.first_token_s - df.arrival_s) * 1000).quantile(0.99))


def write_trace(reqs: list, path: Path) -> None:
    """A plain CSV trace with tenant and priority columns."""
    with path.open("w") as f:
        f.write("arrival_s,prompt_tokens,output_tokens,tenant,priority\n")
        for r in reqs:
            tenant = r.tenant or ""
            f.write(
                f"{r.arrival_time_s:.4f},{r.num_prompt_tokens},{r.max_output_tokens},{tenant},{r.priority}\n"
            )


def fairness(tmp: Path) -> None:
    """Figure 1."""
    light = {}
    for policy in ("fifo", "vtc"):
        df = run([*SIM, "--workload", "two-tenant", "--policy", policy], tmp / f"tt-{policy}.csv")
        light[policy] = p99_ttft_ms(df[df.tenant == "light"])
        heavy = p99_ttft_ms(df[df.tenant == "heavy"])
        print(f"  {policy}: light p99 TTFT {light[policy]:.0f} ms, heavy {heavy:.0f} ms")
    print(f"  vtc / fifo (light tenant p99 TTFT): {light['vtc'] / light['fifo']:.3f}")


def fairness_real(tmp: Path) -> None:
    """Figure 2."""
    specs = [
        workloads.GroupSpec("heavy", 100, (32, 128), (8, 32), tenant="heavy"),
        workloads.GroupSpec("light", 10, (32, 128), (8, 32), tenant="light"),
    ]
    trace = tmp / "tt-small.csv"
    write_trace(workloads.groups(specs, 3.0, seed=1), trace)
    base = ["rose-run", "--model", "tiny-llama", "--device", "cpu", "--trace", str(trace)]
    for policy in ("fifo", "vtc"):
        df = run(
            [*base, "--max-num-seqs", "8", "--policy", policy, "--quiet", "--no-summary"],
            tmp / f"run-{policy}.csv",
        )
        print(
            f"  rose-run {policy}: light p99 TTFT {p99_ttft_ms(df[df.tenant == 'light']):.0f} ms, "
            f"heavy {p99_ttft_ms(df[df.tenant == 'heavy']):.0f} ms"
        )


def priority(tmp: Path) -> None:
    """Figure 3 (the workload of ../shared/checks/06-priority)."""
    rng, t, rows = random.Random(5), 0.0, []
    for _ in range(3000):
        t += rng.expovariate(25.0)
        rows.append(
            (t, rng.randint(200, 1500), rng.randint(50, 300), 0 if rng.random() < 0.1 else 1)
        )
    trace = tmp / "prio.csv"
    trace.write_text(
        "arrival_s,prompt_tokens,output_tokens,priority\n"
        + "".join(f"{a:.4f},{p},{o},{c}\n" for a, p, o, c in rows)
    )
    for policy in ("fifo", "priority"):
        df = run([*SIM, "--trace", str(trace), "--policy", policy], tmp / f"prio-{policy}.csv")
        urgent, other = p99_ttft_ms(df[df.priority == 0]), p99_ttft_ms(df[df.priority != 0])
        print(
            f"  {policy}: urgent p99 TTFT {urgent:.0f} ms, others {other:.0f} ms, "
            f"preemptions {int(df.num_preemptions.sum())}"
        )


def length_aware(tmp: Path) -> None:
    """Figure 4."""
    base = [*SIM, "--request-rate", "10"]
    runs = {"fifo": ["--policy", "fifo"]}
    for predictor in ("oracle", "noisy-oracle", "bucket", "none"):
        runs[f"sjf+{predictor}"] = ["--policy", "sjf", "--length-predictor", predictor]
    means = {}
    for label, flags in runs.items():
        df = run([*base, *flags], tmp / f"azure-{label}.csv")
        done = df[df.status == "finished"]
        means[label] = float(((done.finish_s - done.arrival_s) * 1000).mean())
    gain = means["fifo"] - means["sjf+oracle"]
    for label, mean in means.items():
        kept = (means["fifo"] - mean) / gain if gain else float("nan")
        print(
            f"  {label:<18} mean E2EL {mean:8.0f} ms  ({mean / means['fifo'] - 1:+.1%} vs fifo; "
            f"{kept:.0%} of the oracle's gain)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-run", action="store_true", help="skip the rose-run figure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        print("1. two tenants, rose-sim")
        fairness(tmp)  # noqa: E702
        if not args.no_run:
            print("2. two tenants, rose-run tiny-llama cpu")
            fairness_real(tmp)  # noqa: E702
        print("3. priority under overload, rose-sim")
        priority(tmp)  # noqa: E702
        print("4. sjf on Azure conv @ 10 req/s, rose-sim")
        length_aware(tmp)  # noqa: E702
    return 0


if __name__ == "__main__":
    sys.exit(main())
