"""The builder wires the memory planner, the pass size, CUDA graphs and the model
adapter into every run, on CPU with a scripted CUDA memory reader.

``builder.memory_reader`` is the one seam: replaced by a reader that reports a
small "GPU", the CPU run takes the CUDA path (profile pass, planned pool, vLLM's
default pass size); the runner still runs on the CPU.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_memory_planner import MIB, ScriptedReader  # noqa: E402
from test_rose_run import one_error_line, rose_run  # noqa: E402

from roseinfer.cli import profile as profile_cli  # noqa: E402
from roseinfer.cli import run as run_cli  # noqa: E402
from roseinfer.cli import serve as serve_cli  # noqa: E402
from roseinfer.cli.executor_flags import runner_choice  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor import builder, memory, model_runner, models  # noqa: E402
from roseinfer.registry import load_registry  # noqa: E402

TINY_RUN = ["--model", "tiny-llama", "--device", "cpu", "--num-requests", "6",
            "--request-rate", "inf", "--max-model-len", "64", "--fit-lengths", "clip", "--no-progress", "--quiet",
            "--attention-backend", "sdpa", "--num-threads", "1"]  # fmt: skip


def small_gpu(monkeypatch, **reading) -> None:
    """Make the builder read a scripted device of tens of MiB (the reader sees no
    pool: the planner's scratch pool comes off what it calls held)."""

    def reader(device):
        return ScriptedReader(SimpleNamespace(kv_cache_bytes=0), **reading)

    monkeypatch.setattr(builder, "memory_reader", reader)


def result_of(monkeypatch, capsys, tmp_path, *flags: str) -> dict:
    path = tmp_path / "r.json"
    code, _, err = rose_run(monkeypatch, capsys, *TINY_RUN, "--save-result", str(path), *flags)
    assert code == 0, err
    return json.loads(path.read_text())


def test_the_planner_sizes_the_pool_and_profiles_the_runners_pass(monkeypatch, capsys, tmp_path):
    """On "CUDA" from memory: pool = total x utilization - weights - activations -
    non-torch - graphs, in the result file; the profiled pass is the runner's pass,
    vLLM's default budget for the device (2048 below 70 GiB) under fifo with no
    budget, or --max-num-batched-tokens."""
    small_gpu(monkeypatch, total=40 * MIB)
    r = result_of(monkeypatch, capsys, tmp_path, "--gpu-memory-utilization", "0.5")
    budget = (
        0.5 * r["memory_total_bytes"] - r["memory_weights_bytes"]
        - r["memory_activation_peak_bytes"] - r["memory_non_torch_bytes"]
        - r["memory_cuda_graph_bytes"]
    )  # fmt: skip
    block_bytes = r["memory_kv_cache_bytes"] // r["num_kv_blocks"]
    assert r["memory_total_bytes"] == 40 * MIB and r["memory_activation_peak_bytes"] == 3 * MIB
    assert r["num_kv_blocks"] == int(budget) // block_bytes < 256 * 4  # under the cap
    assert r["kv_cache_bytes"] == r["memory_kv_cache_bytes"] == r["memory_kv_budget_bytes"]
    assert r["max_num_batched_tokens"] is None and r["completed"] == 6
    assert r["max_tokens_per_pass"] == r["memory_profiled_tokens"] == 2048
    assert "memory planner" in r["kv_pool_source"]
    assert r["enforce_eager"] is False and r["attention_backend"] == "sdpa"

    r = result_of(monkeypatch, capsys, tmp_path, "--max-num-batched-tokens", "64",
                  "--max-num-seqs", "8")  # fmt: skip
    assert r["max_tokens_per_pass"] == r["memory_profiled_tokens"] == 64


def test_fifo_without_a_budget_runs_in_passes_of_the_profiled_size(monkeypatch, capsys, tmp_path):
    """No policy can make a step larger than the profile pass: a fifo step of six
    prompts at once runs as passes of at most the profiled token count."""
    small_gpu(monkeypatch)
    monkeypatch.setattr(memory, "default_max_num_batched_tokens", lambda total, name: 32)
    steps, passes = [], []
    runner_cls = model_runner.ModelRunner
    real_forward, real_body = runner_cls.forward, runner_cls._body

    def forward(self, seqs):
        steps.append(sum(len(s.token_ids) for s in seqs))
        return real_forward(self, seqs)

    def body(self, batch, meta):
        passes.append(batch.num_tokens)
        return real_body(self, batch, meta)

    monkeypatch.setattr(runner_cls, "forward", forward)
    monkeypatch.setattr(runner_cls, "_body", body)
    r = result_of(monkeypatch, capsys, tmp_path, "--no-warmup")
    assert r["memory_profiled_tokens"] == r["max_tokens_per_pass"] == 32
    assert r["completed"] == 6 and max(passes) <= 32 < max(steps)


def test_a_pool_too_small_for_one_sequence_is_one_error_line(monkeypatch, capsys):
    small_gpu(monkeypatch, total=20 * MIB, weights=17 * MIB)
    code, _, err = rose_run(monkeypatch, capsys, *TINY_RUN)
    line = one_error_line(err)
    assert code == 2 and "one --max-model-len 64 sequence needs" in line
    assert "lower --max-model-len" in line and "--gpu-memory-utilization" in line


def test_explicit_pools_win_over_the_planner(monkeypatch, capsys, tmp_path):
    small_gpu(monkeypatch)
    r = result_of(monkeypatch, capsys, tmp_path, "--num-kv-blocks", "300")
    assert r["num_kv_blocks"] == 300 and "memory_total_bytes" not in r
    assert r["kv_pool_source"] == "--num-kv-blocks" and r["max_tokens_per_pass"] == 2048
    r = result_of(monkeypatch, capsys, tmp_path, "--kv-cache-memory-gb", "0.001")
    assert r["kv_pool_source"] == "--kv-cache-memory-gb" and "memory_weights_bytes" not in r


def test_cpu_keeps_its_pool_and_pass(monkeypatch, capsys, tmp_path):
    """No reader on a CPU: the 1 GiB default pool capped at max_num_seqs sequences,
    the runner's CPU pass; --enforce-eager is recorded."""
    r = result_of(monkeypatch, capsys, tmp_path, "--enforce-eager")
    assert r["num_kv_blocks"] == 256 * 64 // 16 and "memory_total_bytes" not in r
    assert r["max_tokens_per_pass"] == model_runner.CPU_MAX_TOKENS_PER_PASS
    assert r["enforce_eager"] is True and r["cuda_graph_capture_s"] == 0.0


def test_the_adapter_is_built_once_per_run(monkeypatch, capsys, tmp_path):
    calls = []
    real = models.make_adapter

    def counting(model):
        calls.append(model)
        return real(model)

    for module in (builder, model_runner):
        monkeypatch.setattr(module, "make_adapter", counting)
    result_of(monkeypatch, capsys, tmp_path)
    assert len(calls) == 1


def test_an_adapter_needs_its_model_in_place():
    model, _, _ = models.build_model("tiny-llama", seed=0, dtype=torch.float32, device="cpu")
    adapter = models.make_adapter(model)
    with pytest.raises(ValueError, match="device and dtype first"):
        model_runner.ModelRunner(model, num_kv_blocks=4, block_size=4, device="cpu",
                                 dtype=torch.float64, adapter=adapter)  # fmt: skip


@pytest.mark.parametrize("parser", [run_cli.build_parser, serve_cli.build_parser,
                                    profile_cli.build_parser])  # fmt: skip
def test_enforce_eager_is_a_flag_of_every_command(parser):
    argv = ["--output", "p.json"] if parser is profile_cli.build_parser else []
    args = parser().parse_args([*argv, "--enforce-eager", "--attention-backend", "triton"])
    assert runner_choice(args) == builder.RunnerChoice("triton", enforce_eager=True)
    assert runner_choice(parser().parse_args(argv)).enforce_eager is False


def test_warm_up_captures_graphs_even_without_the_shapes(monkeypatch):
    """Graph capture is part of every warm-up; --no-warmup skips only the shapes."""
    shapes = []
    monkeypatch.setattr(builder, "warm_up_shapes", lambda runner, config: shapes.append(config))
    captured, tuned = [], []
    runner = SimpleNamespace(graphs=None, capture_cuda_graphs=lambda *a: captured.append(a),
                             tune_attention=lambda *a: tuned.append(a))  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=64, max_num_seqs=8, max_model_len=128)
    builder.warm_up(runner, config, shapes=False)  # type: ignore[arg-type]
    assert captured == [(8, 128)] and shapes == [] and tuned == [(8, 128)]
    builder.warm_up(runner, config)  # type: ignore[arg-type]
    assert len(captured) == 2 and shapes == [config]
    runner.graphs = object()  # captured already (a replay's second run): not again
    builder.warm_up(runner, config)  # type: ignore[arg-type]
    assert len(captured) == 2 and len(shapes) == 2


