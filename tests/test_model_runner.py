"""The model runner against transformers: greedy tokens equal ``generate()``.

Tiny random models in float32 on CPU. Weights use ``initializer_range=0.5``:
with the default 0.02 a random model greedily repeats its last prompt token,
so a broken attention would still "match" (each test checks the outputs vary).
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import tiny_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from roseinfer.executor import attn_flash, attn_flex, model_runner  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner, SeqInput  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.executor.sampler import filtered_probs, sample  # noqa: E402
from roseinfer.request import SamplingParams  # noqa: E402

torch.set_num_threads(1)

BLOCK_SIZE = 4
NUM_NEW_TOKENS = 8


def tiny(name: str, **overrides):
    """The shared tiny model (``conftest.tiny_model``)."""
    return tiny_model(name, **overrides)


@pytest.fixture(scope="module", params=["tiny-gpt2", "tiny-llama", "tiny-qwen2"])
def model(request):
    return tiny(request.param)


def runner_for(model, device="cpu", **kw) -> ModelRunner:
    return ModelRunner(
        model, num_kv_blocks=64, block_size=BLOCK_SIZE, device=device, dtype=torch.float32, **kw
    )


def prompts_of(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], num_tokens: int = NUM_NEW_TOKENS) -> list[int]:
    """``generate()`` with EOS off, so it runs exactly ``num_tokens`` steps."""
    config = GenerationConfig(
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    ids = torch.tensor([prompt], device=model.device)
    return model.generate(ids, generation_config=config)[0, len(prompt) :].tolist()


def tables_for(num_seqs: int, first_block: int = 0, blocks_per_seq: int = 8) -> list[list[int]]:
    """Trivial allocation: consecutive block ids per sequence."""
    return [
        list(range(first_block + i * blocks_per_seq, first_block + (i + 1) * blocks_per_seq))
        for i in range(num_seqs)
    ]


def decode(runner, prompts, first_tokens, tables, num_tokens=NUM_NEW_TOKENS) -> list[list[int]]:
    """Greedy decode loop, all sequences in one forward per step."""
    outs = [[t] for t in first_tokens]
    for _ in range(num_tokens - 1):
        inputs = [
            SeqInput([o[-1]], len(p) + len(o) - 1, t)
            for p, o, t in zip(prompts, outs, tables, strict=True)
        ]
        for out, token in zip(outs, runner.forward(inputs).argmax(-1).tolist(), strict=True):
            out.append(token)
    return outs


def greedy(runner, prompts, tables, num_tokens=NUM_NEW_TOKENS) -> list[list[int]]:
    """The prompts' prefill in one forward, then :func:`decode`: greedy tokens."""
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    return decode(runner, prompts, logits.argmax(-1).tolist(), tables, num_tokens)


def assert_varied(outputs: list[list[int]]) -> None:
    for out in outputs:
        assert len(set(out)) > 2, f"degenerate output {out}: raise initializer_range"


# ------------------------------------------------------------- equivalence


