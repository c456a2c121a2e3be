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
