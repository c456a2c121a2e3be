"""benchmarks/gpu/eager_jitter.py at tiny size on a CPU: every variant runs, and the
summary and the per-step file hold what the GPU call will be read by."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def test_every_variant_is_timed_and_summarized(tmp_path):
    out = tmp_path / "ej.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "eager_jitter.py"), "--model",
           "tiny-llama", "--device", "cpu", "--steps", "5", "--small", "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert list(doc["summary"]) == ["same", "fresh", "after-decode", "after-idle"]
    for variant, s in doc["summary"].items():
        assert s["steps"] == 5 and s["median_ms"] > 0 and 0 <= s["stretched_share"] <= 1
        assert variant in proc.stdout
    steps = doc["steps"]
    assert len({r["tokens"] for r in steps if r["variant"] == "same"}) == 1
    assert len({r["tokens"] for r in steps if r["variant"] == "fresh"}) == 5  # never repeated
    assert all(0 < r["host_s"] <= r["wall_s"] for r in steps)


def test_op_times_split_each_step_into_its_layers_calls(tmp_path):
    out = tmp_path / "ej.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "eager_jitter.py"), "--model",
           "tiny-llama", "--device", "cpu", "--steps", "4", "--small", "--variants", "same",
           "--op-times", "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(out.read_text())["steps"]
    assert {r["variant"] for r in steps} == {"same"} and len(steps) == 4
    for r in steps:
        ops = r["ops_s"]
        assert set(ops) == {"qkv", "write_kv", "attention", "finish_layer"}
        assert len({len(v) for v in ops.values()}) == 1 and len(ops["qkv"]) >= 2  # per layer
        assert sum(map(sum, ops.values())) <= r["host_s"]  # inside the launch loop
        assert r["host_cpu_s"] > 0
    assert "host time per call kind" in proc.stdout


def test_an_unknown_variant_is_one_error_line():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "eager_jitter.py"), "--variants",
           "same,warm"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "unknown --variants ['warm']" in proc.stderr
    assert "Traceback" not in proc.stderr
