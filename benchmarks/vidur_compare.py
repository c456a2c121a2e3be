"""Simulation speed: rose-sim against Vidur on the same trace, measured in one run.

Vidur (Microsoft's LLM-inference simulator, PyPI package ``vidur``) is run from
its own virtual environment (``--vidur-python``) as a subprocess; rose-sim runs
from this repository's. Both replay the same trace, in the same script run so
that they share the machine's load: by default the whole Azure conv 2023 trace
(19,366 requests, ``azure-conv-2023``, fetched and cached on first use), or its
first ``--num-requests``.

The two configs, as close as the simulators allow:

* one replica, one device, no tensor or pipeline parallelism;
* Llama-3-8B (Vidur's ``meta-llama/Llama-3-8B``; rose-sim's ``llama-3.1-8b``,
  the same shapes) on an A100 80GB (Vidur ``a100`` on an ``a100_dgx`` node;
  rose-sim ``a100-80gb``), or ``--device h100-sxm`` (``h100`` / ``h100_dgx``);
* vLLM-style scheduling: Vidur's ``vllm`` replica scheduler, rose-sim's
  ``fifo`` policy; batch cap ``--max-num-seqs`` (Vidur ``batch_size_cap``,
  128 by default, the most Vidur's predictor grid covers); no prefill token
  budget on either (Vidur ``max_tokens_in_batch`` set to 16,384, above the
  trace's longest request); 90% of device memory for weights + KV;
* the trace's own arrival times and token counts: Vidur's ``trace_replay``
  generator with every scale factor 1 and ``max_tokens`` 16,384, so nothing is
  clipped (its defaults scale prompts by 0.3 and time by 0.04).

Vidur's costs come from random-forest predictors it trains on GPU profiling
data. The PyPI wheel ships no profiling data: it downloads it from Hugging Face
datasets at start-up, which a machine reaching only package registries cannot.
So this script needs one of:

* ``--vidur-data DIR``: real Vidur profiling data, either a Vidur checkout's
  ``data`` folder (``DIR/profiling/compute/<a100|h100>/meta-llama/<Llama-3-8B
  or Meta-Llama-3-8B>/{mlp,attention}.csv``) or a folder holding those two
  files (``.csv`` or ``.csv.xz``) directly, as the Hugging Face dataset does;
* ``--synthetic-profile``: profiling tables made up here from rose-sim's
  roofline (per-op FLOPs and bytes over the device's achievable peaks, its
  per-step overhead spread over the layers), so both simulators see similar
  step times and run batch counts of the same order (conv trace on an A100:
  about 123k Vidur batches against 146k rose-sim steps; the two schedulers
  still differ, and Vidur's mean end-to-end latency comes out about twice
  rose-sim's). The latencies Vidur reports are then not Vidur's calibrated
  ones; the speed of its simulation loop is what is measured.

Without either it prints why and exits 0. The data goes into an offline
Hugging Face cache under ``--vidur-cache`` (default ``/tmp/vidur_compare_cache``),
and Vidur runs with ``HF_HUB_OFFLINE=1`` and wandb disabled: it sends nothing.

Vidur runs twice. The first run is cold when ``--vidur-cache`` holds no
predictors for these profiles yet: Vidur then trains its random forests (a
grid search, 10-fold, per op: about 20 minutes on 2 cores) and predicts its
lookup tables, and caches both; the second run is warm (cache hit). Each Vidur
row gives the process wall time and, inside it, the set-up (imports, trace,
predictors) and the simulation loop; rose-sim's row gives its process wall
time and, inside it, its simulation time.
Vidur's chrome trace and plots are switched off (rose-sim writes neither); its
metrics store still collects per-request and per-batch metrics and writes them
as CSV, as rose-sim's records do.

    python benchmarks/vidur_compare.py --vidur-python /tmp/vidur-venv/bin/python \\
        --synthetic-profile
    python benchmarks/vidur_compare.py --vidur-python /tmp/vidur-venv/bin/python \\
        --vidur-data ~/vidur/data --num-requests 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from roseinfer import workloads

ROOT = Path(__file__).resolve().parents[1]
TRACE = "azure-conv-2023"
ROSE_SIM = Path(sys.executable).with_name("rose-sim")
ROSE_MODEL = "llama-3.1-8b"
VIDUR_MODEL = "meta-llama/Llama-3-8B"
VIDUR_MODEL_DIRS = ("Llama-3-8B", "Meta-Llama-3-8B")
# rose-sim device -> (Vidur device SKU, Vidur network/node SKU)
DEVICES = {"a100-80gb": ("a100", "a100_dgx"), "h100-sxm": ("h100", "h100_dgx")}
MAX_TOKENS = 16384  # above the conv trace's longest request (14,089 tokens)
BLOCK_SIZE = 16  # Vidur's and rose-sim's default KV block
GPU_MEMORY_UTILIZATION = 0.9  # rose-sim's default (vLLM's); Vidur's is 0.8
COMPUTE_DATASET = "vidur-compare/compute-profile"
NETWORK_DATASET = "vidur-compare/network-profile"
NO_DATA = (
    "Vidur cannot run here without its profiling data: the PyPI wheel (vidur {version}) ships "
    "none and downloads it from Hugging Face datasets at start-up "
    "(project-vajra/dev-staging-meta-llama-llama-3-8b-h100 and project-vajra/dev-staging-h100-dgx "
    "by default), which this machine cannot reach. Point --vidur-data at a Vidur checkout's data "
    "folder, or pass --synthetic-profile to time Vidur on roofline-made profiles."
)

# Runs inside Vidur's interpreter: times import, predictor set-up, the event
# loop and the output writing, then prints one JSON line.
_VIDUR_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from vidur.config import SimulationConfig
from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
from vidur.simulator import Simulator
from vidur.utils.random import set_seeds
import vidur
t1 = time.perf_counter()
config = SimulationConfig.create_from_cli_args()
set_seeds(config.seed)
phases = {}
_get = ExecutionTimePredictorRegistry.get.__func__
def timed_get(cls, *a, **k):
    s = time.perf_counter()
    out = _get(cls, *a, **k)
    phases["predictor_s"] = phases.get("predictor_s", 0.0) + time.perf_counter() - s
    return out
ExecutionTimePredictorRegistry.get = classmethod(timed_get)
sim = Simulator(config)
t2 = time.perf_counter()
batches = [0]
replica_scheduler = next(iter(sim.scheduler._replica_schedulers.values()))
_on_end = replica_scheduler.on_batch_end
def counted_on_end(batch):
    batches[0] += 1
    return _on_end(batch)
replica_scheduler.on_batch_end = counted_on_end
_write = sim._write_output
def timed_write():
    s = time.perf_counter()
    _write()
    phases["write_s"] = time.perf_counter() - s
sim._write_output = timed_write
sim.run()
t3 = time.perf_counter()
print("VIDUR_RESULT " + json.dumps({
    "version": getattr(vidur, "__version__", "?"),
    "import_s": t1 - t0, "init_s": t2 - t1, "predictor_s": phases.get("predictor_s", 0.0),
    "loop_s": t3 - t2 - phases.get("write_s", 0.0), "write_s": phases.get("write_s", 0.0),
    "num_batches": batches[0], "simulated_s": sim._time,
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def load_trace(path: Path, num_requests: int | None) -> pd.DataFrame:
    """The Azure trace as (arrival s from the first request, prompt tokens, output tokens)."""
    df = pd.read_csv(path, parse_dates=["TIMESTAMP"])
    if num_requests:
        df = df.head(num_requests)
    arrival = (df.TIMESTAMP - df.TIMESTAMP.iloc[0]).dt.total_seconds()
    return pd.DataFrame(
        {"arrival_s": arrival, "prompt": df.ContextTokens, "output": df.GeneratedTokens}
    )


def write_vidur_trace(trace: pd.DataFrame, path: Path) -> None:
    """Vidur's ``trace_replay`` format: Date, Time (s), PromptTokenCount, CompletionTokenCount."""
    pd.DataFrame(
        {
            "Date": "2023-11-16",
            "Time": trace.arrival_s,
            "PromptTokenCount": trace.prompt,
            "CompletionTokenCount": trace.output,
        }
    ).to_csv(path, index=False)


