"""The Triton paged-attention and KV-store kernels against SDPA.

Without CUDA the kernels run on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, set here before the kernels are first imported); with
CUDA the same tests run the compiled kernels. Shapes stay tiny: the
interpreter runs each program in Python.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_model_runner import greedy, hf_greedy, prompts_of, tiny  # noqa: E402

from roseinfer.executor.attn_sdpa import offset_causal_mask, sdpa  # noqa: E402
from roseinfer.executor.attn_triton import (  # noqa: E402
    BALANCE_MIN_KEYS,
    BALANCE_SLACK,
    MAX_PARTS,
    TUNE_MARGIN,
    TritonBackend,
    balanced_work,
    extra_room,
    query_blocks,
    steady_pick,
)
from roseinfer.executor.model_runner import ModelRunner, SeqInput  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_BLOCKS = 48


def kernels():
    from roseinfer.executor import triton_kernels

    return triton_kernels


def paged_case(shapes, *, heads=4, kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32):
    """Random queries, a random pool and scattered block tables for sequences of
    ``(query_len, seq_len)``: tensors and host lists."""
    gen = torch.Generator().manual_seed(sum(q * 31 + s for q, s in shapes) + block_size)
    pool_shape = (NUM_BLOCKS, block_size, kv_heads, head_dim)
    k_cache = torch.randn(pool_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(pool_shape, generator=gen).to(DEVICE, dtype)
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for _, seq_len in shapes:
        n = max(1, -(-seq_len // block_size))
        tables.append(order[used : used + n])
        used += n
    width = max(len(t) for t in tables)
    num_tokens = sum(q for q, _ in shapes)
    q = torch.randn((num_tokens, heads, head_dim), generator=gen).to(DEVICE, dtype)
    query_lens = [ql for ql, _ in shapes]
    as_long = {"dtype": torch.long, "device": DEVICE}
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in tables], **as_long),
        "seq_lens": torch.tensor([s for _, s in shapes], **as_long),
        "query_start_loc": torch.tensor([0, *itertools.accumulate(query_lens)], **as_long),
        "shapes": shapes,
    }


def sdpa_reference(case, scale):
    """Each sequence alone: its context gathered from its blocks, SDPA with a
    bottom-right causal mask, in float32. A sequence with no key outputs 0."""
    q, k_cache, v_cache = case["q"].float(), case["k_cache"].float(), case["v_cache"].float()
    out = torch.zeros_like(q)
    start = 0
    for (query_len, seq_len), table in zip(case["shapes"], case["tables"]):
        rows = slice(start, start + query_len)
        start += query_len
        if seq_len == 0:
            continue
        blocks = torch.tensor(table, device=DEVICE)
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
        mask = offset_causal_mask(query_len, seq_len, q.device)
        out[rows] = sdpa(q[rows][None], k[None], v[None], mask, scale)[0]
    return out


def run_kernel(case, *, block_q, tile_n=16, num_splits=1, balanced=False):
    query_lens = torch.diff(case["query_start_loc"]).cpu().numpy()
    seq, start = query_blocks(query_lens, block_q)
    work = None
    if balanced:
        items, reduce = balanced_work(case["seq_lens"].cpu().numpy(), tile_n)
        as_dev = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
        work = kernels().WorkList(as_dev(items), as_dev(reduce), MAX_PARTS)
    out = torch.full_like(case["q"], float("nan"))
    scale = 1 / math.sqrt(case["q"].shape[-1])
    kernels().paged_attention(
        out,
        case["q"],
        case["k_cache"],
        case["v_cache"],
        block_tables=case["block_tables"],
        seq_lens=case["seq_lens"],
        query_start_loc=case["query_start_loc"],
        q_block_seq=torch.from_numpy(seq).to(DEVICE),
        q_block_start=torch.from_numpy(start).to(DEVICE),
        num_q_blocks=len(seq),
        block_q=block_q,
        tile_n=tile_n,
        num_splits=num_splits,
        scale=scale,
        work=work,
    )
    return out, sdpa_reference(case, scale)


# A prompt from position 0, a chunk over a cached prefix ending inside a block, a
# decode, a decode of a one-token context, a chunk spanning several blocks.
MIXED = [(5, 5), (3, 10), (1, 7), (1, 1), (6, 13)]


@pytest.mark.parametrize("block_q", [1, 4])
@pytest.mark.parametrize("block_size", [4, 6])
def test_mixed_batch_matches_sdpa(block_q, block_size):
    """Prompts, cached prefixes, chunks and decodes in one launch; block sizes that
    are and are not powers of two; one query per program or several."""
    out, expected = run_kernel(paged_case(MIXED, block_size=block_size), block_q=block_q)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_gqa_packing_and_mha(kv_heads):
    """4 query heads over 1 KV head (MQA: all packed in one program) and over 4 (MHA)."""
    out, expected = run_kernel(paged_case(MIXED, kv_heads=kv_heads), block_q=2, tile_n=32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_kv_decode_matches_and_padding_rows_give_zero(num_splits):
    """Split-KV decodes (more splits than some contexts have tiles) equal one pass;
    a padding row (sequence length 0) outputs 0, not NaN."""
    case = paged_case([(1, 17), (1, 3), (1, 40), (1, 0)])
    out, expected = run_kernel(case, block_q=4, num_splits=num_splits)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.parametrize("tile_n", [16, 32])
def test_balanced_splits_match_and_short_contexts_take_one_program(monkeypatch, tile_n):
    """Balanced splits (runs of at least 16 keys here): the long contexts are cut
    into several items, the short ones run whole, and the outputs equal one pass;
    padding rows (length 0) still output 0, and a NaN-filled output shows that
    every real row was written once."""
    from roseinfer.executor import attn_triton

    monkeypatch.setattr(attn_triton, "BALANCE_MIN_KEYS", 16)
    case = paged_case([(1, 17), (1, 3), (1, 110), (1, 0), (1, 16), (1, 45)], block_size=6)
    items, _ = balanced_work(case["seq_lens"].numpy(), tile_n)
    assert (items[:, 3] >= 0).any(), "nothing was split: the case tests nothing"
    out, expected = run_kernel(case, block_q=4, tile_n=tile_n, balanced=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    with pytest.raises(ValueError, match="work list"):
        kernels().paged_attention(
            out, case["q"], case["k_cache"], case["v_cache"], block_tables=case["block_tables"],
            seq_lens=case["seq_lens"], query_start_loc=case["query_start_loc"],
            q_block_seq=case["seq_lens"], q_block_start=case["seq_lens"], num_q_blocks=6,
            block_q=4, tile_n=16, num_splits=2, scale=1.0,
            work=kernels().WorkList(torch.zeros((12, 4), dtype=torch.long),
                                    torch.zeros((6, 3), dtype=torch.long), MAX_PARTS),
        )  # fmt: skip


def test_float16_matches_sdpa():
    out, expected = run_kernel(paged_case(MIXED, dtype=torch.float16), block_q=4)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


def test_store_kv_writes_slots_and_skips_padded_ones():
    """New K/V land at their slots; slot -1 (padding) writes nothing; K/V may be
    strided views (GPT-2's fused projection)."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn((8, 4, 2, 16), generator=gen).to(DEVICE)
    v_cache = torch.randn((8, 4, 2, 16), generator=gen).to(DEVICE)
    fused = torch.randn((5, 3 * 32), generator=gen).to(DEVICE)
    k, v = fused[:, 32:64].view(5, 2, 16), fused[:, 64:].view(5, 2, 16)
    slots = torch.tensor([3, -1, 17, 0, -1], device=DEVICE)
    expected_k, expected_v = k_cache.clone().view(-1, 2, 16), v_cache.clone().view(-1, 2, 16)
    kept = torch.tensor([0, 2, 3], device=DEVICE)
    expected_k[slots[kept]] = k[kept]
    expected_v[slots[kept]] = v[kept]
    kernels().store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 16), expected_k)
    assert torch.equal(v_cache.view(-1, 2, 16), expected_v)


