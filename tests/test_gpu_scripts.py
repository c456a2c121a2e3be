"""The device-call scripts under benchmarks/gpu run end to end on a CPU, so a lent GPU's
scarce minutes are not spent finding a broken path in them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    """This interpreter's bin first on PATH (the scripts call ``python`` and ``rose-run``)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1", **extra}


def test_seeds_cuda_runs_every_post_on_a_cpu_with_absolute_output_paths(tmp_path):
    """seeds_cuda.sh with a tiny GPT-2 profile, one repeat, eight requests: the step
    check and every post's table land under an absolute OUT (an absolute OUT once broke
    the script after its ``cd benchmarks``)."""
    profile = tmp_path / "p.json"
    made = subprocess.run(
        ["rose-run", "profile", "--device", "cpu", "--model", "tiny-gpt2", "--max-model-len",
         "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--repetitions", "1",
         "--quiet", "--output", str(profile)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(), check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    out = tmp_path / "out"
    env = _env(DEVICE="cpu", PROFILE=str(profile), OUT=str(out), REPEATS="1",
               SEED_FLAGS="--model tiny-gpt2 --num-requests 8")  # fmt: skip
    proc = subprocess.run(
        ["bash", "benchmarks/gpu/seeds_cuda.sh"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    seeds = out / "seeds"
    assert (seeds / "device.txt").read_text().startswith("gpu none")
    assert "hit (cache on)" in (seeds / "step-check.txt").read_text()
    table = (seeds / "seeds.txt").read_text()
    for post in ("027", "031", "032", "033", "004"):
        assert f"=== {post}" in table
    assert (seeds / "p.json").exists()