def roofline_profiles(device_name: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Vidur-format ``mlp`` and ``attention`` tables (ms per layer) from rose-sim's roofline.

    Every op is ``max(FLOPs / achievable FLOP/s, bytes / achievable B/s)``: the
    linear layers stream their weights (the LM head's share is added to the
    down projection), element-wise ops stream activations, attention reads the
    context's KV; rose-sim's per-step overhead is spread over the layers' adds.
    """
    sys.path.insert(0, str(ROOT))
    from roseinfer.calibration.specs import get_device_spec
    from roseinfer.simulator.setup import load_model_spec

    m, d = load_model_spec(ROSE_MODEL), get_device_spec(device_name)
    flops_s, bytes_s, dt = d.achievable_flops, d.achievable_bandwidth, m.dtype_bytes
    h, hd, layers = m.hidden_size, m.head_dim, m.num_layers
    q_width, kv_width = m.num_attention_heads * hd, m.num_kv_heads * hd
    kv_bytes = 2 * kv_width * dt  # K and V of one token in one layer

    def linear_ms(n: np.ndarray, params: float, extra_bytes: float = 0.0) -> np.ndarray:
        compute = 2 * n * params / flops_s
        memory = (params * dt + extra_bytes + n * dt * h * 2) / bytes_s
        return np.maximum(compute, memory) * 1e3

    n = np.unique(np.r_[np.arange(1, 129), np.arange(128, MAX_TOKENS + 1, 32)]).astype(float)
    elementwise = n * h * dt * 2 / bytes_s * 1e3
    mlp_width = m.intermediate_size * (2 if m.gated_mlp else 1)
    ops = {
        "attn_pre_proj": linear_ms(n, h * (q_width + 2 * kv_width)),
        "attn_post_proj": linear_ms(n, q_width * h),
        "mlp_up_proj": linear_ms(n, h * mlp_width),
        "mlp_down_proj": linear_ms(n, m.intermediate_size * h, m.vocab_size * h * dt / layers),
        "mlp_act": elementwise,
        "input_layernorm": elementwise,
        "post_attention_layernorm": elementwise,
        "attn_rope": elementwise,
        "add": elementwise + d.overhead_s * 1e3 / layers,
    }
    mlp = pd.DataFrame({f"time_stats.{op}.median": t for op, t in ops.items()})
    mlp = mlp.assign(
        n_head=m.num_attention_heads,
        n_kv_head=m.num_kv_heads,
        n_embd=h,
        n_expanded_embd=m.intermediate_size,
        vocab_size=m.vocab_size,
        use_gated_mlp=m.gated_mlp,
        num_tokens=n.astype(int),
        num_tensor_parallel_workers=1,
    )

    rows = []
    chunks = np.r_[32, 64, 128, 256, 512, np.arange(1024, MAX_TOKENS + 1, 512)]
    for kv in np.arange(0, MAX_TOKENS + 1, 1024):
        for chunk in chunks[chunks + kv <= MAX_TOKENS]:
            pairs = chunk * kv + chunk * (chunk + 1) / 2
            t = max(4 * q_width * pairs / flops_s, (kv + chunk) * kv_bytes / bytes_s)
            rows.append((1, int(chunk), int(kv), t * 1e3, 0.0))
    for batch in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        for kv in np.arange(256, MAX_TOKENS + 1, 512):
            t = max(4 * q_width * batch * kv / flops_s, batch * kv * kv_bytes / bytes_s)
            rows.append((batch, 0, int(kv), 0.0, t * 1e3))
    attention = pd.DataFrame(
        rows,
        columns=[
            "batch_size",
            "prefill_chunk_size",
            "kv_cache_size",
            "time_stats.attn_prefill.median",
            "time_stats.attn_decode.median",
        ],
    )
    tokens = attention[["prefill_chunk_size", "batch_size"]].max(axis=1)
    attention["time_stats.attn_kv_cache_save.median"] = tokens * kv_bytes / bytes_s * 1e3
    attention = attention.assign(
        n_embd=h,
        n_q_head=m.num_attention_heads,
        n_kv_head=m.num_kv_heads,
        block_size=BLOCK_SIZE,
        num_tensor_parallel_workers=1,
    )
    return mlp, attention


def find_profile_files(data: Path, vidur_device: str) -> dict[str, Path]:
    """``mlp`` and ``attention`` profile files for Llama-3-8B on the device under ``data``."""
    candidates = [data] + [
        data / "profiling/compute" / vidur_device / "meta-llama" / name for name in VIDUR_MODEL_DIRS
    ]
    for folder in candidates:
        found = {}
        for table in ("mlp", "attention"):
            for suffix in (".csv", ".csv.xz"):
                if (folder / f"{table}{suffix}").is_file():
                    found[table] = folder / f"{table}{suffix}"
        if len(found) == 2:
            return found
    raise SystemExit(
        f"no mlp/attention profile for {VIDUR_MODEL} on {vidur_device} under {data} "
        f"(looked in: {', '.join(str(c) for c in candidates)})"
    )


def write_snapshot(cache: Path, dataset: str, config: dict, tables: dict) -> None:
    """One dataset in an offline Hugging Face cache, as ``snapshot_download`` finds it."""
    commit = "0" * 40
    repo = cache / ("datasets--" + dataset.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs/main").write_text(commit)
    (snapshot / "config.json").write_text(json.dumps(config))
    for name, table in tables.items():
        target = snapshot / f"{name}.csv.xz"
        if isinstance(table, pd.DataFrame):
            table.to_csv(target, index=False, compression="xz")
        elif str(table).endswith(".xz"):
            shutil.copyfile(table, target)
        else:
            with open(table, "rb") as src, lzma.open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def tables_digest(tables: dict) -> str:
    """A short hash of the profile tables' contents (frames or files)."""
    digest = hashlib.sha256()
    for name in sorted(tables):
        table = tables[name]
        data = table.to_csv(index=False).encode() if isinstance(table, pd.DataFrame) else None
        digest.update(name.encode() + (data if data is not None else Path(table).read_bytes()))
    return digest.hexdigest()[:12]


def prepare_vidur_cache(cache_dir: Path, vidur_device: str, network: str, tables: dict) -> None:
    """Vidur's predictor cache dir, holding the two profiling datasets it downloads.

    Vidur keys its cached predictors by dataset *name*, not contents, so each
    set of tables gets its own cache dir (named by their hash, see main).
    """
    write_snapshot(
        cache_dir / "profiling_data/compute",
        COMPUTE_DATASET,
        {"model": VIDUR_MODEL, "device_sku": vidur_device},
        tables,
    )
    # Network profiles are only read under tensor or pipeline parallelism.
    write_snapshot(cache_dir / "profiling_data/network", NETWORK_DATASET, {"sku": network}, {})


def vidur_args(trace: Path, cache_dir: Path, out_dir: Path, device: str, network: str, cap: int):
    rf = "--random_forrest_execution_time_predictor_config_"
    return [
        "--replica_config_model_name", VIDUR_MODEL,
        "--replica_config_device", device,
        "--replica_config_network_device", network,
        "--replica_config_tensor_parallel_size", "1",
        "--replica_config_num_pipeline_stages", "1",
        "--replica_config_gpu_memory_utilization", str(GPU_MEMORY_UTILIZATION),
        "--cluster_config_num_replicas", "1",
        "--replica_scheduler_config_type", "vllm",
        "--vllm_scheduler_config_batch_size_cap", str(cap),
        "--vllm_scheduler_config_max_tokens_in_batch", str(MAX_TOKENS),
        "--request_generator_config_type", "trace_replay",
        "--trace_request_generator_config_trace_file", str(trace),
        "--trace_request_generator_config_date", "2023-11-16",
        "--trace_request_generator_config_prefill_scale_factor", "1",
        "--trace_request_generator_config_decode_scale_factor", "1",
        "--trace_request_generator_config_time_scale_factor", "1",
        "--trace_request_generator_config_max_tokens", str(MAX_TOKENS),
        "--execution_time_predictor_config_type", "random_forrest",
        f"{rf}model_profiling_dataset", COMPUTE_DATASET,
        f"{rf}network_profiling_dataset", NETWORK_DATASET,
        f"{rf}cache_dir", str(cache_dir),
        f"{rf}prediction_max_tokens_per_request", str(MAX_TOKENS),
        f"{rf}prediction_max_prefill_chunk_size", str(MAX_TOKENS),
        f"{rf}prediction_max_batch_size", str(cap),
        "--metrics_config_output_dir", str(out_dir),
        "--no-metrics_config_enable_chrome_trace",
        "--no-metrics_config_store_plots",
        "--log_level", "warning",
    ]  # fmt: skip


def run_vidur(python: str, args: list[str], workdir: Path) -> dict:
    """One Vidur run in a fresh interpreter; its figures plus the process wall time."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    out = subprocess.run(
        [python, "-c", _VIDUR_CHILD, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    wall = time.perf_counter() - start
    lines = [line for line in out.stdout.splitlines() if line.startswith("VIDUR_RESULT ")]
    if out.returncode or not lines:
        sys.stderr.write(out.stdout[-4000:] + out.stderr[-4000:])
        raise SystemExit(f"Vidur failed (exit {out.returncode})")
    result = json.loads(lines[-1].split(" ", 1)[1])
    result["wall_s"] = wall
    return result


def run_rose(trace: Path, num_requests: int | None, device: str, cap: int, tmp: Path) -> dict:
    """One rose-sim run as a user runs it; process wall time plus its saved summary."""
    result_file = tmp / "rose_result.json"
    cmd = [
        str(ROSE_SIM), "--trace", str(trace), "--policy", "fifo", "--model", ROSE_MODEL,
        "--hardware", device, "--max-num-seqs", str(cap), "--quiet", "--no-summary",
        "--save-result", str(result_file),
    ]  # fmt: skip
    if num_requests:
        cmd += ["--num-requests", str(num_requests)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    summary = json.loads(result_file.read_text())
    summary["wall_s"] = wall
    summary["command"] = " ".join(cmd[:-2])
    return summary


def vidur_latencies(out_dir: Path) -> dict:
    """Mean end-to-end latency and simulated makespan from Vidur's request metrics, if written."""
    files = sorted(out_dir.rglob("request_metrics.csv"))
    if not files:
        return {}
    df = pd.read_csv(files[-1])
    col = "request_e2e_time"
    return {"mean_e2el_ms": float(df[col].mean() * 1e3)} if col in df else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur-python", default="/tmp/vidur-venv/bin/python")
    parser.add_argument("--vidur-data", type=Path, help="a Vidur checkout's data folder")
    parser.add_argument(
        "--synthetic-profile",
        action="store_true",
        help="time Vidur on profiling tables made from rose-sim's roofline",
    )
    parser.add_argument("--trace", default=TRACE, help="a trace file or a public trace name")
    parser.add_argument("--num-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--device", choices=sorted(DEVICES), default="a100-80gb")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="batch cap, both")
    parser.add_argument(
        "--vidur-cache",
        type=Path,
        default=Path(tempfile.gettempdir()) / "vidur_compare_cache",
        help="where Vidur's trained predictors are kept between runs (one subdir per profile)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir and print it")
    args = parser.parse_args()

    probe = subprocess.run(
        [args.vidur_python, "-c", "import vidur; print(vidur.__version__)"],
        capture_output=True,
        text=True,
    ) if Path(args.vidur_python).exists() else None  # fmt: skip
    if probe is None or probe.returncode:
        print(
            f"no Vidur at {args.vidur_python}: python3 -m venv /tmp/vidur-venv && "
            "/tmp/vidur-venv/bin/pip install vidur"
        )
        return
    version = probe.stdout.strip()
    if args.vidur_data is None and not args.synthetic_profile:
        print(NO_DATA.format(version=version))
        return
    try:
        args.trace = workloads.resolve_trace(args.trace)
    except workloads.WorkloadError as err:
        raise SystemExit(f"vidur_compare.py: error: {err}") from None
    if not args.trace.is_file():
        raise SystemExit(f"vidur_compare.py: error: no trace at {args.trace}")

    vidur_device, network = DEVICES[args.device]
    tmp = Path(tempfile.mkdtemp(prefix="vidur_compare_"))
    try:
        trace = load_trace(args.trace, args.num_requests)
        vidur_trace = tmp / "trace_replay.csv"
        write_vidur_trace(trace, vidur_trace)
        if args.vidur_data is not None:
            tables: dict = find_profile_files(args.vidur_data, vidur_device)
            source = f"profiling data from {args.vidur_data}"
        else:
            mlp, attention = roofline_profiles(args.device)
            tables = {"mlp": mlp, "attention": attention}
            source = "synthetic profiles from rose-sim's roofline"
        cache_dir = args.vidur_cache / f"{vidur_device}-{tables_digest(tables)}"
        cached = (cache_dir / "predictions").is_dir()
        prepare_vidur_cache(cache_dir, vidur_device, network, tables)

        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cpus, "
            f"python {platform.python_version()}; vidur {version}"
        )
        print(
            f"trace: {args.trace.name}, {len(trace)} requests over "
            f"{trace.arrival_s.iloc[-1]:.0f} s; Llama-3-8B on {args.device}, "
            f"batch cap {args.max_num_seqs}; Vidur costs: {source}"
        )
        runs = {}
        first = "vidur (cached predictors)" if cached else "vidur (cold: trains predictors)"
        for label in (first, "vidur (warm: cached predictors)"):
            out_dir = tmp / f"vidur_out_{len(runs)}"
            cli = vidur_args(
                vidur_trace, cache_dir, out_dir, vidur_device, network, args.max_num_seqs
            )
            runs[label] = run_vidur(args.vidur_python, cli, tmp)
            runs[label].update(vidur_latencies(out_dir))
        rose = run_rose(args.trace, args.num_requests, args.device, args.max_num_seqs, tmp)

        n = len(trace)
        print(
            f"\n{'run':<34}{'wall s':>8}{'setup s':>9}{'loop s':>8}{'batches':>9}"
            f"{'req/s':>9}{'mean e2e ms':>13}"
        )
        for label, r in runs.items():
            setup = r["import_s"] + r["init_s"]
            print(
                f"{label:<34}{r['wall_s']:>8.1f}{setup:>9.1f}{r['loop_s']:>8.1f}"
                f"{r['num_batches']:>9}{n / r['wall_s']:>9.1f}{r.get('mean_e2el_ms', float('nan')):>13.0f}"
            )
        print(
            f"{'rose-sim fifo':<34}{rose['wall_s']:>8.1f}"
            f"{rose['wall_s'] - rose['sim_wall_s']:>9.1f}{rose['sim_wall_s']:>8.1f}"
            f"{rose['num_steps']:>9}{n / rose['wall_s']:>9.1f}{rose['mean_e2el_ms']:>13.0f}"
        )
        cold, warm = runs.values()
        print(
            f"\nVidur predictor set-up: {cold['predictor_s']:.1f} s in the first run "
            f"({'from cache' if cached else 'training + lookup tables'}), "
            f"{warm['predictor_s']:.1f} s from cache; cache: {cache_dir}"
        )
        print(
            f"wall-time ratio Vidur / rose-sim: first run {cold['wall_s'] / rose['wall_s']:.1f}x, "
            f"warm {warm['wall_s'] / rose['wall_s']:.1f}x; simulation loop only (warm): "
            f"{warm['loop_s'] / rose['sim_wall_s']:.1f}x"
        )
        print(f"rose-sim command: {rose['command']}")
        print(
            f"Vidur simulated {warm['simulated_s']:.0f} s (peak RSS {warm['peak_rss_mb']:.0f} MB); "
            f"rose-sim {rose['duration']:.0f} s"
        )
    finally:
        if args.keep:
            print(f"temp dir kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