def test_batched_prefill_then_decode_matches_generate(model):
    prompts = prompts_of(3, 9, 14)
    runner = runner_for(model)
    tables = tables_for(len(prompts))
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    assert logits.shape == (3, model.config.vocab_size) and logits.dtype == torch.float32
    outs = decode(runner, prompts, logits.argmax(-1).tolist(), tables)
    expected = [hf_greedy(model, p) for p in prompts]
    assert_varied(expected)
    assert outs == expected


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_prefix_blocks_shared_in_the_same_forward(name):
    """B reuses A's two full prefix blocks while A writes them in this forward
    (B listed first); C hits the same cached prefix in a later, mixed step."""
    model = tiny(name)
    prefix = prompts_of(8, seed=2)[0]
    tail_a, tail_b, tail_c = prompts_of(3, 5, 2, seed=3)
    prompt_a, prompt_b, prompt_c = prefix + tail_a, prefix + tail_b, prefix + tail_c
    table_a, table_b, table_c = [0, 1, 2, 3, 4], [0, 1, 10, 11, 12], [0, 1, 20, 21, 22]
    runner = runner_for(model)
    step1 = runner.forward([SeqInput(tail_b, 8, table_b), SeqInput(prompt_a, 0, table_a)])
    out_b, out_a = ([t] for t in step1.argmax(-1).tolist())
    # Step 2: C's prefill of its uncached tail alongside the decodes of A and B.
    step2 = runner.forward(
        [
            SeqInput(tail_c, 8, table_c),
            SeqInput([out_a[-1]], len(prompt_a), table_a),
            SeqInput([out_b[-1]], len(prompt_b), table_b),
        ]
    )
    first_c, token_a, token_b = step2.argmax(-1).tolist()
    out_a.append(token_a)
    out_b.append(token_b)
    rest = decode(
        runner,
        [prompt_a + out_a[:-1], prompt_b + out_b[:-1]],
        [token_a, token_b],
        [table_a, table_b],
        NUM_NEW_TOKENS - 1,
    )
    rest_c = decode(runner, [prompt_c], [first_c], [table_c])
    expected = [hf_greedy(model, p) for p in (prompt_a, prompt_b, prompt_c)]
    assert_varied(expected)
    assert [out_a[:1] + rest[0], out_b[:1] + rest[1], rest_c[0]] == expected


