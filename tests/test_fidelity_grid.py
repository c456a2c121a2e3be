"""The serving grid of the GPU fidelity report, and ``benchmarks/fidelity.py`` run
end to end at tiny size on the CPU (the path a GPU run takes, with --device cpu)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roseinfer.config import SchedulerConfig
from roseinfer.experiments.fidelity import serving_combinations

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"


def test_serving_grid_has_the_five_combinations():
    base = SchedulerConfig(num_kv_blocks=4096, max_num_seqs=256, max_model_len=4096)
    combos = {c.name: c.config for c in serving_combinations(base)}
    assert list(combos) == ["fifo", "budget-2048", "pack-2048+ff8", "budget-2048/decode-first",
                            "mixed-2048"]  # fmt: skip
    assert combos["fifo"].prefill_max_tokens is None
    assert combos["budget-2048"].prefill_max_tokens == 2048
    assert combos["pack-2048+ff8"].policy == "pack"
    assert combos["pack-2048+ff8"].options.get("force_fifo_every") == 8
    assert combos["budget-2048/decode-first"].loop_order == "decode-first"
    mixed = combos["mixed-2048"]
    assert mixed.loop_order == "mixed" and mixed.enable_chunked_prefill
    assert mixed.max_num_batched_tokens == 2048
    assert all(c.num_kv_blocks == 4096 for c in combos.values())


@pytest.mark.slow
def test_fidelity_benchmark_runs_the_serving_grid_at_tiny_size(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "f"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--device", "cpu",
        "--model", "tiny-gpt2", "--profile", str(tmp_path / "p.json"), "--profile-repetitions",
        "1", "--max-num-seqs", "8", "--grid", "serving", "--budget-tokens", "64",
        "--num-requests", "40", "--traces", "conv", "--loads", "1.0", "--repeats", "2",
        "--resamples", "20", "--roofline", "cpu", "--time-budget-s", "5",
        "--max-prompt-tokens", "100", "--max-output-tokens", "6", "--output", str(out),
    ]  # fmt: skip
    if TRACES.is_dir():
        cmd += ["--trace-dir", str(TRACES)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cutting requests 40 ->" in proc.stderr and "(combinations kept)" in proc.stderr
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["cost_model_source"].startswith(f"profile {tmp_path / 'p.json'}")
    assert doc["roofline_source"] == "roofline cpu, assumed (unmeasured)"
    assert doc["num_requests"] < 40
    (case,) = doc["cases"]
    names = {row["combination"] for row in case["rows"]}
    assert names == {"fifo", "budget-64", "pack-64+ff8", "budget-64/decode-first", "mixed-64"}
    assert {row["combination"] for row in case["roofline"]["rows"]} == names
    assert case["roofline_step_jitter"] is None  # the cpu spec has no measured repetitions
    for parts in case["decomposition"].values():  # the same scheduler on both sides
        assert all(r["steps_agreed"] == r["num_steps"] for r in parts["replay"])
    assert out.with_suffix(".md").read_text().count("Priced by") == 2
