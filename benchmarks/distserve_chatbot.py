"""DistServe's chatbot case in the simulator: goodput per GPU, colocated vs disaggregated.

DistServe (Zhong et al., OSDI'24, Figure 8 top left; its artifact's plotting
script ``evaluation/ae-scripts/e2e/_plot.py``) serves OPT-13B on A100-80GB
GPUs with ShareGPT chat requests, at SLOs of TTFT <= 0.25 s and TPOT <= 0.1 s
with 90% attainment, and compares the highest per-GPU request rate meeting them:
DistServe on 3 GPUs (prefill and decode instances) against vLLM on 1.

Here the same question goes to ``rose-sim capacity`` (bisection on the Poisson
rate, DistServe's attainment definition), for colocated replicas (the 2023 vLLM
scheduler: whole prefills first; and today's chunked mixed steps) and for
prefill/decode layouts, the paper's placement (a 2-GPU tensor-parallel prefill
instance and a 1-GPU decode instance) among them. KV moves over NVLink 3
(A100 nodes; DistServe places 13B's instances in one node).

Workloads (ShareGPT itself is not on this machine), two chat length mixes:

- ``sharegpt-like``: log-normal lengths with ShareGPT's means as the vLLM
  paper reports them (Kwon et al., SOSP'23, Fig. 11: 161.31 prompt and 337.99
  output tokens on average, OPT tokenizer); the spread (sigma = 1) is an
  assumption. Short prompts: prefill is a small share of the work.
- ``azure-conv``: the Azure LLM inference conversation trace 2023 (a real chat
  service; ``azure-conv-2023``, fetched once, else the embedded first 2,000 rows), prompts
  of 1,155 tokens on average: prefill-heavy, as chat with history is.

Both are clipped to OPT-13B's 2,048-token context (``--fit-lengths clip``).

Usage::

    python benchmarks/distserve_chatbot.py                         # both workloads, seed 0
    python benchmarks/distserve_chatbot.py --workload azure-conv --seeds 0 1 2

Prints one row per layout (capacity in req/s, per GPU, and the ratio to the
colocated 1-GPU baseline) and the paper's figure next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from roseinfer.cli.capacity import capacity_main

SHAREGPT_MEAN_PROMPT = 161.31  # vLLM paper (SOSP'23), Fig. 11, ShareGPT
SHAREGPT_MEAN_OUTPUT = 337.99
LENGTH_SIGMA = 1.0  # assumption: log-normal spread
OPT_CONTEXT = 2048
SLOS = ["ttft:250", "tpot:100"]  # DistServe's chatbot SLOs for OPT-13B (s -> ms)
PAPER = (
    "paper: DistServe (OSDI'24) reports up to 7.4x more requests than colocated serving "
    "over all its workloads (abstract); its Fig. 8 gives the OPT-13B chatbot ratio (DistServe "
    "on 3 GPUs vs vLLM on 1), whose exact value is not reproduced here"
)
COMMON = ["--model", "opt-13b", "--hardware", "a100-80gb", "--kv-transfer-link", "nvlink3",
          "--fit-lengths", "clip", "--backend", "serial", "--quiet"]  # fmt: skip
PAPER_PLACEMENT = (
    '[[replica]]\nrole = "prefill"\ntensor_parallel_size = 2\n\n[[replica]]\nrole = "decode"\n'
)
TP2 = "[[replica]]\ntensor_parallel_size = 2\n"
BOTH_TP2 = PAPER_PLACEMENT + "tensor_parallel_size = 2\n"


def layouts(work: Path) -> list[tuple[str, list[str]]]:
    """(label, rose-sim capacity flags) of every setup compared."""
    (work / "paper.toml").write_text(PAPER_PLACEMENT)
    (work / "tp2.toml").write_text(TP2)
    (work / "both-tp2.toml").write_text(BOTH_TP2)
    return [
        ("colocated, whole prefills first (vLLM 2023)", ["--pd-ratios", "1"]),
        ("colocated, chunked mixed steps (vLLM v1)", ["--scheduler-preset", "vllm-v1",
                                                      "--pd-ratios", "1"]),
        ("colocated, TP2, whole prefills first", ["--replica-config", str(work / "tp2.toml")]),
        ("disaggregated P:D", ["--pd-ratios", "1:1", "2:1", "1:2"]),
        ("disaggregated, the paper's placement", ["--replica-config", str(work / "paper.toml")]),
        ("disaggregated, both TP2", ["--replica-config", str(work / "both-tp2.toml")]),
    ]  # fmt: skip


def trace_file(workload: str, num: int, seed: int, work: Path) -> Path:
    """The workload as a trace file ``rose-sim capacity --trace`` reads."""
    if workload == "azure-conv":
        from roseinfer import workloads

        try:
            return workloads.resolve_trace("azure-conv-2023")
        except workloads.WorkloadError as err:
            print(f"distserve_chatbot.py: {err}; using the embedded sample", file=sys.stderr)
        reqs = workloads.load_default_trace()
        frame = pd.DataFrame({"arrival_s": [r.arrival_time_s for r in reqs],
                              "prompt_tokens": [r.num_prompt_tokens for r in reqs],
                              "output_tokens": [r.max_output_tokens for r in reqs]})  # fmt: skip
    else:
        frame = sharegpt_like(num, seed)
    path = work / f"{workload}-{seed}.csv"
    frame.to_csv(path, index=False)
    return path


def sharegpt_like(num: int, seed: int) -> pd.DataFrame:
    """``num`` requests with ShareGPT-like lengths (see the module docstring), as a
    plain trace (arrivals are re-drawn by the capacity search)."""
    rng = np.random.default_rng(seed)

    def draw(mean: float) -> np.ndarray:
        mu = np.log(mean) - LENGTH_SIGMA**2 / 2  # a log-normal with this mean
        return np.maximum(1, np.round(rng.lognormal(mu, LENGTH_SIGMA, num))).astype(int)

    prompt = np.minimum(draw(SHAREGPT_MEAN_PROMPT), OPT_CONTEXT - 1)
    output = np.minimum(draw(SHAREGPT_MEAN_OUTPUT), OPT_CONTEXT - prompt)
    return pd.DataFrame({"arrival_s": np.arange(num) * 0.1, "prompt_tokens": prompt,
                         "output_tokens": output})  # fmt: skip


def scaled_slos(scale: float) -> list[str]:
    """The paper's SLOs times ``scale`` (its Fig. 8 bottom row tightens them so)."""
    return [f"{name}:{float(ms) * scale:g}" for name, ms in (s.split(":") for s in SLOS)]