def test_rose_run_profile_profiles_its_grids_largest_step(monkeypatch, tmp_path):
    """rose-run profile: the planner's profile pass and the runner's pass are the
    grid's largest step (--max-num-batched-tokens), one pass as in rose-run."""
    small_gpu(monkeypatch)
    seen = {}

    def fake_profile(runner, config, **kw):
        seen.update(runner=runner, config=config, **kw)

    monkeypatch.setattr("roseinfer.executor.profiler.run_profile", fake_profile)
    args = profile_cli.build_parser().parse_args(
        ["--output", str(tmp_path / "p.json"), "--model", "tiny-llama", "--device", "cpu",
         "--max-num-batched-tokens", "96", "--max-model-len", "64", "--max-num-seqs", "4",
         "--attention-backend", "sdpa", "--quiet"]
    )  # fmt: skip
    profile_cli._profile(args)
    runner, config = seen["runner"], seen["config"]
    assert runner.max_tokens_per_pass == seen["max_num_batched_tokens"] == 96
    assert config.num_kv_blocks == runner.num_kv_blocks <= 4 * 64 // 16
    assert seen["kv_cache_budget_bytes"] >= runner.kv_cache_bytes


def test_new_runner_checks_the_memory_and_takes_the_config_pass(monkeypatch):
    model, _, _ = models.build_model("tiny-gpt2", seed=0, dtype=torch.float32, device="cpu")
    monkeypatch.setattr(builder, "available_memory_bytes", lambda device: 1000)
    config = SchedulerConfig(num_kv_blocks=64, max_model_len=128)
    with pytest.raises(builder.BuildError, match="needs .* GiB but cpu has"):
        builder.new_runner(model, config, device="cpu", dtype=torch.float32)
    monkeypatch.undo()
    small_gpu(monkeypatch)
    batched = SchedulerConfig(num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=512)
    runner = builder.new_runner(model, batched, device="cpu", dtype=torch.float32)
    assert runner.max_tokens_per_pass == 512 and runner.num_kv_blocks == 64


def test_the_builder_serves_the_replay(monkeypatch):
    """The fidelity replay builds its runner with the builder (same pass rule)."""
    from roseinfer.executor.replay import ExecutorReplay

    model, _, _ = models.build_model("tiny-gpt2", seed=0, dtype=torch.float32, device="cpu")
    made = []
    real = builder.new_runner
    monkeypatch.setattr("roseinfer.executor.replay.new_runner",
                        lambda *a, **k: made.append(k["choice"]) or real(*a, **k))  # fmt: skip
    replay = ExecutorReplay(model, device="cpu", dtype=torch.float32, registry=load_registry(),
                            enforce_eager=True)  # fmt: skip
    config = SchedulerConfig(num_kv_blocks=32, max_model_len=128)
    assert replay.runner_for(config) is replay.runner_for(config)
    assert made == [builder.RunnerChoice("auto", enforce_eager=True)]
