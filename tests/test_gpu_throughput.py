"""``benchmarks/gpu_throughput.py`` runs end to end at tiny size on CPU (its smoke
mode); its figures mean nothing there, only that every part runs and prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_throughput.py"


@pytest.mark.slow
def test_gpu_throughput_small_on_cpu_prints_one_table():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--device", "cpu", "--small"],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent, check=True,
    ).stdout  # fmt: skip
    assert out.startswith("device: cpu (not a GPU measurement) | torch ")
    pairs = {tuple(line.split()[:2]) for line in out.splitlines() if line.startswith(" ")}
    expected = {("a", "roseinfer-sdpa"), ("a-sub", "roseinfer-sdpa"), ("b", "roseinfer-sdpa")}
    assert expected | {("a-sub", "hf-cb")} <= pairs
    assert "floor of its steps (cpu)" in out and "hf-cb" in out
    assert "decode 4 x ctx 64" in out and "prefill 2 x 64" in out
    assert "planning" in out and "/ hf-cb on a-sub" in out


def test_the_step_table_alone_is_a_quick_a_b():
    """``--workloads ''`` serves nothing: the step table only (every backend's row
    of each step, the short prompt alone and beside decodes among them)."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--device", "cpu", "--small",
         "--workloads", "", "--backends", "sdpa,sdpa:eager"],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent, check=True,
    ).stdout  # fmt: skip
    assert "roseinfer-sdpa" in out and "hf-cb" not in out
    assert "prefill 1 x 24" in out and "mixed 2 x ctx 64 + 1 x 24" in out
    assert not any(line.split()[:1] == ["a"] for line in out.splitlines())


def test_kernel_tables_and_host_profiles_print_for_every_step():
    """``--kernel-table`` profiles each step of (c) on any runner (it was skipped when
    the runner had graphs), ``--host-profile`` runs cProfile over each decode step's
    forwards: the runner's own functions appear in it."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--device", "cpu", "--small",
         "--workloads", "", "--backends", "sdpa", "--kernel-table", "--host-profile"],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent, check=True,
    )  # fmt: skip
    err = done.stderr
    assert "== kernels of decode 4 x ctx 64 (roseinfer-sdpa)" in err
    assert "== kernels of prefill 2 x 64 (roseinfer-sdpa)" in err
    assert "== host functions of decode 4 x ctx 64 (roseinfer-sdpa), 5 forwards" in err
    assert "== host functions of prefill 1 x 24 (roseinfer-sdpa), 5 forwards" in err
    assert "== host functions of prefill 2 x" not in err
    assert "tottime" in err and "executor/" in err  # the runner's own functions


def test_a_served_workloads_steps_are_saved_as_a_step_log(tmp_path):
    """``--save-steps DIR``: workload (b)'s steps in rose-run's step-log schema, with
    the model's shape and the runner's facts, readable by ``load_step_log``."""
    from roseinfer.calibration.steplog import load_step_log

    subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tiny-llama", "--device", "cpu", "--small",
         "--workloads", "b", "--no-hf", "--save-steps", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=SCRIPT.parent, check=True,
    )  # fmt: skip
    log = load_step_log(tmp_path / "steps-b-roseinfer-sdpa.jsonl")
    assert log.header["model"]["spec"]["num_layers"] == 2
    assert log.header["executor"]["attention_backend"] == "sdpa"
    assert sum(r.shape.totals().num_tokens for r in log.records) > 0


def test_the_floor_is_the_datasheet_form_at_full_efficiency():
    """Before: the floor took the measured h100-sxm with its fitted terms (eager
    launches, KV bandwidth, per-sequence overhead, decode imbalance), so a lone
    200-token prefill's "floor" was the 10 ms launch roof and steps ran "below" it."""
    import argparse
    from unittest.mock import patch

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from gpu_throughput import floor_model
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from roseinfer.calibration.cost_model import BatchShape
    from roseinfer.calibration.specs import get_model_spec

    spec = get_model_spec("llama-3.1-8b")
    args = argparse.Namespace(hardware="h100-sxm", floor_peaks="datasheet")
    with patch("gpu_throughput.model_spec_of", lambda *_: spec):
        floor = floor_model("llama-3.1-8b", None, None, args)
    weights_s = spec.streamed_weight_bytes / floor.device.mem_bandwidth
    prefill = floor.step_time_s(BatchShape([200], [200], []))
    assert weights_s <= prefill < 1.1 * weights_s, (prefill, weights_s)