def capacities(trace: Path, seed: int, work: Path, slos: list[str]) -> pd.DataFrame:
    """Capacity rows of every layout for one seed."""
    frames = []
    for i, (label, flags) in enumerate(layouts(work)):
        out = work / f"cap{seed}-{i}.csv"
        argv = ["--trace", str(trace), "--seed", str(seed), *COMMON, "--goodput", *slos, *flags,
                "--output", str(out)]  # fmt: skip
        with contextlib.redirect_stdout(io.StringIO()):
            code = capacity_main(argv)
        if code != 0:
            raise SystemExit(f"capacity failed for {label}")
        frame = pd.read_csv(out, dtype={"replicas": str})
        frame.insert(0, "setup", label)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def summarize_runs(rows: list[pd.DataFrame]) -> pd.DataFrame:
    """Mean (and min-max over seeds) capacity per setup, and its ratio to the best
    colocated setup per GPU."""
    table = (
        pd.concat(rows, ignore_index=True)
        .groupby(["setup", "replicas"], sort=False)
        .agg(num_gpus=("num_gpus", "first"), capacity_rate=("capacity_rate", "mean"),
             per_gpu=("capacity_per_gpu", "mean"), per_gpu_min=("capacity_per_gpu", "min"),
             per_gpu_max=("capacity_per_gpu", "max"))
        .reset_index()
    )  # fmt: skip
    colocated = table[table["setup"].str.startswith("colocated")]["per_gpu"].max()
    table["vs_best_colocated"] = table["per_gpu"] / colocated if colocated > 0 else float("nan")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=["sharegpt-like", "azure-conv", "both"],
                        default="both")  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=4000,
                        help="sharegpt-like: requests drawn (the length pool)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--slo-scale", type=float, default=1.0,
                        help="multiply both SLOs (DistServe Fig. 8 bottom: tighter SLOs)")  # fmt: skip
    args = parser.parse_args()
    slos = scaled_slos(args.slo_scale)
    names = ["sharegpt-like", "azure-conv"] if args.workload == "both" else [args.workload]
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            rows = [capacities(trace_file(name, args.num_requests, seed, work), seed, work, slos)
                    for seed in args.seeds]  # fmt: skip
        table = summarize_runs(rows)
        print(f"\n{name}: OPT-13B on A100-80GB, SLOs {' '.join(slos)} ms at 90% attainment, "
              f"steady-state capacity, seeds {args.seeds}")  # fmt: skip
        print(table.round(3).to_string(index=False))
        split = table[table["setup"].str.startswith("disaggregated")]["vs_best_colocated"]
        print(f"best disaggregated per-GPU rate / best colocated per-GPU rate: {split.max():.2f}x")
    print(PAPER)


if __name__ == "__main__":
    main()
