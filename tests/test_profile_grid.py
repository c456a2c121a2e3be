"""The profile grid: the step shapes real runs take under an executor's limits (no torch)."""

from __future__ import annotations

import pytest

from roseinfer.calibration.graph_replay import cuda_graph_batch_sizes
from roseinfer.calibration.profile_grid import (
    GridLimits,
    decode_batch_sizes,
    grid_counts,
    profile_grid,
)

GPU = GridLimits(2048, 256, 8192, 400_000, 16, cuda_graph_batch_sizes(256))
CPU = GridLimits(2048, 256, 1024, 910 * 16)
SMALL = GridLimits(64, 16, 256, 40 * 16, 16, cuda_graph_batch_sizes(16))


def test_graph_sizes_follow_vllm_capture_list():
    assert cuda_graph_batch_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert cuda_graph_batch_sizes(100)[-1] == 96  # batches of 97-100 run eager
    assert cuda_graph_batch_sizes(4096)[-1] == 512
    assert cuda_graph_batch_sizes(3) == (1, 2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        cuda_graph_batch_sizes(0)


def test_decode_batches_are_the_graph_sizes_plus_the_largest_batch():
    limits = GridLimits(2048, 100, 1024, 10**6, 16, cuda_graph_batch_sizes(100))
    assert decode_batch_sizes(limits) == [*cuda_graph_batch_sizes(100), 100]
    eager = GridLimits(2048, 100, 1024, 10**6)
    assert decode_batch_sizes(eager) == [1, 2, 4, 8, 16, 32, 64, 100]
    grid = profile_grid(limits)
    timed = {len(s) for kind, s in grid if kind == "decode"}
    assert timed == set(decode_batch_sizes(limits))


@pytest.mark.parametrize("limits", [GPU, CPU, SMALL, GridLimits(300, 4, 100, 10_000)])
def test_every_shape_fits_the_limits(limits):
    for kind, seqs in profile_grid(limits):
        assert kind in ("prefill", "decode", "mixed")
        assert 1 <= len(seqs) <= limits.max_num_seqs
        assert sum(n for n, _ in seqs) <= limits.max_num_batched_tokens
        assert all(1 <= n <= c <= limits.max_model_len for n, c in seqs)
        assert sum(c for _, c in seqs) <= limits.kv_capacity_tokens
        assert (kind == "decode") == all(n == 1 for n, _ in seqs)


def test_grid_covers_what_real_runs_take():
    grid = profile_grid(GPU)
    singles = [seqs[0] for kind, seqs in grid if kind == "prefill" and len(seqs) == 1]
    assert max(n for n, _ in singles) == 2048  # a chunk at the token budget
    assert any(c == n for n, c in singles) and any(c > n for n, c in singles)
    assert all((c - n) % 16 == 0 for n, c in singles)  # cached contexts are whole blocks
    batches = [seqs for kind, seqs in grid if kind == "prefill" and len(seqs) > 1]
    assert any(all(c == n for n, c in s) for s in batches)
    assert any(all(c - n == 48 for n, c in s) for s in batches)  # a shared cached prefix
    decode_contexts = {c for kind, s in grid if kind == "decode" for _, c in s}
    assert max(decode_contexts) == 8192  # contexts up to max_model_len
    mixed = [s for kind, s in grid if kind == "mixed"]
    assert any(sum(n for n, _ in s) == 2048 for s in mixed)  # at the budget
    assert any(s[0][1] > s[0][0] for s in mixed)  # a later chunk beside decodes
    assert max(len(s) - 1 for s in mixed) == 128  # half of max_num_seqs decoding


def test_grid_is_deterministic_and_counted():
    assert profile_grid(GPU, seed=3) == profile_grid(GPU, seed=3)
    assert profile_grid(GPU, seed=3) != profile_grid(GPU, seed=4)  # spread draws differ
    counts = grid_counts(profile_grid(SMALL))
    assert set(counts) == {"prefill", "decode", "mixed", "prefill_cached"}
    assert 0 < counts["prefill_cached"] < counts["prefill"]
    assert sum(counts[k] for k in ("prefill", "decode", "mixed")) == len(profile_grid(SMALL))


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="block_size"):
        GridLimits(64, 4, 64, 640, 0)
    with pytest.raises(ValueError, match="graph batch sizes"):
        GridLimits(64, 4, 64, 640, 16, (0, 1))


@pytest.mark.slow
def test_profile_times_decodes_at_the_graph_sizes_and_reports_held_out_error():
    """A tiny profile (tiny-gpt2 on the CPU) with graph sizes given: decode batches
    are timed at exactly those sizes plus the largest batch, and the profile
    records its grid and the held-out error of its fit."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from roseinfer.config import SchedulerConfig
    from roseinfer.executor.facts import model_spec_of
    from roseinfer.executor.model_runner import ModelRunner
    from roseinfer.executor.models import build_model
    from roseinfer.executor.profiler import run_profile

    torch.set_num_threads(1)
    model, hf_config, _ = build_model("tiny-gpt2", seed=0, dtype=torch.float32, device="cpu")
    config = SchedulerConfig(num_kv_blocks=64, block_size=16, max_num_seqs=6, max_model_len=64)
    runner = ModelRunner(model, num_kv_blocks=64, block_size=16, device="cpu",
                         dtype=torch.float32)  # fmt: skip
    profile = run_profile(
        runner, config, model_name="tiny-gpt2", hf_config=hf_config,
        model_spec=model_spec_of("tiny-gpt2", hf_config, torch.float32),
        max_num_batched_tokens=64, repetitions=1, show_progress=False, graph_batch_sizes=(1, 2, 4),
    )  # fmt: skip
    grid = profile.extra["grid"]
    assert grid["graph_batch_sizes"] == [1, 2, 4]
    assert grid["counts"]["decode"] == sum(1 for s in profile.samples if s.kind == "decode")
    decodes = {len(s.shape.decode_context_tokens) for s in profile.samples if s.kind == "decode"}
    assert decodes == {1, 2, 4, 6}
    held_out = profile.step_fit.held_out[profile.step_fit.model.name]
    assert held_out.num_samples > 0 and held_out.median >= 0


def test_a_gpu_grid_times_prompts_off_the_tiles_and_skewed_decodes():
    """On a GPU the grid adds odd prompt lengths between the powers of two (a GEMM
    pays whole row tiles) and decode batches with a few long contexts among short
    ones (the attention ends with the longest); a CPU grid keeps its shapes."""
    gpu, cpu = profile_grid(GPU), profile_grid(CPU)
    single = sorted({seqs[0][0] for kind, seqs in gpu if kind == "prefill" and len(seqs) == 1})
    assert {3, 23, 181, 1449} <= set(single) and all(n % 2 or n & (n - 1) == 0 or n == 2048
                                                     for n in single)  # fmt: skip
    cpu_single = {seqs[0][0] for kind, seqs in cpu if kind == "prefill" and len(seqs) == 1}
    assert not cpu_single & {3, 23, 181}

    def skew(seqs):  # longest context over the median
        contexts = sorted(c for _, c in seqs)
        return contexts[-1] / contexts[len(contexts) // 2]

    gpu_skew = max(skew(s) for k, s in gpu if k == "decode" and len(s) >= 64)
    cpu_skew = max(skew(s) for k, s in cpu if k == "decode" and len(s) >= 64)
    assert gpu_skew > 8 and cpu_skew < 3