def test_query_blocks_cut_each_sequence():
    import numpy as np

    seq, start = query_blocks(np.array([5, 1, 3]), 2)
    assert seq.tolist() == [0, 0, 0, 1, 2, 2]
    assert start.tolist() == [0, 2, 4, 0, 0, 2]


def test_split_rule_follows_the_capture_grid():
    """Splits only for decode batches too small for the SMs, the same for every
    batch size that pads to one capture size (so graph and eager agree)."""
    backend = TritonBackend(num_heads=8, num_kv_heads=2, device=DEVICE)
    backend.num_sms = 132
    assert backend.num_splits(1, 1) == 16  # 2 programs: capped at MAX_SPLITS
    assert backend.num_splits(3, 1) == backend.num_splits(4, 1) == 16  # ceil(4 x 132 / 8), capped
    assert backend.num_splits(57, 1) == backend.num_splits(64, 1) == 5  # ceil(528 / 128)
    assert backend.num_splits(256, 1) == 2  # ceil(528 / 512)
    assert backend.num_splits(264, 1) == 1  # 528 programs: 4 per SM
    assert backend.num_splits(2, 7) == 1  # not a decode batch
    assert backend.block_q(1) == 16 // 4 and backend.block_q(9) == 64 // 4
    assert backend.block_q(512) == 128 // 4  # long prefills: 128 rows


