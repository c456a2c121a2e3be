"""The CUDA executor: Triton kernels, CUDA graphs and the memory planner on a GPU.

Every test needs a CUDA device and skips without one (``-m cuda`` selects
them). Greedy outputs are compared with transformers in float32, the kernel
with SDPA in bfloat16 at Llama-3.1-8B's head shapes, graph replay with eager
decoding token for token.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

from test_model_runner import greedy, hf_greedy, prompts_of, tiny  # noqa: E402

from roseinfer.executor import memory  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402

CUDA = torch.device("cuda")


def runner_for(model, *, dtype=torch.float32, num_kv_blocks=64, **kw):
    return ModelRunner(
        model, num_kv_blocks=num_kv_blocks, block_size=16, device=CUDA, dtype=dtype, **kw
    )


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("graphs", [False, True])
def test_auto_is_triton_and_greedy_matches_generate(name, graphs):
    model = tiny(name).to(CUDA)
    prompts = prompts_of(5, 17, 40)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    runner = runner_for(model, enforce_eager=not graphs)
    assert runner.attention_backend == "triton"
    runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=64)
    assert (runner.graphs is not None) == graphs
    assert greedy(runner, prompts, tables, 8) == [hf_greedy(model, p) for p in prompts]


def test_graph_replay_gives_the_eager_tokens_at_every_padding():
    """Decode batches of 1..9 sequences (padded to 1, 2, 4, 8, 16) replayed from
    graphs give the eager runner's tokens."""
    model = tiny("tiny-llama").to(CUDA)
    eager = runner_for(model, num_kv_blocks=256, enforce_eager=True)
    graphed = runner_for(model, num_kv_blocks=256)
    assert graphed.capture_cuda_graphs(max_num_seqs=16, max_model_len=128) > 0
    assert graphed.graph_batch_sizes == (1, 2, 4, 8, 16)
    for n in (1, 3, 5, 9):
        prompts = prompts_of(*[4 + 3 * i for i in range(n)], seed=n)
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(n)]
        assert greedy(graphed, prompts, tables, 6) == greedy(eager, prompts, tables, 6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_full_mode_replays_prefills_and_matches_generate(name):
    """``cudagraph_mode="FULL"``: prefills and mixed passes replayed from graphs
    captured per token count (prompts of 5, 17 and 40 tokens pad to 64) give
    transformers' greedy tokens, and the graphs were used."""
    model = tiny(name).to(CUDA)
    prompts = prompts_of(5, 17, 40)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    runner = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=64)
    runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=64)
    assert runner.graph_token_sizes[-1] == 64
    used = []
    real = runner.graphs.run_mixed
    runner.graphs.run_mixed = lambda b: used.append(b.num_tokens) or real(b)
    assert greedy(runner, prompts, tables, 8) == [hf_greedy(model, p) for p in prompts]
    assert used and used[0] == 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_sdpa_at_llama_8b_head_shapes(dtype):
    """32 query heads over 8 KV heads of 128, 16-token blocks, scattered; prompts,
    a chunk over a cached prefix, decodes (split-KV for a small decode batch)."""
    from roseinfer.executor import triton_kernels
    from roseinfer.executor.attn_sdpa import offset_causal_mask, sdpa
    from roseinfer.executor.attn_triton import query_blocks

    gen = torch.Generator(device=CUDA).manual_seed(0)
    num_blocks, block_size, heads, kv_heads, dim = 512, 16, 32, 8, 128
    k_cache = torch.randn((num_blocks, block_size, kv_heads, dim), generator=gen, device=CUDA)
    v_cache = torch.randn_like(k_cache)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    for shapes, splits in (([(300, 300), (77, 1100), (1, 900), (1, 17)], 1), ([(1, 2000)], 8)):
        order = torch.randperm(num_blocks, device="cpu").tolist()
        tables, used = [], 0
        for _, seq_len in shapes:
            n = -(-seq_len // block_size)
            tables.append(order[used : used + n])
            used += n
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=CUDA)
        q = torch.randn((sum(a for a, _ in shapes), heads, dim), generator=gen, device=CUDA)
        q = q.to(dtype)
        starts = torch.tensor([0, *torch.tensor([a for a, _ in shapes]).cumsum(0).tolist()])
        seq, first = query_blocks(torch.diff(starts).numpy(), 4)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(dim)
        triton_kernels.paged_attention(
            out, q, k_cache, v_cache, block_tables=block_tables,
            seq_lens=torch.tensor([s for _, s in shapes], device=CUDA),
            query_start_loc=starts.to(CUDA), q_block_seq=torch.from_numpy(seq).to(CUDA),
            q_block_start=torch.from_numpy(first).to(CUDA), num_q_blocks=len(seq), block_q=4,
            tile_n=64, num_splits=splits, scale=scale,
        )  # fmt: skip
        for i, ((query_len, seq_len), table) in enumerate(zip(shapes, tables)):
            rows = slice(int(starts[i]), int(starts[i + 1]))
            blocks = torch.tensor(table, device=CUDA)
            k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len].float()
            v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len].float()
            mask = offset_causal_mask(query_len, seq_len, CUDA)
            ref = sdpa(q[rows].float()[None], k[None], v[None], mask, scale)[0]
            torch.testing.assert_close(out[rows].float(), ref, rtol=2e-2, atol=2e-2)


