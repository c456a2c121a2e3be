"""``rose-run profile`` on tiny models, the warm-up, and a loose sim-vs-real check:
a profile of a tiny model lets ``rose-sim --cost-model`` predict ``rose-run``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("scipy")

from roseinfer.calibration import PROFILE_SCHEMA, load_profile  # noqa: E402
from roseinfer.cli import run as cli  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.executor.profiler import (  # noqa: E402
    GridLimits,
    batch_shape_of,
    measure_host_overhead,
    profile_grid,
)
from roseinfer.executor.warmup import warm_up, warmup_shapes  # noqa: E402
from roseinfer.request import Request  # noqa: E402

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "limits",
    [
        GridLimits(2048, 256, 1024, 910 * 16),
        GridLimits(64, 16, 256, 40 * 16),  # pool smaller than max_num_seqs x max_model_len
        GridLimits(300, 4, 100, 10_000),
    ],
)
def test_grid_spans_the_limits_and_fits_them(limits):
    shapes = profile_grid(limits)
    kinds = {kind for kind, _ in shapes}
    assert kinds == {"prefill", "decode", "mixed"} or limits.max_num_seqs <= 4
    for _, seqs in shapes:
        assert 1 <= len(seqs) <= limits.max_num_seqs
        assert sum(n for n, _ in seqs) <= limits.max_num_batched_tokens
        assert all(1 <= n <= c <= limits.max_model_len for n, c in seqs)
        assert sum(c for _, c in seqs) <= limits.kv_capacity_tokens
    decode_batches = {len(s) for _, s in shapes if all(n == 1 for n, _ in s)}
    assert 1 in decode_batches and max(decode_batches) == min(
        limits.max_num_seqs, limits.max_num_batched_tokens
    )
    largest_chunk = max(n for _, s in shapes for n, _ in s)
    assert largest_chunk == min(limits.max_num_batched_tokens, limits.max_model_len)
    assert any(c > n > 1 for _, s in shapes for n, c in s)  # chunks on cached context


def test_batch_shape_of_splits_prefills_and_decodes():
    shape = batch_shape_of([(5, 9), (1, 30), (1, 4)])
    assert shape.prefill_new_tokens.tolist() == [5]
    assert shape.prefill_context_tokens.tolist() == [9]
    assert shape.decode_context_tokens.tolist() == [30, 4]


def test_warmup_shapes_fit_the_pool():
    config = SchedulerConfig(num_kv_blocks=20, block_size=4, max_num_seqs=64, max_model_len=50)
    for _, seqs in warmup_shapes(config):
        assert sum(c for _, c in seqs) <= 80
        assert all(1 <= n <= c <= 50 for n, c in seqs)
    names = [name for name, _ in warmup_shapes(config)]
    assert names == ["prefill", "decode", "decode-1", "mixed"]  # no token limit: no batch
    limited = SchedulerConfig(
        num_kv_blocks=100, block_size=4, max_num_seqs=8, max_model_len=50,
        max_num_batched_tokens=150, enable_chunked_prefill=True,
    )  # fmt: skip
    batch = dict(warmup_shapes(limited))["prefill-batch"]
    assert batch == [(50, 50)] * 3
    # limits that hold a 2,048-token chunk beside 16 decodes: the large mixed pass
    # (whose decodes the triton backend launches apart) is warmed too
    large = SchedulerConfig(
        num_kv_blocks=4096, block_size=16, max_num_seqs=256, max_model_len=4096,
        max_num_batched_tokens=8192, enable_chunked_prefill=True,
    )  # fmt: skip
    shapes = dict(warmup_shapes(large))
    assert shapes["mixed-large"][0] == (2048, 2048) and len(shapes["mixed-large"]) == 17
    assert all(n == 1 for n, _ in shapes["mixed-large"][1:])
    assert sum(c for _, c in shapes["mixed-large"]) <= 4096 * 16


def tiny_requests(vocab: int, n: int = 6) -> list[Request]:
    rng = np.random.default_rng(3)
    return [
        Request(
            f"r{i}",
            0.002 * i,
            int(p),
            int(o),
            prompt_token_ids=tuple(int(t) for t in rng.integers(0, vocab, int(p))),
        )
        for i, (p, o) in enumerate(zip(rng.integers(3, 60, n), rng.integers(2, 12, n)))
    ]


def test_warm_up_leaves_outputs_unchanged():
    """The warm-up writes K/V into pool blocks; later requests must not see it."""
    model, _, _ = build_model(
        "tiny-llama", seed=0, dtype=torch.float32, device="cpu",
        config_overrides={"initializer_range": 0.5},
    )  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
    outputs = []
    for warm in (False, True):
        runner = ModelRunner(
            model, num_kv_blocks=64, block_size=4, device="cpu", dtype=torch.float32
        )
        if warm:
            steps = warm_up(runner, config)
            assert all(len(s.times_s) == 1 and min(s.times_s) > 0 for s in steps)
        result = Engine(runner, config).run(tiny_requests(model.config.vocab_size))
        outputs.append(dict(zip(result.records.request_id, result.records.output_token_ids)))
    assert {k: list(v) for k, v in outputs[0].items()} == {
        k: list(v) for k, v in outputs[1].items()
    }


def test_host_overhead_is_measured_per_step_and_per_seq():
    config = SchedulerConfig(num_kv_blocks=512, block_size=16, max_num_seqs=16, max_model_len=512)
    host = measure_host_overhead(config, vocab_size=1000)
    assert host.num_steps > 50
    assert min(host.per_step_s, host.per_seq_s, host.per_token_s) >= 0
    assert 0 < host.per_step_s + 16 * host.per_seq_s < 0.05  # well under 50 ms a step


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.argv", ["rose-run", *args])
    code = cli.main()
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def tiny_profile(tmp_path_factory) -> Path:
    """A quick profile of tiny-gpt2 (one repetition, small limits)."""
    path = tmp_path_factory.mktemp("prof") / "tiny.json"
    mp = pytest.MonkeyPatch()
    mp.setattr(
        "sys.argv",
        [
            "rose-run", "profile", "--device", "cpu", "--model", "tiny-gpt2", "--output",
            str(path), "--repetitions", "1", "--max-num-seqs", "16", "--max-model-len", "128",
            "--max-num-batched-tokens", "256", "--no-progress",
        ],
    )  # fmt: skip
    try:
        assert cli.main() == 0
    finally:
        mp.undo()
    return path


def test_profile_file_has_samples_fit_and_setup(tiny_profile):
    doc = json.loads(tiny_profile.read_text())
    assert doc["schema"] == PROFILE_SCHEMA
    assert doc["model"]["name"] == "tiny-gpt2" and doc["model"]["spec"]["num_layers"] == 2
    ex = doc["executor"]
    assert (ex["block_size"], ex["max_model_len"], ex["max_num_seqs"]) == (16, 128, 16)
    assert ex["num_kv_blocks"] == 16 * 8  # rose-run's cap: max_num_seqs x blocks of max_model_len
    assert ex["enforce_eager"] is False and ex["cuda_graph_batch_sizes"] == []  # no graphs on CPU
    assert doc["environment"]["num_threads"] == 1 and doc["environment"]["torch"]
    kinds = {s["kind"] for s in doc["samples"]}
    assert kinds == {"prefill", "decode", "mixed"}
    assert all(len(s["times_s"]) in (1, 2) and s["median_s"] > 0 for s in doc["samples"])
    assert doc["fit"]["chosen"] in doc["fit"]["held_out"]
    overheads = doc["calibrated_roofline"]["overheads"]
    assert set(overheads) == {"gpt2", "llama"}
    assert all(min(o.values()) >= 0 and sum(o.values()) > 0 for o in overheads.values())
    layers = {(o["family"], o["num_layers"]) for o in doc["overhead_samples"]}
    assert layers == {("gpt2", 1), ("gpt2", 2), ("llama", 1), ("llama", 2)}
    assert doc["host"]["num_steps"] > 0 and len(doc["warmup"]) == 5


def test_profile_errors_are_one_line(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(
            monkeypatch, capsys, "profile", "--model", "tiny-gpt2", "--device", "cpu",
            "--output", str(tmp_path / "p.json"), "--repetitions", "0",
        )  # fmt: skip
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "rose-run profile: error: argument --repetitions: must be an integer in "
        "[1, 2147483647], got '0' (see rose-run profile --help)"
    )


def test_sim_with_the_profile_predicts_the_real_run_loosely(
    tiny_profile, monkeypatch, capsys, tmp_path
):
    """Both backends on the same requests, all arriving at t=0: the same scheduler
    with the profile's defaults plans the same steps (exact), and the simulated
    duration and median E2EL are within 4x of the real ones (loose).

    The bound is loose on purpose. The tiny model's steps take about a
    millisecond, where one preemption of the process by another job (a few ms
    time slice) or a slow thread wake-up triples a step; CI runners and this
    shared machine both have such neighbours, and the profile here has one
    repetition. What the test catches is a broken pipeline: seconds read as
    milliseconds, a dropped term, a fit gone wild, or defaults that differ
    between the backends (another pool or block size changes the steps).
    """
    import subprocess
    import sys

    workload = ["--workload", "synthetic", "--num-requests", "12", "--prompt-tokens", "40",
                "--output-tokens", "24", "--request-rate", "inf", "--quiet"]  # fmt: skip
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    code, _, _ = run_cli(
        monkeypatch, capsys, "--device", "cpu", "--model", "tiny-gpt2", "--max-num-seqs", "16",
        "--max-model-len", "128", "--no-progress", "--save-result", str(real), *workload,
    )  # fmt: skip
    assert code == 0
    cmd = [sys.executable, "-m", "roseinfer.cli.sim", "--cost-model", str(tiny_profile),
           "--max-num-seqs", "16", "--save-result", str(sim), *workload]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r, s = json.loads(real.read_text()), json.loads(sim.read_text())
    assert s["profile_overrides"] == {}
    for key in ("num_kv_blocks", "block_size", "max_model_len", "num_steps", "completed"):
        assert s[key] == r[key], key
    for key in ("duration", "median_e2el_ms"):
        assert r[key] / 4 < s[key] < r[key] * 4, (key, r[key], s[key])
    assert load_profile(tiny_profile).cost_model().name == "profiled"


@pytest.mark.parametrize("budget", ["256", "64"])  # 64 < --max-model-len: chunked prefill
def test_a_served_run_joins_the_profile(monkeypatch, capsys, tmp_path, budget):
    """``--served-requests``: the engine serves log-normal requests after the grid;
    its logged steps (one time each, kind ``served-...``) are fitted with the grid's."""
    from roseinfer.executor.profiler import served_workload

    reqs = served_workload(200, 128, 50257, seed=3)
    assert all(r.arrival_time_s == 0 and r.num_prompt_tokens + r.max_output_tokens <= 128
               for r in reqs)  # fmt: skip
    lengths = np.array([r.num_prompt_tokens for r in reqs])
    assert lengths.min() < 16 and lengths.max() >= 100  # spans the limit around its median 32
    assert len({r.prompt_token_ids for r in reqs}) == 200  # distinct: no prefix-cache hits
    path = tmp_path / "served.json"
    code, out, _ = run_cli(
        monkeypatch, capsys, "profile", "--device", "cpu", "--model", "tiny-gpt2", "--output",
        str(path), "--repetitions", "1", "--max-num-seqs", "8", "--max-model-len", "128",
        "--max-num-batched-tokens", budget, "--no-progress", "--served-requests", "12",
    )  # fmt: skip
    assert code == 0
    doc = json.loads(path.read_text())
    served = [s for s in doc["samples"] if s["kind"].startswith("served-")]
    assert len(served) == doc["served"]["num_steps"] > 12  # every request's prefill and decodes
    assert doc["served"]["num_requests"] == 12
    assert {s["kind"] for s in served} <= {"served-prefill", "served-decode", "served-mixed"}
    new_tokens = [sum(s["prefill_new_tokens"]) + len(s["decode_context_tokens"]) for s in served]
    assert max(new_tokens) <= int(budget)  # every step within the token budget
    assert all(len(s["times_s"]) == 1 and s["host_s"] == 0 for s in served)
    assert f"and {len(served)} steps of 12 served requests" in out
    fit = load_profile(path).step_fit  # fitted with the grid; held out apart
    assert set(fit.held_out_groups) == {"grid", "served"}
    assert sum(e.num_samples for e in fit.held_out_groups.values()) == (
        fit.held_out[fit.model.name].num_samples
    )
    assert "held-out served steps)" in out and "held-out grid steps)" in out
