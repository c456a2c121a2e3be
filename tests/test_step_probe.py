"""benchmarks/gpu/step_probe.py: the stretched small prefills are told from the normal ones,
and a served CPU run is probed step by step with every counter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import step_probe  # noqa: E402 -- a benchmark script

SHIPPED = ROOT / "benchmarks" / "gpu" / "results" / "h100-2026-11-27c-probe"


def _record(tokens: int, wall_ms: float, phase: str = "prefill", **extra: float) -> dict:
    base = {k: 0.0 for k in step_probe.SECONDS_KEYS + step_probe.COUNT_KEYS}
    return base | {"tokens": tokens, "phase": phase, "wall_s": wall_ms / 1e3} | extra


def test_a_step_over_1_5x_its_bins_median_is_stretched():
    rows = [_record(200, 13.0) for _ in range(8)] + [_record(210, 30.0, minflt=20)]
    rows += [_record(1500, 90.0), _record(1, 40.0, phase="decode")]  # neither counts
    table = step_probe.summarize(rows)
    assert table.startswith("9 prefills under 512 tokens, 1 stretched")
    stretched, normal = (line.split() for line in table.splitlines()[2:4])
    assert stretched[0] == "stretched" and float(stretched[1]) == pytest.approx(30.0)
    assert normal[0] == "normal" and float(normal[1]) == pytest.approx(13.0)
    assert float(stretched[-4]) == 20.0  # minflt, a mean


def test_a_probe_file_without_the_later_counters_still_summarizes():
    rows = [_record(100, 10.0) for _ in range(3)]
    for r in rows:
        del r["sys_s"], r["minflt"], r["proc_cpu_s"]
    assert "nan" in step_probe.summarize(rows)


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="no shipped H100 probe")
def test_the_shipped_h100_probes_stretch_eager_and_not_full_mode_prefills():
    """The 2026-11-27 H100 runs: eager small prefills stretch on the CPU (the launch loop's
    thread CPU time grows with it), --cudagraph-mode FULL's replayed ones hardly."""
    import gzip

    def load(name: str) -> list[dict]:
        return [json.loads(line) for line in gzip.open(SHIPPED / name, "rt")]

    eager = step_probe.summarize(load("call1/probe.jsonl.gz"))
    full = step_probe.summarize(load("call2/probe-full-omp1.jsonl.gz"))
    assert ", 26 stretched" in eager.splitlines()[0]
    assert ", 0 stretched" in full.splitlines()[0]


def test_a_served_cpu_run_is_probed_step_by_step(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "probe.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu" / "step_probe.py"), "--probe-out",
           str(out), "--", "--device", "cpu", "--model", "tiny-llama", "--num-requests", "4",
           "--quiet", "--save-result", str(tmp_path / "r.json")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    result = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == result["num_steps"]
    for r in rows:
        assert set(step_probe.SECONDS_KEYS + step_probe.COUNT_KEYS) <= set(r)
        assert 0 < r["launch_s"] <= r["wall_s"] and r["cpu_s"] <= r["proc_cpu_s"] + 1e-3
    assert "prefills under 512 tokens" in proc.stdout
