"""The memory planner on CPU with a scripted memory reader.

The runner really runs its profile pass (a tiny model on CPU); the reader
reports what a CUDA device would: weights, the pool it sees allocated, a peak
over them, memory outside torch, other processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from test_model_runner import tiny  # noqa: E402

from roseinfer.executor import memory  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner, SeqInput  # noqa: E402

MIB = 2**20  # the tiny model's blocks are 1 KiB: a device of MiBs holds thousands


class ScriptedReader:
    """A CUDA device of ``total`` bytes as the planner reads it: ``weights`` and
    the runner's pool allocated, ``activations`` more at the peak, ``non_torch``
    outside torch and ``others`` held by other processes."""

    def __init__(self, runner, *, total=80 * MIB, weights=16 * MIB, activations=3 * MIB,
                 non_torch=MIB // 2, others=0):  # fmt: skip
        self.runner, self.total, self.weights = runner, total, weights
        self.activations, self.non_torch, self.others = activations, non_torch, others
        self.resets = 0

    def memory_allocated(self):
        return self.weights + self.runner.kv_cache_bytes

    def max_memory_allocated(self):
        return self.memory_allocated() + self.activations

    def memory_reserved(self):
        return self.memory_allocated()

    def mem_get_info(self):
        used = self.memory_reserved() + self.non_torch + self.others
        return self.total - used, self.total

    def reset_peak_memory_stats(self):
        self.resets += 1

    def empty_cache(self):
        pass

    def synchronize(self):
        pass


def runner_for(max_tokens_per_pass=64):
    return ModelRunner(
        tiny("tiny-llama"), num_kv_blocks=4, block_size=4, device="cpu",
        dtype=torch.float32, max_tokens_per_pass=max_tokens_per_pass, attention_backend="sdpa",
    )  # fmt: skip


def test_pool_is_vllms_rule_and_the_profile_runs_the_largest_pass(monkeypatch):
    """blocks = (total x util - weights - peak - non-torch) // block bytes; the
    profile pass is one pass of max_tokens_per_pass tokens in prompts of at most
    max_model_len, then the sampler over max_num_seqs rows."""
    runner = runner_for(max_tokens_per_pass=64)
    reader = ScriptedReader(runner)
    passes, sampled = [], []
    real_forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda seqs: passes.append(seqs) or real_forward(seqs))
    real_sample = memory.sample
    monkeypatch.setattr(
        memory, "sample", lambda lg, p, g: sampled.append(lg.shape) or real_sample(lg, p, g)
    )
    plan = memory.plan_kv_cache(
        runner, max_num_seqs=8, max_model_len=24, gpu_memory_utilization=0.9, reader=reader
    )
    budget = 80 * MIB * 0.9 - 16 * MIB - 3 * MIB - MIB // 2
    assert plan.num_kv_blocks == int(budget) // runner.block_bytes == runner.num_kv_blocks
    assert plan.kv_cache_bytes == runner.kv_cache_bytes
    assert [len(s.token_ids) for s in passes[0]] == [24, 24, 16]
    assert [s.start_pos for s in passes[0]] == [0, 0, 8]  # the last: a chunk ending at 24
    assert sampled == [(8, runner.vocab_size)] and reader.resets == 1
    assert f"({plan.num_kv_blocks} blocks) = 0.08 GiB x 0.9 - weights 0.02" in plan.describe()


def test_cap_and_pool_too_small_for_one_sequence():
    runner = runner_for()
    reader = ScriptedReader(runner)
    capped = memory.plan_kv_cache(
        runner, max_num_seqs=8, max_model_len=24, gpu_memory_utilization=0.9,
        reader=reader, max_num_kv_blocks=50,
    )  # fmt: skip
    assert capped.num_kv_blocks == 50 == runner.num_kv_blocks
    budget = int(80 * MIB * 0.9 - 16 * MIB - 3 * MIB - MIB // 2) // runner.block_bytes
    assert capped.kv_budget_bytes == budget * runner.block_bytes > capped.kv_cache_bytes
    starved = ScriptedReader(runner, weights=70 * MIB, activations=2 * MIB)
    with pytest.raises(ValueError, match=r"one --max-model-len 24 sequence needs 6 blocks.*lower"):
        memory.plan_kv_cache(
            runner, max_num_seqs=8, max_model_len=24, gpu_memory_utilization=0.9, reader=starved
        )


def test_memory_other_processes_hold_is_never_taken():
    """mem_get_info cannot tell other processes' memory from this process's
    memory outside torch: both come off the pool."""
    runner = runner_for()
    plan = memory.plan_kv_cache(
        runner, max_num_seqs=8, max_model_len=24, gpu_memory_utilization=0.9,
        reader=ScriptedReader(runner, others=40 * MIB),
    )  # fmt: skip
    assert plan.non_torch_bytes == 40 * MIB + MIB // 2
    budget = 80 * MIB * 0.9 - 16 * MIB - 3 * MIB - 40 * MIB - MIB // 2
    assert plan.num_kv_blocks == int(budget) // runner.block_bytes


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens_per_pass > 0"):
        memory.plan_kv_cache(runner_for(0), max_num_seqs=1, max_model_len=8,
                             gpu_memory_utilization=0.9, reader=None)  # fmt: skip
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        memory.plan_kv_cache(runner_for(), max_num_seqs=1, max_model_len=8,
                             gpu_memory_utilization=1.5, reader=None)  # fmt: skip
    with pytest.raises(ValueError, match="sizes CUDA pools"):
        memory.plan_kv_cache(runner_for(), max_num_seqs=1, max_model_len=8,
                             gpu_memory_utilization=0.9)  # fmt: skip


def test_profile_shapes_and_scratch_blocks():
    """Whole prompts, and a shorter piece as the last chunk of a max_model_len
    context (the longest attention a pass of that many tokens runs)."""
    assert memory.profile_step_shapes(8192, 2048) == [(2048, 2048)] * 4
    assert memory.profile_step_shapes(100, 64) == [(64, 64), (36, 64)]
    assert memory.profile_step_shapes(8192, 131072) == [(8192, 131072)]
    assert memory.profile_num_blocks(100, 64, 16) == 4 + 3


def test_default_token_budget_is_vllms():
    assert memory.default_max_num_batched_tokens(80 * 2**30, "NVIDIA H100 80GB HBM3") == 8192
    assert memory.default_max_num_batched_tokens(80 * 2**30, "NVIDIA A100-SXM4-80GB") == 2048
    assert memory.default_max_num_batched_tokens(24 * 2**30, "NVIDIA L4") == 2048


def test_graph_pool_estimate_from_the_largest_and_smallest_capture():
    """Per family, largest graph + (sizes - 1) x the smallest, each measured as
    device memory held after its capture: decode batches, then (``FULL`` mode)
    the prefill/mixed token counts."""
    assert memory.graph_pool_estimate(300, 2, 35) == 300 + 34 * 2
    used = {"bytes": 10 * MIB}
    captured = []
    held = {("decode", 256): 300, ("decode", 1): 2, ("mixed", 24): 50, ("mixed", 2): 1}

    def capture(max_num_seqs, max_model_len, sizes, mixed_sizes):
        ((family, size),) = [("decode", s) for s in sizes] + [("mixed", t) for t in mixed_sizes]
        captured.append((family, size))
        used["bytes"] += held[family, size]

    reader = SimpleNamespace(
        mem_get_info=lambda: (80 * MIB - used["bytes"], 80 * MIB),
        empty_cache=lambda: None,
        synchronize=lambda: None,
    )
    runner = SimpleNamespace(
        cuda_graphs_possible=True, device=torch.device("cuda"), mixed_graph_max_tokens=0,
        capture_cuda_graphs=capture, release_cuda_graphs=lambda: None,
    )  # fmt: skip
    assert memory._graph_pool_bytes(runner, 256, 1024, reader) == 300 + 34 * 2
    assert captured == [("decode", 256), ("decode", 1)]
    runner.mixed_graph_max_tokens = 24  # sizes 2, 4, 8, 16, 24
    assert memory._graph_pool_bytes(runner, 256, 1024, reader) == 300 + 34 * 2 + 50 + 4 * 1
    assert captured[2:] == [("decode", 256), ("decode", 1), ("mixed", 24), ("mixed", 2)]


def test_a_planned_runner_never_runs_more_than_the_profiled_pass(monkeypatch):
    """fifo with no token budget can hand the runner any step: it runs in passes
    of at most the profiled token count."""
    runner = runner_for(max_tokens_per_pass=16)
    memory.plan_kv_cache(
        runner, max_num_seqs=4, max_model_len=24, gpu_memory_utilization=0.9,
        reader=ScriptedReader(runner), max_num_kv_blocks=40,
    )  # fmt: skip
    sizes = []
    real_build = runner.input_batch.build
    monkeypatch.setattr(
        runner.input_batch, "build", lambda *a, **k: sizes.append(len(a[0])) or real_build(*a, **k)
    )
    tokens = []
    real_body = runner._body
    monkeypatch.setattr(
        runner, "_body", lambda b, m: tokens.append(b.num_tokens) or real_body(b, m)
    )
    step = [SeqInput(list(range(24)), 0, list(range(i * 6, i * 6 + 6))) for i in range(4)]
    assert runner.forward(step).shape == (4, runner.vocab_size)
    assert sum(tokens) == 96 and max(tokens) <= 16
