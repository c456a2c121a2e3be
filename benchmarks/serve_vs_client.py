"""``rose-serve`` measured by vLLM's client (``vllm bench serve``), next to its own records.

For each model (tiny GPT-2 and GPT-2 124M, random weights, CPU): save the
model's synthetic tokenizer to a directory (the client builds its random
prompts with it and the server encodes them back to the same ids), start
``rose-serve --save-records``, run ``vllm bench serve --backend openai
--dataset-name random --ignore-eos`` against it from the vLLM venv, stop the
server, and print the client's TTFT/ITL/E2EL (mean, median, p99, ms) beside the
same statistics from the server's records of the same requests. The client
times HTTP chunks (send to first chunk, chunk to chunk); the server times from
``add_request`` to each token's step end, so the client's figures should be
larger by the HTTP, JSON and event-loop overhead only.

    python benchmarks/serve_vs_client.py            # both models
    python benchmarks/serve_vs_client.py --models tiny-gpt2 --num-prompts 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve_common import ServeProcess  # noqa: E402

from roseinfer.executor.models import builtin_config  # noqa: E402
from roseinfer.serve.tokenizer import save_synthetic_tokenizer  # noqa: E402

VLLM_PY = Path("/work/venvs/vllm/bin/python")
SHIM = Path(__file__).resolve().parent / "_vllm_bench_serve.py"
# model -> (input len, output len, prompts, request rate req/s, --max-num-seqs)
SETUPS = {
    "tiny-gpt2": (128, 64, 64, 8.0, 32),
    "gpt2": (256, 32, 32, 2.0, 16),
}
METRICS = ("ttft", "itl", "e2el")


def server_stats(records: pd.DataFrame, num: int) -> dict[str, list[float]]:
    """Per-request TTFT and E2EL, and every ITL (ms), of the last ``num`` finished
    requests by arrival (the client's first request is its readiness probe)."""
    done = records[records["status"] == "finished"].sort_values("arrival_s").tail(num)
    times = [np.asarray(t, dtype=float) for t in done["token_times_s"]]
    return {
        "ttft": list((done["first_token_s"] - done["arrival_s"]) * 1e3),
        "itl": [x * 1e3 for t in times for x in np.diff(t)],
        "e2el": list((done["finish_s"] - done["arrival_s"]) * 1e3),
    }


def run_one(model: str, args: argparse.Namespace, work: Path) -> list[dict[str, object]]:
    config = builtin_config(model)
    in_len, out_len, num, rate, seqs = SETUPS[model]
    num = args.num_prompts or num
    tok_dir = save_synthetic_tokenizer(
        work / f"tok-{model}", config.vocab_size, config.eos_token_id
    )
    records_path = work / f"records-{model}.csv"
    server = ServeProcess(
        ["--model", model, "--device", "cpu", "--num-threads", str(args.threads),
         "--tokenizer", str(tok_dir), "--max-num-seqs", str(seqs),
         "--save-records", str(records_path)],
        work / f"serve-{model}.log",
    )  # fmt: skip
    cmd = [
        str(VLLM_PY), str(SHIM), "--backend", "openai", "--base-url", server.url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tok_dir),
        "--dataset-name", "random", "--random-input-len", str(in_len),
        "--random-output-len", str(out_len), "--random-range-ratio", "0",
        "--num-prompts", str(num), "--request-rate", str(rate), "--seed", "0",
        "--ignore-eos", "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(work), "--result-filename", f"client-{model}.json",
        "--disable-tqdm",
    ]  # fmt: skip
    try:
        start = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        bench_s = time.perf_counter() - start
    finally:
        server.stop()
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    client = json.loads((work / f"client-{model}.json").read_text())
    ours = server_stats(pd.read_csv(records_path, converters={"token_times_s": _floats}), num)
    rows = []
    for metric in METRICS:
        vals = ours[metric]
        rows.append(
            {
                "model": model,
                "metric": metric,
                "client mean": client[f"mean_{metric}_ms"],
                "server mean": float(np.mean(vals)),
                "client p50": client[f"median_{metric}_ms"],
                "server p50": float(np.median(vals)),
                "client p99": client[f"p99_{metric}_ms"],
                "server p99": float(np.percentile(vals, 99)),
            }
        )
    print(
        f"{model}: {num} requests, random {in_len} in / {out_len} out, {rate} req/s (Poisson), "
        f"completed {client['completed']}/{num}, output {client['output_throughput']:.1f} tok/s, "
        f"client wall {bench_s:.0f} s",
        flush=True,
    )
    return rows


def _floats(cell: str) -> list[float]:
    cell = cell.strip().strip("[]")
    return [float(x) for x in cell.replace(",", " ").split()] if cell else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--num-prompts", type=int, help="override the per-model count")
    parser.add_argument("--threads", type=int, default=2, help="server torch threads")
    args = parser.parse_args()
    if not VLLM_PY.exists():
        print(f"serve_vs_client: {VLLM_PY} not found; vLLM's client is needed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="serve_vs_client_"))
    rows = [row for model in args.models for row in run_one(model, args, work)]
    table = pd.DataFrame(rows)
    print(f"load1 {os.getloadavg()[0]:.2f}, nproc {os.cpu_count()}, files in {work}")
    print("| " + " | ".join(table.columns) + " |")
    print("|" + "---|" * len(table.columns))
    for row in table.itertuples(index=False):
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in row]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
