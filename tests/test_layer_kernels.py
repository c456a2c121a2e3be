"""The fused layer kernels (RMSNorm, RoPE, SwiGLU) and the fused Llama adapter.

Without CUDA the kernels run on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, set before the kernels are first imported); with CUDA
the compiled kernels run. References are transformers' own modules.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_model_runner import hf_greedy, prompts_of, tiny  # noqa: E402

from roseinfer.executor import layer_kernels as kernels  # noqa: E402
from roseinfer.executor.adapters import LlamaAdapter, _rope  # noqa: E402
from roseinfer.executor.llama_fused import FusedLlamaAdapter, Unsummed, fuse_linears  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner, SeqInput  # noqa: E402
from roseinfer.executor.models import make_adapter  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_llama_rms_norm(dtype, with_residual):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(48, seed=3))
    x, r = rand(5, 48, dtype=dtype), rand(5, 48, dtype=dtype, seed=1)
    summed = x + r
    got_x = x.clone()
    out = kernels.rms_norm(got_x, norm.weight, 1e-5, residual=r if with_residual else None)
    ref_in = summed if with_residual else x
    torch.testing.assert_close(out, norm(ref_in).detach(), rtol=TOL[dtype], atol=TOL[dtype])
    # with a residual, x becomes the new residual stream x + r: the eager add's bits
    # in float32; in bf16 within one ulp (the interpreter truncates where GPUs round)
    ulp = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got_x, ref_in, rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rotates_q_and_k_in_place_like_transformers(dtype):
    heads, kv_heads, dim, tokens = 4, 2, 16, 7
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 1, 2, 9, 3, 30, 31], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=DEVICE).float() / dim))
    freqs = torch.arange(40, device=DEVICE)[:, None].float() * inv_freq[None, :]
    cos_t, sin_t = freqs.cos().to(dtype), freqs.sin().to(dtype)
    emb = torch.cat((freqs, freqs), -1)[positions]
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    ref_q = _rope(qkv[:, : heads * dim].view(tokens, heads, dim), cos, sin)
    ref_k = _rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, -1, dim), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.rotary_embedding(qkv[:, : (heads + kv_heads) * dim], positions, cos_t, sin_t)
    tol = TOL[dtype]
    torch.testing.assert_close(qkv[:, : heads * dim].view(tokens, heads, dim), ref_q,
                               rtol=tol, atol=tol)  # fmt: skip
    got_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, -1, dim)
    torch.testing.assert_close(got_k, ref_k, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (6, 3, 12)])
def test_rotary_with_store_writes_what_rotating_then_storing_writes(dtype, heads, kv_heads, dim):
    """One launch rotates q and k in place and stores the rotated k and v at their
    slots: the same bits as the rotation followed by the Triton backend's store,
    and nothing for a padded row (slot -1)."""
    from roseinfer.executor import triton_kernels

    tokens, block_size = 5, 4
    qkv = rand(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    positions = torch.tensor([0, 3, 7, 2, 30], device=DEVICE)
    cos, sin = rand(40, dim // 2, dtype=dtype, seed=1), rand(40, dim // 2, dtype=dtype, seed=2)
    slots = torch.tensor([0, 1, -1, 5, 9], device=DEVICE)
    qk_cols = (heads + kv_heads) * dim
    cache = lambda: torch.full((4, block_size, kv_heads, dim), 7.0, device=DEVICE).to(dtype)  # noqa: E731
    fused, k_cache, v_cache = qkv.clone(), cache(), cache()
    kernels.rotary_embedding(fused[:, :qk_cols], positions, cos, sin,
                             (fused[:, qk_cols:], k_cache, v_cache, slots))  # fmt: skip
    apart, k_ref, v_ref = qkv.clone(), cache(), cache()
    kernels.rotary_embedding(apart[:, :qk_cols], positions, cos, sin)
    k = apart[:, heads * dim : qk_cols].view(tokens, kv_heads, dim)
    v = apart[:, qk_cols:].view(tokens, kv_heads, dim)
    triton_kernels.store_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(fused, apart)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    stored = (k_cache != 7.0).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert stored == [0, 1, 5, 9]  # the padded row's slot stays untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_eager_mlp(dtype):
    gate_up = rand(6, 2 * 40, dtype=dtype)
    gate, up = gate_up[:, :40], gate_up[:, 40:]
    ref = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ref, rtol=TOL[dtype],
                               atol=TOL[dtype])  # fmt: skip


def test_fused_weights_are_views_and_leave_the_model_unchanged():
    model = tiny("tiny-qwen2").to(DEVICE)  # q/k/v biases: fused too
    ids = torch.tensor([prompts_of(9)[0]], device=DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        attn = model.model.layers[0].self_attn
        weight, bias = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        after = model(ids).logits
    assert (
        bias is not None
        and attn.k_proj.weight.data_ptr() == weight[attn.q_proj.out_features :].data_ptr()
    )
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "backend"), [("tiny-llama", "auto"), ("tiny-qwen2", "auto"),
                                                ("tiny-llama", "triton")])  # fmt: skip
def test_fused_adapter_greedy_matches_generate(name, backend):
    """The runner over the fused adapter (which stores K/V in its rotary kernel)
    decodes transformers' greedy tokens, and its logits agree with the eager
    adapter's, whatever attention backend reads the cache."""
    model = tiny(name).to(DEVICE)
    prompts = prompts_of(5, 17, 23)
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    expected = [hf_greedy(model, p, 6) for p in prompts]
    fused = make_adapter(model, fused=True)
    assert isinstance(fused, FusedLlamaAdapter) and fused.stores_kv
    runner = ModelRunner(model, num_kv_blocks=16, block_size=16, device=DEVICE,
                         dtype=torch.float32, adapter=fused, enforce_eager=True,
                         attention_backend=backend)  # fmt: skip
    eager = ModelRunner(model, num_kv_blocks=16, block_size=16, device=DEVICE,
                        dtype=torch.float32, adapter=LlamaAdapter(model),
                        enforce_eager=True)  # fmt: skip
    seqs = [SeqInput(p, 0, t) for p, t in zip(prompts, tables)]
    torch.testing.assert_close(runner.forward(seqs), eager.forward(seqs), rtol=1e-4, atol=1e-4)
    outs = [[t] for t in runner.forward(seqs).argmax(-1).tolist()]
    for _ in range(5):
        step = [SeqInput([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, outs, tables)]
        for out, token in zip(outs, runner.forward(step).argmax(-1).tolist()):
            out.append(token)
    assert outs == expected


def test_fused_adapter_leaves_each_residual_add_to_the_next_norm():
    """Between layers the output is the unsummed pair; the next layer's qkv adds it
    in place, and the last layer returns the summed tensor: both as the eager
    adapter's layer output (outputs reach ~160 here, so atol 1e-3 is ~1e-5 relative)."""
    model = tiny("tiny-llama").to(DEVICE)
    fused, eager = FusedLlamaAdapter(model), LlamaAdapter(model)
    hidden = rand(3, model.config.hidden_size)
    attn = rand(3, fused.shape.num_heads * fused.shape.head_dim, seed=2)
    last_layer = fused.shape.num_layers - 1
    first = fused.finish_layer(0, hidden.clone(), attn)
    assert isinstance(first, Unsummed)
    expected = eager.finish_layer(0, hidden.clone(), attn)
    positions = torch.arange(3, device=DEVICE)
    fused.qkv(last_layer, first, fused.position_context(positions, torch.float32))
    torch.testing.assert_close(first.mlp_out, expected, rtol=1e-5, atol=1e-3)
    last = fused.finish_layer(last_layer, first, attn)
    assert isinstance(last, torch.Tensor)
    ref_last = eager.finish_layer(last_layer, expected, attn)
    torch.testing.assert_close(last, ref_last, rtol=1e-5, atol=1e-3)


def test_fused_is_the_cuda_default_and_never_for_gpt2():
    assert not isinstance(make_adapter(tiny("tiny-gpt2")), FusedLlamaAdapter)
    llama = tiny("tiny-llama").to(DEVICE)
    assert isinstance(make_adapter(llama), FusedLlamaAdapter) == (DEVICE.type == "cuda")
    with pytest.raises(ValueError, match="SwiGLU"):
        FusedLlamaAdapter(tiny("tiny-llama", hidden_act="gelu"))
