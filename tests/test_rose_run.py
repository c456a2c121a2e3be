"""``rose-run`` end to end on tiny models: result files and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import GenerationConfig  # noqa: E402

from roseinfer.cli import run as cli  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.workloads import fit as workloads_fit  # noqa: E402

torch.set_num_threads(1)

VLLM_KEYS = [
    "completed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms",
    "num_requests", "rejected", "preemptions", "prefix_cache_hit_rate", "policy", "fit_lengths",
]  # fmt: skip


def rose_run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``rose-run`` in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["rose-run", *args])
    try:
        code = cli.main()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_error_line(err: str) -> str:
    """The one error line, after any progress lines (``rose-run: loading ...``)."""
    lines = [ln for ln in err.strip().splitlines() if not is_progress(ln)]
    assert len(lines) == 1 and lines[0].startswith("rose-run: error: "), err
    return lines[0]


def is_progress(line: str) -> bool:
    """A progress line of model build or warm-up: ``prog: what is happening...``."""
    return line.startswith("rose-run: ") and line.endswith("...") and ": error: " not in line


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    ids = torch.tensor([prompt])
    # NOTE: an explicit mask, else generate() masks prompt tokens equal to pad_token_id (0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


# -------------------------------------------------------------------- runs


def test_seed_workload_writes_result_and_records_with_token_ids(monkeypatch, capsys, tmp_path):
    result_path, records_path = tmp_path / "x.json", tmp_path / "y.csv"
    code, out, err = rose_run(
        monkeypatch, capsys,
        "--model", "tiny-gpt2", "--device", "cpu", "--workload", "seed-031",
        "--num-requests", "8", "--save-result", str(result_path),
        "--save-records", str(records_path), "--save-token-ids", "--no-summary", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert out == "" and err == ""  # --no-summary --no-progress (= --quiet)
    result = json.loads(result_path.read_text())
    assert [k for k in VLLM_KEYS if k not in result] == []
    assert result["num_requests"] == 8 and result["completed"] + result["rejected"] == 8
    assert result["completed"] == 8 and result["backend"] == "executor"
    assert result["policy"] == "fifo+prefill-first" and result["device"] == "cpu"
    assert result["fit_lengths"].startswith("off: all 8 requests fit")
    assert "folded into the vocab (1000)" in result["token_ids"]  # GPT-2 ids, tiny vocab
    assert result["duration"] >= 0.14  # arrivals 20 ms apart, replayed on the real clock
    assert result["num_kv_blocks"] == 256 * 256 // 16  # capped: max_num_seqs full-length requests
    assert 0 <= result["gc_pause_max_s"] <= result["gc_pause_s"]
    assert 0 <= result["gc_full_collections"] <= result["gc_collections"]  # ints: counts
    assert result["cuda_alloc_retries"] is None  # CPU

    records = pd.read_csv(records_path)
    assert len(records) == 8 and set(records["status"]) == {"finished"}
    prompts = [json.loads(p) for p in records["prompt_token_ids"]]
    outputs = [json.loads(o) for o in records["output_token_ids"]]
    assert [len(p) for p in prompts] == list(records["num_prompt_tokens"])
    assert [len(o) for o in outputs] == list(records["num_output_tokens"]) == [32] * 8
    assert max(max(p) for p in prompts) < 1000
    # The CLI's model (seed 0, default init) gives generate()'s tokens.
    model, _, _ = build_model("tiny-gpt2", seed=0, dtype=torch.float32, device="cpu")
    for i in (0, 3):
        assert outputs[i] == hf_greedy(model, prompts[i], 32)


def test_default_trace_scaled_to_max_model_len(monkeypatch, capsys, tmp_path):
    result_path = tmp_path / "r.json"
    code, out, err = rose_run(
        monkeypatch, capsys,
        "--model", "tiny-gpt2", "--device", "cpu", "--num-requests", "6",
        "--fit-lengths", "scale", "--max-model-len", "128", "--request-rate", "inf",
        "--policy", "budget", "--prefill-max-tokens", "64", "--no-progress",
        "--save-result", str(result_path),
    )  # fmt: skip
    assert code == 0, err
    assert "rose-run: budget+prefill-first" in out and "TTFT" in out
    result = json.loads(result_path.read_text())
    assert [k for k in VLLM_KEYS if k not in result] == []
    assert result["completed"] == 6 and result["rejected"] == 0
    assert result["fit_lengths"].startswith("scaled") and result["max_model_len"] == 128
    assert result["workload"].startswith("azure_conv") and result["token_ids"] == "none"
    assert result["total_token_throughput"] > result["output_throughput"] > 0


def test_step_log_calibrates_rose_sim_on_the_same_requests(monkeypatch, capsys, tmp_path):
    """``rose-run --save-steps`` then ``rose-sim --cost-model STEPLOG`` with the same
    flags: the same requests (both clip to the logged max model length by the one
    rule), the logged pool, and every step of the log in the file."""
    from roseinfer.calibration.steplog import load_step_log
    from roseinfer.cli import sim as sim_cli

    flags = ["--num-requests", "10", "--request-rate", "40", "--max-model-len", "160",
             "--policy", "budget", "--prefill-max-tokens", "96", "--fit-lengths", "clip",
             "--quiet"]  # fmt: skip
    code, _, err = rose_run(
        monkeypatch, capsys, "--model", "tiny-gpt2", "--device", "cpu", "--no-progress", "--no-warmup", *flags,
        "--save-steps", str(tmp_path / "steps.jsonl"), "--save-result", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert code == 0, err
    real = json.loads((tmp_path / "r.json").read_text())
    log = load_step_log(tmp_path / "steps.jsonl")
    assert log.header["backend"] == "rose-run" and len(log.records) == real["num_steps"]
    assert log.executor["num_kv_blocks"] == real["num_kv_blocks"]
    assert log.executor["fit_lengths"] == "clip" and log.header["model"]["spec"]["num_layers"] == 2
    assert all(r.forward_s is not None and 0 <= r.forward_s <= r.duration_s for r in log.records)
    assert sum(sum(r.is_decode) for r in log.records) > 0

    monkeypatch.setattr(sys, "argv", ["rose-sim", "--cost-model", str(tmp_path / "steps.jsonl"),
                                      *flags, "--save-result", str(tmp_path / "s.json")])  # fmt: skip
    assert sim_cli.main() == 0
    sim = json.loads((tmp_path / "s.json").read_text())
    assert sim["fit_lengths"] == real["fit_lengths"] and "clipped" in sim["fit_lengths"]
    assert (
        sim["num_kv_blocks"] == real["num_kv_blocks"] and sim["rejected"] == real["rejected"] == 0
    )
    assert sim["completed"] == real["completed"] == 10


def test_list_policies(monkeypatch, capsys):
    code, out, _ = rose_run(monkeypatch, capsys, "--list-policies")
    assert code == 0 and "pack" in out and "decode-first" in out and "force-fifo" in out


# ------------------------------------------------------------------ errors


def test_unknown_model_is_one_error_line(monkeypatch, capsys):
    code, _, err = rose_run(monkeypatch, capsys, "--model", "no-such-model", "--device", "cpu")
    assert code == 2
    assert "unknown model 'no-such-model'" in one_error_line(err) and "tiny-llama" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda_is_one_error_line(monkeypatch, capsys):
    code, _, err = rose_run(monkeypatch, capsys, "--model", "tiny-gpt2", "--device", "cuda")
    assert code == 2 and "no CUDA device" in one_error_line(err)


def test_unknown_policy_lists_known_ones_before_loading_the_model(monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the flags were checked")

    from roseinfer.executor import builder

    monkeypatch.setattr(builder, "build_model", no_model)
    code, _, err = rose_run(monkeypatch, capsys, "--model", "tiny-gpt2", "--policy", "lifo")
    assert code == 2
    assert "unknown policy 'lifo'" in one_error_line(err) and "budget, edf, fifo" in err
    code, _, err = rose_run(
        monkeypatch, capsys, "--model", "tiny-gpt2", "--policy", "fifo", "--prefill-max-tokens", "9"
    )
    assert code == 2 and "ignores --prefill-max-tokens" in one_error_line(err)


def test_bad_values_are_one_error_line(monkeypatch, capsys):
    code, _, err = rose_run(
        monkeypatch, capsys, "--model", "tiny-gpt2", "--device", "cpu", "--max-model-len", "1024"
    )
    assert code == 2 and "exceeds the 256-token context" in one_error_line(err)
    code, _, err = rose_run(monkeypatch, capsys, "--device", "tpu:x")
    assert code == 2 and "unknown --device" in one_error_line(err)


@pytest.mark.parametrize("prompt", ["2147483647", "5000000"])
def test_an_over_long_trace_row_is_rejected_before_any_id_is_made(
    monkeypatch, capsys, tmp_path, prompt
):
    """Before: with --fit-lengths off, a 5M-token row made 5M token ids (seconds, 100s of
    MB) for a request the scheduler then rejected; a 2^31 row would have made 16 GB.
    Then the row stopped the run with one error line, while rose-sim rejected it, so the
    same flags replayed different requests. Now it is rejected on arrival, as in rose-sim
    and vLLM, with no id made for it, and the rest of the run goes on."""
    import time

    trace = tmp_path / "t.csv"
    trace.write_text(f"arrival_s,prompt_tokens,output_tokens\n0,{prompt},5\n0,8,2\n")
    made = []
    real = workloads_fit._made_up_ids
    monkeypatch.setattr(workloads_fit, "_made_up_ids", lambda *a: made.append(a) or real(*a))
    start = time.perf_counter()
    code, _, err = rose_run(
        monkeypatch, capsys, "--model", "tiny-gpt2", "--device", "cpu", "--trace", str(trace),
        "--max-model-len", "128", "--no-warmup", "--no-progress",
        "--save-result", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 1 and result["rejected"] == 1
    assert result["fit_lengths"].startswith("off: 1 of 2 requests")
    assert [a[0].num_prompt_tokens for a in made] == [8]
    assert time.perf_counter() - start < 60
    from roseinfer.cli import sim as sim_cli  # the same flags replay the same requests

    monkeypatch.setattr(sys, "argv", ["rose-sim", "--model", "gpt2", "--trace", str(trace),
                                      "--max-model-len", "128", "--quiet",
                                      "--save-result", str(tmp_path / "s.json")])  # fmt: skip
    assert sim_cli.main() == 0
    sim = json.loads((tmp_path / "s.json").read_text())
    assert (sim["completed"], sim["rejected"], sim["fit_lengths"]) == (1, 1, result["fit_lengths"])


def test_console_script_exits_2_with_one_line():
    script = Path(sys.executable).with_name("rose-run")
    if not script.exists():
        pytest.skip("rose-run is not installed next to this interpreter")
    proc = subprocess.run(
        [str(script), "--model", "tiny-gpt2", "--policy", "lifo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and "unknown policy 'lifo'" in one_error_line(proc.stderr)


# -------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_on_tiny_llama(monkeypatch, capsys, tmp_path):
    result_path, records_path = tmp_path / "cuda.json", tmp_path / "cuda.csv"
    code, _, err = rose_run(
        monkeypatch, capsys,
        "--model", "tiny-llama", "--device", "cuda", "--workload", "seed-004-prefix-shared",
        "--num-requests", "8", "--save-result", str(result_path),
        "--save-records", str(records_path), "--save-token-ids", "--quiet", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(result_path.read_text())
    assert result["device"].startswith("cuda") and result["dtype"] == "bfloat16"
    assert result["completed"] == 8 and result["prefix_cache_hit_rate"] > 0
    assert result["num_kv_blocks"] <= 256 * 512 // 16  # capped, not 90% of the GPU
    records = pd.read_csv(records_path)
    assert [len(json.loads(o)) for o in records["output_token_ids"]] == [8] * 8


@pytest.mark.parametrize(
    "policy",
    [
        ["--policy", "vtc"],
        ["--policy", "priority", "--max-num-seqs", "2"],
        ["--policy", "srpt", "--length-predictor", "noisy-oracle", "--max-num-seqs", "2"],
        ["--policy", "sjf", "--length-predictor", "bucket"],
        ["--policy", "edf", "--drop-late"],
        ["--policy", "lpm", "--loop-order", "mixed", "--enable-chunked-prefill",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "8"],
        ["--policy", "hrrn", "--force-fifo-every", "2"],
    ],
)  # fmt: skip
def test_policy_families_run_on_the_executor(monkeypatch, capsys, tmp_path, policy):
    trace = tmp_path / "t.csv"
    rows = [
        f"{i * 0.01},{8 + 3 * i},{2 + i % 3},{'ab'[i % 2]},{i % 2},{0.001 if i == 3 else 5}"
        for i in range(6)
    ]
    trace.write_text(
        "arrival_s,prompt_tokens,output_tokens,tenant,priority,deadline_s\n" + "\n".join(rows)
    )
    records = tmp_path / "r.csv"
    code, _, err = rose_run(
        monkeypatch, capsys, "--model", "tiny-llama", "--device", "cpu", "--trace", str(trace),
        "--no-progress", "--quiet", "--save-records", str(records), *policy,
    )  # fmt: skip
    assert code == 0, err
    df = pd.read_csv(records)
    assert len(df) == 6 and set(df.tenant) == {"a", "b"} and set(df.priority) == {0, 1}
    assert (df.status == "finished").sum() >= 5  # edf --drop-late may drop the 1 ms deadline