# ------------------------------------------------------------- in the runner


def triton_runner(model, **kw):
    return ModelRunner(
        model, num_kv_blocks=64, block_size=4, device=DEVICE, dtype=torch.float32,
        attention_backend="triton", **kw,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_triton_runner_greedy_matches_generate(name):
    """Prompts then decodes, scattered blocks; GPT-2's strided fused q/k/v and
    per-layer scale, Llama's GQA and RoPE."""
    model = tiny(name, scale_attn_by_inverse_layer_idx=True) if name == "tiny-gpt2" else tiny(name)
    model = model.to(DEVICE)
    prompts = prompts_of(3, 9, 6)
    pool = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()
    tables = [pool[i * 8 : (i + 1) * 8] for i in range(len(prompts))]
    runner = triton_runner(model)
    assert runner.attention_backend == "triton"
    assert greedy(runner, prompts, tables, 5) == [hf_greedy(model, p, 5) for p in prompts]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9000), min_size=1, max_size=300)
    | st.lists(st.sampled_from([0, 1, 5000, 9000]), min_size=1, max_size=40),
    st.sampled_from([16, 32, 64, 128]),
)
def test_balanced_work_covers_every_tile_once_within_its_fixed_room(seq_lens, tile_n):
    """Whatever the contexts: the list has its fixed length (rows + a quarter),
    each context's tiles are covered exactly once in order, a split context has
    2..MAX_PARTS equal runs listed first with consecutive partial rows that its
    reduce entry names, contexts within the slack of the run stay whole, and no
    run is longer than the batch's mean (or the minimum run) unless the room ran
    out; without a split, any prefix of b + extra_room(b) items lists rows 0..b-1."""
    import numpy as np

    lens = np.asarray(seq_lens, np.int64)
    n = len(lens)
    room = extra_room(n)
    items, reduce = balanced_work(lens, tile_n)
    assert items.shape == (n + room, 4) and reduce.shape == (room, 3)
    tiles = -(-lens // tile_n)
    real = items[items[:, 3] != -2]
    split = real[real[:, 3] >= 0]
    if len(split):
        assert (items[len(real) :, 3] == -2).all()  # padding items last
        assert (real[: len(split), 3] >= 0).all()  # split runs first
        assert split[:, 3].tolist() == list(range(len(split)))
    else:
        for b in range(1, n + 1):
            prefix = items[: b + extra_room(b)]
            assert sorted(prefix[prefix[:, 3] == -1, 0].tolist()) == list(range(b))
    run = max(-(-int(tiles.sum()) // n), -(-BALANCE_MIN_KEYS // tile_n),
              -(-int(tiles.max()) // MAX_PARTS), 1)  # fmt: skip
    entries = reduce[reduce[:, 2] > 0]
    for seq in range(n):
        mine = real[real[:, 0] == seq]
        covered = [t for lo, hi in mine[:, 1:3] for t in range(lo, min(hi, tiles[seq]))]
        assert covered == list(range(tiles[seq])), seq
        if len(mine) > 1:
            assert len(mine) <= MAX_PARTS and tiles[seq] > BALANCE_SLACK * run
            lengths = np.minimum(mine[:, 2], tiles[seq]) - mine[:, 1]
            assert lengths.max() - lengths.min() <= len(mine)  # equal runs
            (entry,) = entries[entries[:, 0] == seq]
            assert entry[1] == mine[0, 3] and entry[2] == len(mine)
        else:
            assert mine[0, 3] == -1 and seq not in entries[:, 0]
    roomy = int(np.sum(np.maximum(0, -(-tiles // run) - 1)[tiles > BALANCE_SLACK * run])) <= room
    if roomy:  # the mean's run fit: every context over the slack is split into runs of it
        assert all(
            len(real[real[:, 0] == s]) > 1 for s in np.flatnonzero(tiles > BALANCE_SLACK * run)
        )


def test_balanced_splits_in_the_runner_keep_greedy_tokens(monkeypatch):
    """A decode launch the warm-up kept balanced splits for (forced here: the
    interpreter has no speed to tune) runs them, eagerly and through the graph
    path's static buffers (a padded batch), and decodes transformers' greedy
    tokens over contexts that are and are not split."""
    from roseinfer.executor import attn_triton

    monkeypatch.setattr(attn_triton, "BALANCE_MIN_KEYS", 16)
    model = tiny("tiny-llama").to(DEVICE)
    prompts = prompts_of(85, 2, 3, 4, 2, seed=3)  # 6 tiles of 16 keys against 1s
    tables = [list(range(24)), *(list(range(24 + 8 * i, 32 + 8 * i)) for i in range(4))]
    expected = [hf_greedy(model, p, 5) for p in prompts]
    for graphs in (False, True):
        runner = triton_runner(model)
        backend = runner.backend
        backend.num_sms = 1  # so 5 and 8 rows do not split keys by the SM rule
        for rows in (5, 8):  # eager: 5 rows; the graph path pads to 8
            backend.launch[(backend.block_q(1), backend.num_splits(rows, 1))] = (16, 4, 3)
            backend.balanced.add((backend.block_q(1), backend.num_splits(rows, 1)))
        if graphs:
            runner.capture_cuda_graphs(max_num_seqs=8, max_model_len=96)
        metas, build = [], backend.build_metadata
        backend.build_metadata = lambda batch, build=build, metas=metas: (
            metas.append(build(batch)) or metas[-1]
        )
        assert greedy(runner, prompts, tables, 5) == expected, graphs
        assert metas[0].work is None  # the prefill: one program per query block
        # with graphs, the captured size's launch reads the static buffers
        decodes = [runner.graphs.decode.captured[8].meta] if graphs else metas[1:]
        assert len(decodes) == (1 if graphs else 4) and all(m.work is not None for m in decodes)
        assert all((m.work.items[:, 3] >= 0).any() for m in decodes), "nothing was split"
        assert {m.work.items.shape[0] for m in decodes} == {8 + 2 if graphs else 5 + 2}


def test_the_warm_up_keeps_balanced_splits_only_when_they_win(monkeypatch):
    """The warm-up's choice for an unsplit decode launch: it times the plain and the
    balanced launch on a uniform and a skewed pass (run here, in the interpreter,
    with scripted times) and keeps the balanced one only if it wins both together
    by the margin."""
    from roseinfer.executor import attn_triton

    monkeypatch.setattr(attn_triton, "BALANCE_MIN_KEYS", 16)
    runner = triton_runner(tiny("tiny-llama").to(DEVICE))
    backend = runner.backend
    key = (backend.block_q(1), 1)
    backend.launch[key] = (16, 4, 3)
    caches = (runner.k_cache(0), runner.v_cache(0))
    # plain then balanced, on the uniform pass then on the skewed one
    for script, kept in (
        ([10, 7, 20, 11], True),
        ([10, 9, 10, 10.9], False),
        ([5, 4, 5, 6], False),
    ):
        times, ran = iter(script), []
        backend.timer = lambda launch, times=times, ran=ran: (ran.append(launch()), next(times))[1]
        backend.balanced.clear()
        backend._choose_balanced(*caches, key, num_seqs=8, context=16, max_model_len=64)
        assert len(ran) == 4 and (key in backend.balanced) == kept, script
    backend.balanced.clear()
    backend.timer = lambda launch: (launch(), 10.0)[1]
    backend._choose_balanced(*caches, key, num_seqs=8, context=16, max_model_len=16)
    assert backend.balanced == set()  # no context longer than the others: nothing timed
    backend.balanced_splits = False
    backend._choose_balanced(*caches, key, num_seqs=8, context=16, max_model_len=64)
    assert backend.balanced == set()  # the A/B's other side never keeps them
    times = iter([3.0, 1.0, 2.0, 4.0])  # the decode candidates, in order: the second wins
    backend.timer = lambda launch: (launch(), next(times))[1]
    assert backend._fastest(*caches, num_seqs=2, query_len=1, context=16) == (64, 4, 3)


def test_triton_equals_sdpa_on_a_mixed_step_with_passes():
    """A chunk over a cached prefix, a 1-token chunk and decodes in one step, cut
    into passes of 6 tokens: the same logits as SDPA."""
    model = tiny("tiny-llama").to(DEVICE)
    prompts = prompts_of(10, 7, 9, 4, seed=6)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    logits = []
    for runner in (triton_runner(model, max_tokens_per_pass=6), ModelRunner(
        model, num_kv_blocks=64, block_size=4, device=DEVICE, dtype=torch.float32,
        attention_backend="sdpa",
    )):  # fmt: skip
        runner.forward([SeqInput(p[:5], 0, t) for p, t in zip(prompts, tables)])
        step = [
            SeqInput(prompts[0][5:], 5, tables[0]),
            SeqInput(prompts[1][5:6], 5, tables[1]),
            SeqInput([3], 5, tables[2]),
            SeqInput([4], 5, tables[3]),
        ]
        logits.append(runner.forward(step))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("separate", [True, False])
def test_a_large_mixed_pass_launches_its_decodes_apart_with_the_same_logits(monkeypatch, separate):
    """A prompt chunk over a cached prefix beside decodes (thresholds lowered to
    this size): the decode rows run in a launch of their own at the decode
    shape, and the logits equal SDPA's; with ``separate_decodes`` off, one
    launch, the same logits."""
    from roseinfer.executor import attn_triton

    monkeypatch.setattr(attn_triton, "SEPARATE_DECODES_MIN_TOKENS", 8)
    monkeypatch.setattr(attn_triton, "SEPARATE_DECODES_MIN_ROWS", 2)
    model = tiny("tiny-llama").to(DEVICE)
    prompts = prompts_of(17, 7, 9, 4, seed=8)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    runner = triton_runner(model)
    runner.backend.separate_decodes = separate
    sdpa_runner = ModelRunner(model, num_kv_blocks=64, block_size=4, device=DEVICE,
                              dtype=torch.float32, attention_backend="sdpa")  # fmt: skip
    metas, build = [], runner.backend.build_metadata
    runner.backend.build_metadata = lambda batch: metas.append(build(batch)) or metas[-1]
    logits = []
    for r in (runner, sdpa_runner):
        r.forward([SeqInput(p[:4] if i == 0 else p, 0, t)
                   for i, (p, t) in enumerate(zip(prompts, tables))])  # fmt: skip
        step = [SeqInput(prompts[0][4:], 4, tables[0])]  # a 13-token chunk over 4 cached
        step += [
            SeqInput([5 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts[1:], tables[1:]))
        ]
        logits.append(r.forward(step))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    mixed = metas[-1]
    assert (mixed.decode_blocks is not None) == separate
    if separate:
        assert mixed.decode_blocks[0].tolist() == [1, 2, 3]  # the decode rows
        assert mixed.q_block_seq.tolist() == [0] * len(mixed.q_block_seq)  # the chunk's blocks
        assert mixed.decode_launch[0] == runner.backend.block_q(1)
    assert metas[0].decode_blocks is None  # the prefills: no decode row


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from roseinfer.executor import triton_kernels as tk

def build(fn, types, consts):
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

ptr = {n: "*bf16" for n in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr")}
ptr.update({n: "*i64" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr",
                                "q_block_seq_ptr", "q_block_start_ptr", "slot_ptr",
                                "work_items_ptr", "work_reduce_ptr")})
ptr.update({n: "*fp32" for n in ("part_out_ptr", "part_max_ptr", "part_sum_ptr")})
ptr["qk_scale"] = "fp32"
for block_q, tile, splits, work in ((4, 32, 1, False), (4, 32, 8, False), (4, 64, 1, True),
                                   (16, 64, 1, False)):
    build(tk._paged_attention_kernel, ptr, dict(
        BLOCK_SIZE=16, NUM_GROUPS=4, GROUPS_P=4, BLOCK_Q=block_q, HEAD_DIM=128,
        HEAD_DIM_P=128, TILE_N=tile, NUM_SPLITS=splits, WORK_LIST=work,
        DOT_PRECISION="tf32"))
build(tk._store_kv_kernel, ptr, dict(BLOCK_SIZE=16, NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_P=8,
                                     HEAD_DIM_P=128))
for work in (False, True):
    build(tk._split_kv_reduce_kernel, ptr, dict(NUM_SPLITS=8, SPLITS_P=8, HEAD_DIM=128,
                                                HEAD_DIM_P=128, WORK_LIST=work))
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_an_h100_without_a_gpu():
    """Triton compiles the kernels to sm_90 code (bf16, Llama-3.1-8B's heads: the
    decode, split-KV and prefill variants, the store and the reduce) with its
    bundled ptxas: what the interpreter cannot check (constexpr globals, dot
    shapes, types; the balanced work list's branches). In a fresh process without
    the interpreter."""
    import subprocess
    import sys

    nvidia = importlib.util.find_spec("triton.backends.nvidia")
    if nvidia is None or nvidia.origin is None:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-2000:]


def test_tuning_keeps_the_first_candidate_within_the_margin_of_the_fastest() -> None:
    a, b, c = (32, 4, 3), (64, 4, 3), (128, 4, 3)
    assert steady_pick([]) is None
    assert steady_pick([(10.0, a), (9.9, b), (12.0, c)]) == a  # b's edge is noise
    assert steady_pick([(10.0, a), (8.0, b), (7.9, c)]) == b  # a is slower beyond the margin
    assert steady_pick([(12.0, a), (10.0 * (1 + TUNE_MARGIN) + 1e-9, b), (10.0, c)]) == c
    # a noisy re-timing that stays inside the margin keeps the same choice
    for jitter in (0.99, 1.0, 1.01):
        assert steady_pick([(10.0 * jitter, a), (10.0, b)]) == a


def test_the_simulator_knows_the_backends_graph_replayed_passes() -> None:
    """rose-sim prices ``--cudagraph-mode FULL`` by the largest pass this backend
    replays (``graph_replay.MIXED_GRAPH_MAX_TOKENS``): the two numbers are one."""
    from roseinfer.calibration.graph_replay import MIXED_GRAPH_MAX_TOKENS

    assert TritonBackend.mixed_graph_max_tokens == MIXED_GRAPH_MAX_TOKENS
