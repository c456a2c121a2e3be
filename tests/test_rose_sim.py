"""``rose-sim`` end to end: outputs, seed workloads, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import run_cli

from roseinfer.cli.sim import main

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
VLLM_KEYS = [
    "completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    *[f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p50", "p90", "p95", "p99")],
    "num_requests", "rejected", "preemptions", "prefix_cache_hit_rate", "policy",
]  # fmt: skip


def rose_sim(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    return run_cli(main, "rose-sim", monkeypatch, capsys, *args)


def test_default_run_prints_a_summary(monkeypatch, capsys) -> None:
    code, out, _ = rose_sim(
        monkeypatch,
        capsys,
        "--policy",
        "pack",
        "--prefill-max-tokens",
        "256",
        "--num-requests",
        "300",
    )
    assert code == 0
    assert "Successful requests:                     300" in out
    assert "P99 ITL (ms):" in out


def test_result_json_has_vllm_bench_keys_and_records(monkeypatch, capsys, tmp_path) -> None:
    result, records = tmp_path / "r.json", tmp_path / "rec.csv"
    code, _, err = rose_sim(
        monkeypatch, capsys, "--policy", "budget", "--prefill-max-tokens", "512",
        "--force-fifo-every", "4", "--num-requests", "200", "--quiet",
        "--save-result", str(result), "--save-records", str(records),
        "--goodput", "ttft:500", "tpot:50",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(result.read_text())
    assert [k for k in VLLM_KEYS if k not in data] == []
    assert data["completed"] + data["rejected"] == data["num_requests"] == 200
    assert data["policy"] == "budget+force-fifo+prefill-first"
    assert "request_goodput" in data
    df = pd.read_csv(records)
    assert len(df) == 200
    assert "token_times_s" in df.columns


def test_records_as_parquet_keep_token_times(monkeypatch, capsys, tmp_path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "rec.parquet"
    code, _, err = rose_sim(
        monkeypatch, capsys, "--num-requests", "20", "--quiet", "--save-records", str(path)
    )
    assert code == 0, err
    df = pd.read_parquet(path)
    assert (df.token_times_s.map(len) == df.num_output_tokens).all()


@pytest.mark.parametrize(
    "workload, flags",
    [
        ("seed-027", []),
        ("seed-031", ["--policy", "budget", "--prefill-max-tokens", "224", "--max-num-seqs", "32"]),
        ("seed-032", ["--loop-order", "decode-first", "--max-num-seqs", "128"]),
        (
            "seed-033",
            ["--policy", "pack", "--prefill-max-tokens", "256", "--force-fifo-every", "8"],
        ),
        ("seed-004-prefix-shared", []),
    ],
)
def test_seed_workloads_run(monkeypatch, capsys, tmp_path, workload, flags) -> None:
    result = tmp_path / "r.json"
    code, _, err = rose_sim(
        monkeypatch, capsys, "--workload", workload, "--model", "gpt2", "--hardware", "cpu",
        "--quiet", "--save-result", str(result), *flags,
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(result.read_text())
    assert data["completed"] == data["num_requests"]


def test_prefix_cache_hits_on_shared_prompts(monkeypatch, capsys, tmp_path) -> None:
    result = tmp_path / "r.json"
    rose_sim(
        monkeypatch,
        capsys,
        "--workload",
        "seed-004-prefix-shared",
        "--quiet",
        "--save-result",
        str(result),
    )
    assert json.loads(result.read_text())["prefix_cache_hit_rate"] > 0.5


def bad_trace(tmp_path: Path) -> Path:
    path = tmp_path / "bad.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6800000,10,5\n"
        "2023-11-16 18:15:47.6800000,abc,5\n"
    )
    return path


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "nope"], "unknown policy 'nope' for --policy; known: budget, edf, fifo"),
        (
            ["--loop-order", "sideways"],
            "known: decode-first, mixed, prefill-first, prefill-priority",
        ),
        (["--policy", "fifo", "--prefill-max-tokens", "64"], "ignores --prefill-max-tokens"),
        (
            ["--policy", "budget", "--lookahead", "8", "--strict-options"],
            "no plugin of this run reads 'lookahead'",
        ),
        (["--workload", "seed-031", "--trace", "x.csv"], "either --trace or --workload"),
        (["--prompt-repeats", "1,64"], "--workload synthetic"),
        (["--num-kv-blocks", "10", "--kv-cache-memory-gb", "1"], "not both"),
        (["--request-rate", "0"], "--request-rate: must be a number > 0 (or inf), got '0'"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be an integer in [1, 2147483647]"),
        (["--trace", "missing.csv"], "missing.csv"),
        (["--model", "gpt5"], "gpt5"),
        (["--hardware", "tpu"], "tpu"),
        (["--goodput", "latency:5"], "latency"),
        (["--save-records", "r.txt", "--num-requests", "3"], ".csv or .parquet"),
        (["--workload", "synthetic", "--prompt-repeats", "1,0"], "positive"),
        (["--max-num-batched-tokens", "512"], "add --enable-chunked-prefill"),
        (["--long-prefill-token-threshold", "16"], "only applies with --enable-chunked-prefill"),
        (
            ["--policy", "fifo", "--chunk-head", "--strict-options"],
            "no plugin of this run reads 'chunk_head'",
        ),
        (["--enable-chunked-prefill"], "needs a per-step limit"),
        (
            ["--scheduler-preset", "vllm-v1", "--max-num-batched-tokens", "64"],
            "(64) must be >= max_num_seqs (256)",
        ),
        (["--scheduler-preset", "trt"], "invalid choice: 'trt'"),
    ],
)
def test_bad_input_gives_one_error_line(monkeypatch, capsys, tmp_path, args, message) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = rose_sim(monkeypatch, capsys, *args)
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rose-sim: error:"), err
    assert message in lines[0]


def test_scheduler_preset_sets_the_knobs_and_flags_win(monkeypatch, capsys, tmp_path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ("--num-requests", "60", "--quiet", "--scheduler-preset", "vllm-v1")
    rose_sim(monkeypatch, capsys, *common, "--save-result", str(a))
    rose_sim(monkeypatch, capsys, *common, "--loop-order", "decode-first", "--save-result", str(b))
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    assert ra["completed"] == rb["completed"] == 60
    assert (ra["scheduler_preset"], ra["loop_order"], ra["enable_chunked_prefill"]) == (
        "vllm-v1",
        "mixed",
        True,
    )
    assert (ra["max_num_batched_tokens"], ra["max_num_seqs"]) == (2048, 256)
    assert ra["policy"] == "fifo+mixed"
    assert rb["loop_order"] == "decode-first" and rb["max_num_batched_tokens"] == 2048


def test_malformed_trace_row_names_file_and_line(monkeypatch, capsys, tmp_path) -> None:
    code, _, err = rose_sim(monkeypatch, capsys, "--trace", str(bad_trace(tmp_path)))
    assert code == 2
    assert "bad.csv:3" in err and "ContextTokens" in err


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/traces is not beside the repo")
def test_full_azure_conv_trace_completes_under_pack(monkeypatch, capsys, tmp_path) -> None:
    result = tmp_path / "r.json"
    code, _, err = rose_sim(
        monkeypatch, capsys, "--policy", "pack", "--prefill-max-tokens", "2048",
        "--trace", str(SHARED / "AzureLLMInferenceTrace_conv.csv"), "--quiet",
        "--save-result", str(result),
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(result.read_text())
    assert data["num_requests"] == 19366
    assert data["completed"] == 19366


def test_a_replica_spans_gpus_with_tensor_parallelism(monkeypatch, capsys, tmp_path) -> None:
    """The README's 70B example: it does not fit one H200; TP2 and TP4 run, each GPU
    holding its share of the weights and KV, and TPOT falls with TP size."""
    common = ["--model", "llama-3.1-70b", "--hardware", "h200", "--num-requests", "200",
              "--request-rate", "2", "--policy", "budget", "--prefill-max-tokens", "2048",
              "--quiet"]  # fmt: skip
    code, _, err = rose_sim(monkeypatch, capsys, *common)
    assert code == 2 and "do not fit h200" in err and "--tensor-parallel-size" in err
    results = {}
    for tp in (2, 4):
        out = tmp_path / f"tp{tp}.json"
        code, _, err = rose_sim(monkeypatch, capsys, *common, "--tensor-parallel-size", str(tp),
                                "--save-result", str(out))  # fmt: skip
        assert code == 0, err
        results[tp] = json.loads(out.read_text())
    a, b = results[2], results[4]
    assert a["completed"] == b["completed"] == 200
    assert (a["num_gpus"], b["num_gpus"]) == (2, 4) and b["tensor_parallel_size"] == 4
    assert b["num_kv_blocks"] > 2 * a["num_kv_blocks"]  # 4 GPUs, 1/4 of the weights each
    assert b["median_tpot_ms"] < a["median_tpot_ms"]
    assert "TP4 over nvlink4" in b["cost_model"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-3.1-70b", "--tensor-parallel-size", "3"], "divide num_attention_heads"),
        (["--model", "gpt2", "--hardware", "cpu", "--tensor-parallel-size", "2"], "no link"),
        (["--pipeline-parallel-size", "0"], "--pipeline-parallel-size"),
        (["--interconnect", "smoke-signals"], "--interconnect"),
    ],
)
def test_bad_parallelism_is_one_error_line(monkeypatch, capsys, args, message) -> None:
    code, _, err = rose_sim(monkeypatch, capsys, *args, "--num-requests", "5")
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_replica_config_takes_tensor_parallel_per_replica(monkeypatch, capsys, tmp_path) -> None:
    config = tmp_path / "replicas.toml"
    config.write_text(
        '[[replica]]\nmodel = "llama-3.1-70b"\ndevice = "h200"\ntensor_parallel_size = 2\n\n'
        '[[replica]]\nmodel = "llama-3.1-70b"\ndevice = "h100-sxm"\ntensor_parallel_size = 4\n'
        'interconnect = "pcie5"\n'
    )
    out = tmp_path / "r.json"
    code, stdout, err = rose_sim(monkeypatch, capsys, "--replica-config", str(config),
                                 "--num-requests", "40", "--save-result", str(out))  # fmt: skip
    assert code == 0, err
    names = [r["name"] for r in json.loads(out.read_text())["replica_summaries"]]
    assert names == ["llama-3.1-70b@h200 x2", "llama-3.1-70b@h100-sxm x4"]