def test_flex_is_refused_on_cuda_with_the_reason():
    with pytest.raises(ValueError, match="runs on CPU only.*BLOCK_M"):
        runner_for(tiny("tiny-llama").to(CUDA), attention_backend="flex")


def test_memory_planner_on_the_device():
    """The real readings: a positive activation peak, a pool that fits, and a
    runner that still runs after the pool is re-allocated."""
    model = tiny("tiny-llama").to(CUDA)
    runner = runner_for(model, num_kv_blocks=4, max_tokens_per_pass=256)
    plan = memory.plan_kv_cache(
        runner, max_num_seqs=8, max_model_len=64, gpu_memory_utilization=0.5,
        max_num_kv_blocks=1000,
    )  # fmt: skip
    assert plan.activation_peak_bytes > 0 and plan.weights_bytes > 0
    assert plan.num_kv_blocks == runner.num_kv_blocks == 1000
    prompts = prompts_of(5, 9)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(2)]
    assert greedy(runner, prompts, tables, 4) == [hf_greedy(model, p, 4) for p in prompts]


def test_tuned_launches_keep_greedy_tokens(tmp_path, monkeypatch):
    """The warm-up's launch tuning picks a launch per kind, and graphs captured
    after it still decode transformers' greedy tokens."""
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", str(tmp_path / "tune.json"))  # a fresh cache
    model = tiny("tiny-llama").to(CUDA)
    runner = runner_for(model, num_kv_blocks=256)
    assert runner.tune_attention(max_num_seqs=8, max_model_len=128) > 0
    decode_q = runner.backend.block_q(1)
    kinds = set(runner.backend.launch)
    assert any(q == decode_q for q, _ in kinds) and any(q != decode_q for q, _ in kinds)
    assert runner.tune_attention(max_num_seqs=8, max_model_len=128) < 0.5  # once per kind
    runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=128)
    prompts = prompts_of(5, 17, 40)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    assert greedy(runner, prompts, tables, 8) == [hf_greedy(model, p) for p in prompts]


def test_a_second_runner_adopts_the_first_ones_launches(tmp_path, monkeypatch):
    """Two processes on one card could time different launches; the shared cache
    gives the second runner the first one's, without timing, for the same key."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", str(path))
    model = tiny("tiny-llama").to(CUDA)
    first = runner_for(model, num_kv_blocks=256)
    assert first.tune_attention(max_num_seqs=8, max_model_len=128) > 0
    assert first.attention_tune_source == f"tuned, stored in {path}" and path.exists()
    second = runner_for(model, num_kv_blocks=256)
    assert second.tune_attention(max_num_seqs=8, max_model_len=128) == 0.0
    assert second.attention_tune_source == f"cache {path}"
    assert second.backend.launch == first.backend.launch
    assert second.backend.balanced == first.backend.balanced
    other = runner_for(model, num_kv_blocks=256)  # other limits: another key, timed
    assert other.tune_attention(max_num_seqs=16, max_model_len=128) > 0
    monkeypatch.setenv("ROSEINFER_TUNE_CACHE", "off")
    off = runner_for(model, num_kv_blocks=256)
    assert off.tune_attention(max_num_seqs=8, max_model_len=128) > 0
    assert off.attention_tune_source == "tuned"