LOGIT_CASES = {
    "gpt2-scale-by-layer": ("tiny-gpt2", {"scale_attn_by_inverse_layer_idx": True}),
    "llama-llama3-rope": (
        "tiny-llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-mha-no-gqa": ("tiny-llama", {"num_key_value_heads": 4}),
    "qwen2": ("tiny-qwen2", {}),
}


@pytest.mark.parametrize("case", sorted(LOGIT_CASES))
def test_chunked_prefill_logits_match_hf_forward(case):
    """A 30-token prompt in chunks of 13, 1 and 16 tokens (start_pos > 0)."""
    name, overrides = LOGIT_CASES[case]
    model = tiny(name, **overrides)
    prompt = prompts_of(30, seed=4)[0]
    runner, table = runner_for(model), tables_for(1)[0]
    for start, end in ((0, 13), (13, 14), (14, 30)):
        logits = runner.forward([SeqInput(prompt[start:end], start, table)])[0]
        with torch.no_grad():
            expected = model(torch.tensor([prompt[:end]])).logits[0, -1].float()
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def reference_flash_varlen(
    q,
    k_cache,
    v_cache,
    *,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    block_table,
):
    """flash-attn's documented semantics (paged K/V, bottom-right causal, GQA)."""
    assert causal and q.dtype == k_cache.dtype and block_table.dtype == torch.int32
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        q_lo, q_hi = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ctx = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        blocks = block_table[i, : math.ceil(ctx / block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1)
        groups = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        qi = q[q_lo:q_hi].transpose(0, 1)
        scores = qi @ k.transpose(1, 2) * softmax_scale
        pos_q = torch.arange(ctx - (q_hi - q_lo), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos_q, float("-inf"))
        out[q_lo:q_hi] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def test_flash_backend_metadata_with_a_reference_kernel(monkeypatch):
    """The flash-attn call (cu_seqlens, block table, causal) checked on CPU
    against a Python kernel with flash-attn's documented semantics."""
    monkeypatch.setattr(attn_flash, "load_flash_varlen", lambda: reference_flash_varlen)
    model = tiny("tiny-llama")
    runner = runner_for(model, attention_backend="flash_attn")
    assert runner.attention_backend == "flash_attn"
    prompts, tables = prompts_of(2, 7, 11), tables_for(3)
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    outs = decode(runner, prompts, logits.argmax(-1).tolist(), tables)
    assert outs == [hf_greedy(model, p) for p in prompts]


def test_decode_logits_do_not_depend_on_batch_companions():
    model = tiny("tiny-llama")
    prompts, tables = prompts_of(5, 17), tables_for(2)
    runner = runner_for(model)
    runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    both = runner.forward([SeqInput([7], 5, tables[0]), SeqInput([9], 17, tables[1])])
    alone = runner.forward([SeqInput([7], 5, tables[0])])
    torch.testing.assert_close(both[0], alone[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_value_error():
    runner = runner_for(tiny("tiny-gpt2"))  # 256 positions, 64 blocks of 4
    with pytest.raises(ValueError, match="block table has 1"):
        runner.forward([SeqInput(list(range(5)), 0, [0])])
    with pytest.raises(ValueError, match="outside"):
        runner.forward([SeqInput([1, 2], 0, [64])])
    big = ModelRunner(
        tiny("tiny-gpt2"), num_kv_blocks=65, block_size=4, device="cpu", dtype=torch.float32
    )
    with pytest.raises(ValueError, match="exceeds the model's 256"):
        big.forward([SeqInput([1], 256, list(range(65)))])
    with pytest.raises(ValueError, match="at least one"):
        runner.forward([])
    with pytest.raises(ValueError, match="attention_backend"):
        runner_for(tiny("tiny-gpt2"), attention_backend="magic")


def test_the_vectorized_check_names_what_the_per_sequence_one_names():
    """``forward`` checks a whole step with numpy and, when something is wrong, names
    the first bad sequence exactly as checking one by one does; a good step passes
    both (block tables as lists or as the block manager's ``array('i')``)."""

    from hypothesis import given, settings
    from hypothesis import strategies as st

    runner = runner_for(tiny("tiny-gpt2"))  # 256 positions, 64 blocks of 4
    seq = st.builds(
        lambda n, start, table, as_array: SeqInput(
            [1] * n, start, array("i", table) if as_array else table
        ),
        st.integers(0, 3), st.integers(-1, 256), st.lists(st.integers(-1, 64), max_size=66),
        st.booleans(),
    )  # fmt: skip

    @settings(max_examples=150, deadline=None)
    @given(seqs=st.lists(seq, min_size=1, max_size=5))
    def check(seqs: list[SeqInput]) -> None:
        expected = None
        for i, s in enumerate(seqs):
            try:
                model_runner._check_seq(i, s, 4, 64, runner.shape.max_context_tokens)
            except ValueError as err:
                expected = str(err)
                break
        try:
            arrays = runner._check(seqs)
        except ValueError as err:
            assert str(err) == expected
        else:
            assert expected is None
            used = [
                b
                for s in seqs
                for b in list(s.block_table)[: -(-(s.start_pos + len(s.token_ids)) // 4)]
            ]
            assert arrays.block_ids.tolist() == used
            assert arrays.query_lens.tolist() == [len(s.token_ids) for s in seqs]
            assert arrays.starts.tolist() == [s.start_pos for s in seqs]

    check()


def test_block_ids_are_the_managers_table_read_in_place():
    """The engine hands the runner the block manager's own table (no per-id copy);
    it equals the copy ``block_table`` gives, and the input batch reads the same
    rows from it as from a list."""
    from roseinfer.block_manager import BlockManager
    from roseinfer.executor.input_batch import host_arrays
    from roseinfer.request import Request
    from roseinfer.sequence import Sequence

    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    seqs = [Sequence(i, Request(f"r{i}", 0.0, n, 4)) for i, n in enumerate((5, 13, 1))]
    for s in seqs:
        bm.allocate(s)
    assert all(list(bm.block_ids(s)) == bm.block_table(s) for s in seqs)
    live = [SeqInput([1], s.num_prompt_tokens - 1, bm.block_ids(s)) for s in seqs]
    copied = [SeqInput([1], s.num_prompt_tokens - 1, bm.block_table(s)) for s in seqs]
    a, b = host_arrays(live, 4, pad_to=4), host_arrays(copied, 4, pad_to=4)
    assert a[1].block_tables.tolist() == b[1].block_tables.tolist()
    assert all((a[0][k] == b[0][k]).all() for k in a[0])
    runner_for(tiny("tiny-gpt2"))._check(live)


@pytest.mark.parametrize("as_array", [True, False])
def test_a_table_shorter_than_its_count_is_refused_whatever_its_type(as_array):
    """The block ids are read in one join of the tables' bytes (an ``array('i')``
    per sequence) or per table (lists, wider integer arrays): a short table must
    not pass as fewer ids, nor 8-byte items as twice as many."""
    from roseinfer.executor.input_batch import used_block_ids

    table = array("i", [3, 4]) if as_array else [3, 4]
    seqs = [SeqInput([1], 0, array("i", [7])), SeqInput([1], 4, table)]
    assert used_block_ids(seqs, np.array([1, 2])).tolist() == [7, 3, 4]
    with pytest.raises(ValueError, match="shorter"):
        used_block_ids(seqs, np.array([1, 3]))
    wide = [SeqInput([1], 0, array("q", [7, 8])), SeqInput([1], 0, np.array([9], np.int64))]
    assert used_block_ids(wide, np.array([2, 1])).tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="shorter"):
        used_block_ids(wide, np.array([3, 1]))


def test_unknown_model_name_lists_known_names():
    with pytest.raises(ValueError, match="tiny-llama.*local directory"):
        build_model("no-such-model", seed=0, dtype=torch.float32, device="cpu")


def test_build_model_from_a_saved_directory(tmp_path):
    model = tiny("tiny-llama")
    model.save_pretrained(tmp_path)
    loaded, config, tokenizer = build_model(
        str(tmp_path), seed=123, dtype=torch.float32, device="cpu"
    )
    assert tokenizer is None and config.model_type == "llama"
    prompt = prompts_of(6)[0]
    runner = runner_for(loaded)
    first = runner.forward([SeqInput(prompt, 0, tables_for(1)[0])]).argmax(-1).tolist()
    assert first == hf_greedy(model, prompt, 1)


def test_random_init_is_seeded():
    a, b = tiny("tiny-gpt2"), tiny("tiny-gpt2")
    torch.testing.assert_close(a.lm_head.weight, b.lm_head.weight)


# ---------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    other = SamplingParams(temperature=0.8, top_k=10)
    engine_gen = torch.Generator().manual_seed(0)

    def draws(rows: list[int], with_companion: bool) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        tokens = []
        for row in rows:
            if with_companion:
                picked = sample(logits[[1, row]], [other, params], [engine_gen, gen])[1]
            else:
                picked = sample(logits[[row]], [params], [gen])[0]
            tokens.append(picked)
        return tokens

    rows = [0, 2, 0, 2, 0, 2, 0, 2]
    assert draws(rows, False) == draws(rows, True)
    assert len(set(draws(rows, False))) > 1


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    greedy = logits.argmax(-1)
    for p in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
    ):
        probs = filtered_probs(logits, [p] * 4)
        assert torch.equal(probs.argmax(-1), greedy) and torch.all((probs > 0).sum(-1) == 1)
        gen = torch.Generator().manual_seed(0)
        assert sample(logits, [p] * 4, [gen] * 4) == greedy.tolist()
    assert sample(logits, [SamplingParams()] * 4, [None] * 4) == greedy.tolist()


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    top3 = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=5.0, top_k=3)]
    picked = {sample(logits, params, [gen])[0] for _ in range(60)}
    assert picked == top3


# -------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_matches_generate():
    model = tiny("tiny-llama").to("cuda")
    prompts, tables = prompts_of(4, 11), tables_for(2)
    runner = runner_for(model, device="cuda")
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    assert logits.device.type == "cuda"
    outs = decode(runner, prompts, logits.argmax(-1).tolist(), tables)
    assert outs == [hf_greedy(model, p) for p in prompts]


# ------------------------------------------------- backends, passes, kernels


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_each_backend_matches_generate_with_scattered_blocks(name, backend):
    """Block tables in no order and shared by nobody; contexts that end on a
    block boundary, inside a block and inside the first block."""
    model = tiny(name)
    prompts = prompts_of(3, 8, 13, 2)
    pool = torch.randperm(64, generator=torch.Generator().manual_seed(5)).tolist()
    tables = [pool[i * 8 : (i + 1) * 8] for i in range(len(prompts))]
    runner = runner_for(model, attention_backend=backend)
    assert runner.attention_backend == backend
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    outs = decode(runner, prompts, logits.argmax(-1).tolist(), tables)
    assert outs == [hf_greedy(model, p) for p in prompts]
    assert runner.attention_backend == backend  # no silent fallback on the way


def test_flex_equals_sdpa_on_a_mixed_step():
    """One step mixing a prefill chunk (start_pos > 0, not block-aligned), a
    1-token prefill chunk and decodes: flex and sdpa give the same logits."""
    model = tiny("tiny-llama")
    prompts = prompts_of(10, 7, 9, 4, seed=6)
    tables = tables_for(len(prompts))
    runners = [runner_for(model, attention_backend=b) for b in ("sdpa", "flex")]
    logits = []
    for runner in runners:
        runner.forward([SeqInput(p[:5], 0, t) for p, t in zip(prompts, tables)])
        step = [
            SeqInput(prompts[0][5:], 5, tables[0]),  # 5-token chunk from position 5
            SeqInput(prompts[1][5:6], 5, tables[1]),  # 1-token prefill chunk
            SeqInput([3], 5, tables[2]),  # decodes
            SeqInput([4], 5, tables[3]),
        ]
        logits.append(runner.forward(step))
    torch.testing.assert_close(
        logits[0], logits[1], rtol=1e-4, atol=1e-4
    )  # float32, two reduction orders


def test_passes_give_the_logits_of_one_pass():
    """A step cut into passes of 6 tokens (prompts cut mid-way, decodes after)
    gives the logits of the same step in one pass."""
    model = tiny("tiny-gpt2")
    prompts = prompts_of(9, 2, 14, seed=7)
    tables = tables_for(len(prompts) + 1)
    results = []
    for max_tokens in (0, 6):
        runner = runner_for(model, max_tokens_per_pass=max_tokens)
        runner.forward([SeqInput(prompts_of(5, seed=8)[0], 0, tables[3])])
        step = [SeqInput(p, 0, t) for p, t in zip(prompts, tables)]
        results.append(runner.forward([*step, SeqInput([1], 5, tables[3])]))
    assert results[0].shape == (4, model.config.vocab_size)
    torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(results[0].argmax(-1), results[1].argmax(-1))


def test_split_passes_cuts_only_what_does_not_fit_a_pass():
    seqs = [SeqInput([1] * n, s, [0]) for n, s in ((3, 0), (4, 2), (1, 9), (9, 0))]
    passes = model_runner.split_passes(seqs, 5)
    shapes = [[(len(p.token_ids), p.start_pos) for p in pieces] for pieces, _ in passes]
    # (4, 2) fits a fresh pass whole; (9, 0) is longer than a pass, so it is cut.
    assert shapes == [[(3, 0)], [(4, 2), (1, 9)], [(5, 0)], [(4, 5)]]
    assert [emit for _, emit in passes] == [[True], [True, True], [False], [True]]
    assert model_runner.split_passes(seqs, 0) == [(seqs, [True] * 4)]


def test_gelu_new_in_place_has_the_bits_of_transformers():
    from transformers.activations import NewGELUActivation

    from roseinfer.executor.adapters import gelu_new_

    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(gelu_new_(x.clone()), NewGELUActivation()(x))


def test_flex_that_does_not_compile_falls_back_or_raises(monkeypatch):
    def broken(config):
        def fail(*args):
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(attn_flex, "compiled_flex", broken)
    model = tiny("tiny-gpt2")
    assert runner_for(model).attention_backend == "sdpa"
    with pytest.raises(ValueError, match="does not compile here.*use 'sdpa'"):
        runner_for(model, attention_backend="flex")
    with pytest.raises(ValueError, match="max_tokens_per_pass"):
        runner_for(model, max_tokens_per_pass=-1)


def test_flex_failing_mid_run_falls_back_to_sdpa_with_the_same_tokens(monkeypatch):
    model = tiny("tiny-llama")
    prompts, tables = prompts_of(6, 9), tables_for(2)
    runner = runner_for(model, attention_backend="flex")
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    monkeypatch.setattr(attn_flex, "compiled_flex", lambda config: None)  # calling None fails
    outs = decode(runner, prompts, logits.argmax(-1).tolist(), tables)
    assert runner.attention_backend == "sdpa"
    assert outs == [hf_greedy(model, p) for p in prompts]


def test_backend_choice_per_device(monkeypatch):
    """auto: triton on CUDA when importable (else sdpa without flash-attn), flex on
    CPU; triton on CPU only under the interpreter; flex never on CUDA."""
    from roseinfer.executor import attention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(attention, "triton_importable", lambda: True)
    assert attention.resolve_backend("auto", cuda, torch.bfloat16, 16)[0] == "triton"
    assert attention.resolve_backend("auto", cpu, torch.float32, 16)[0] == "flex"
    monkeypatch.setattr(attention, "triton_importable", lambda: False)
    assert attention.resolve_backend("auto", cuda, torch.bfloat16, 16)[0] == "sdpa"
    with pytest.raises(ValueError, match="needs the triton package"):
        attention.resolve_backend("triton", cuda, torch.bfloat16, 16)
    monkeypatch.setattr(attention, "triton_importable", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA; on cpu only in Triton's interpreter"):
        attention.resolve_backend("triton", cpu, torch.float32, 16)
    with pytest.raises(ValueError, match="runs on CPU only.*BLOCK_M"):
        attention.resolve_backend("flex", cuda, torch.bfloat16, 16)


def test_host_time_is_recorded_per_forward_when_asked():
    runner = runner_for(tiny("tiny-gpt2"), attention_backend="sdpa")
    runner.forward([SeqInput([1, 2, 3], 0, [0])])
    assert runner.host_times_s is None
    runner.host_times_s = []
    runner.forward([SeqInput([4], 3, [0])])
    runner.forward([SeqInput([5], 4, [0, 1])])
    assert len(runner.host_times_s) == 2 and all(t > 0 for t in runner.host_times_s)


def test_the_decode_host_benchmark_times_each_part(tmp_path):
    """``benchmarks/decode_host.py`` at a tiny size: every part of a decode step's
    host work is timed and positive, here and against a "baseline" python and a
    side with balanced key splits (8 rows: unsplit by the interpreter's SM rule)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_host.py"
    sys.path.insert(0, str(script.parent))
    try:
        import decode_host
    finally:
        sys.path.remove(str(script.parent))
    parts = decode_host.measure(4, steps=3, warmup=1)
    assert set(parts) == {"plan", "inputs", "forward", "rest", "total"}
    assert parts["forward"] > 0 and parts["total"] >= parts["forward"]
    done = subprocess.run(
        [sys.executable, str(script), "--batch-sizes", "8", "--steps", "2", "--warmup", "1",
         "--rounds", "1", "--baseline-python", sys.executable, "--balanced", "--skew", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "this/base" in done.stdout and "bal/this" in done.stdout


def test_scratch_inputs_hand_the_runner_array_tables_as_the_engine_does():
    """The step table, the profile grid and the warm-up time steps built by
    ``scratch_inputs``: with list tables they timed a read of the block ids (one
    numpy call per sequence) that the engine's ``array('i')`` tables skip, and the
    block-table benchmark prints both reads."""
    import subprocess
    import sys
    from array import array
    from pathlib import Path

    from roseinfer.executor.input_batch import used_block_ids
    from roseinfer.executor.warmup import scratch_inputs

    inputs = scratch_inputs([(1, 40), (3, 20)], 16, num_kv_blocks=4, vocab_size=50)
    assert all(isinstance(s.block_table, array) for s in inputs)
    assert [list(s.block_table) for s in inputs] == [[0, 1, 2], [3, 0]]  # wraps the pool
    assert used_block_ids(inputs, np.array([3, 2])).tolist() == [0, 1, 2, 3, 0]
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "block_table_read.py"
    done = subprocess.run(
        [sys.executable, str(script), "--batch-sizes", "2,8", "--number", "2", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[2:]]
    assert [r[0] for r in rows] == ["2", "8"] and all(float(v) > 0 for r in rows for v in r[1:])
