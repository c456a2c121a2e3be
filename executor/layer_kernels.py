"""Fused Triton kernels of a Llama-family layer's small operations (CUDA).

Outside its matrix products and attention, a Llama layer in eager PyTorch is
some 30 small kernels: RMSNorm alone is seven (cast, square, mean, add, rsqrt,
multiply, scale), rotary embedding a dozen over q and k, SwiGLU two. At decode
batch sizes each moves a few kilobytes yet costs a launch and 2-10 us on the
GPU; on one H200 they were about a quarter of a Llama-3.1-8B decode step and a
third of a 4 x 2048 prefill's non-GEMM time (``benchmarks/gpu_throughput.py
--kernel-table``). These kernels do each group in one pass over memory:

* :func:`rms_norm`: ``w * (x / sqrt(mean(x^2) + eps))``, optionally first adding
  a residual (``x + r``, written back as the new residual stream);
* :func:`rotary_embedding`: rotates the q and k heads of the fused qkv output
  in place, reading cos/sin from a table precomputed per position, and can
  write the pass's K/V into the paged cache in the same launch;
* :func:`silu_and_mul`: ``silu(gate) * up`` over the fused gate/up output.

Each rounds where transformers' eager modules round (``LlamaRMSNorm`` casts the
normalised value to the input dtype before the weight multiplies it; ``LlamaMLP``
rounds ``silu(gate)`` before the product), and computes in float32 in between,
so in float32 they agree with transformers to rounding and in bf16 to one ulp of
the intermediate. The same fusions are vLLM's ``fused_add_rms_norm``,
``rotary_embedding`` and ``silu_and_mul`` custom ops (its ``csrc/layernorm_kernels.cu``,
``pos_encoding_kernels.cu``, ``activation_kernels.cu``); these are written in
Triton from the formulas above.

On CPU they run in Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported), which the tests use; the CPU runner itself keeps the
eager modules.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attn_base import pow2_at_least


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the eager add's rounding
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)  # the new residual stream
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # LlamaRMSNorm casts before the weight
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row of ``x`` ``[T, N]`` (last dimension contiguous).

    With ``residual`` (``[T, N]``), ``x`` first becomes ``x + residual``, in place:
    the residual stream a Llama layer carries on; the norm is of that sum.

    Returns:
        ``weight * x / sqrt(mean(x^2) + eps)`` ``[T, N]`` in ``x``'s dtype (new tensor).
    """
    num_rows, n = x.shape
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    res = x if residual is None else residual
    block = pow2_at_least(n)
    _rms_norm_kernel[(num_rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return out


@triton.jit
def _rotary_kernel(
    qk_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    v_ptr,
    slot_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_t,
    stride_c,
    stride_vt,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    STORE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    head = tl.arange(0, HEADS_P)[:, None]
    col = tl.arange(0, HALF_P)[None, :]
    ok = (head < NUM_HEADS) & (col < HALF)
    c = tl.load(cos_ptr + pos * stride_c + col, mask=col < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_c + col, mask=col < HALF, other=0.0).to(tl.float32)
    base = qk_ptr + token * stride_t + head * (2 * HALF) + col
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * c - b * s).to(x1.dtype)
    y2 = (b * c + a * s).to(x1.dtype)
    tl.store(base, y1, mask=ok)
    tl.store(base + HALF, y2, mask=ok)
    if STORE:  # the last NUM_KV_HEADS heads are k
        slot = tl.load(slot_ptr + token).to(tl.int64)
        stored = tl.where(slot >= 0, NUM_KV_HEADS, 0)  # a padded row (slot < 0) stores nothing
        safe = tl.maximum(slot, 0)
        row = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_cs
        kv_head = head - (NUM_HEADS - NUM_KV_HEADS)
        is_k = ok & (kv_head >= 0) & (kv_head < stored)
        k_dst = k_cache_ptr + row + kv_head * stride_ch + col
        tl.store(k_dst, y1, mask=is_k)
        tl.store(k_dst + HALF, y2, mask=is_k)
        v_head = tl.arange(0, KV_HEADS_P)[:, None]
        v_col = tl.arange(0, 2 * HALF_P)[None, :]
        is_v = (v_head < stored) & (v_col < 2 * HALF)
        v_src = v_ptr + token * stride_vt + v_head * (2 * HALF) + v_col
        v = tl.load(v_src, mask=is_v, other=0.0)
        tl.store(v_cache_ptr + row + v_head * stride_ch + v_col, v, mask=is_v)


def rotary_embedding(
    qk: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Rotate every head of ``qk`` in place by its token's position (half-split
    convention: transformers' ``rotate_half`` / ``apply_rotary_pos_emb``), and with
    ``store`` also write this pass's K/V into the paged cache in the same launch.

    Args:
        qk: ``[T, (num_heads + num_kv_heads) * head_dim]`` view (the q and k columns
            of the fused qkv output; heads contiguous, rows strided).
        positions: ``[T]`` int, each token's position.
        cos, sin: ``[max_positions, head_dim / 2]`` tables (the first half of
            transformers' ``cos``/``sin``, which repeat it), contiguous rows.
        store: ``(v, k_cache, v_cache, slot_mapping)``: the pass's values ``[T,
            num_kv_heads * head_dim]`` (last dimension contiguous), caches
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` (last three
            dimensions contiguous, one layout for both) and ``[>= T]`` int slots
            (``block * block_size + offset``; -1 stores nothing, a padded row). The
            rotated k heads (``qk``'s last ``num_kv_heads``) and ``v`` go to each
            token's slot: the bits the Triton backend's ``store_kv`` writes after a
            separate rotation, in one launch a layer instead of two.
    """
    num_tokens = qk.shape[0]
    if num_tokens == 0:
        return
    half = cos.shape[1]
    num_heads = qk.shape[1] // (2 * half)
    if store is None:
        v = k_cache = v_cache = slots = qk  # unused placeholders (STORE off)
        num_kv_heads, block_size = 1, 1
        cache_strides: tuple[int, ...] = (0, 0, 0)
    else:
        v, k_cache, v_cache, slots = store
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        cache_strides = k_cache.stride()[:3]
    _rotary_kernel[(num_tokens,)](
        qk, positions, cos, sin, v, slots, k_cache, v_cache, qk.stride(0), cos.stride(0),
        v.stride(0), *cache_strides, NUM_HEADS=num_heads, HALF=half,
        HEADS_P=pow2_at_least(num_heads), HALF_P=pow2_at_least(half), STORE=store is not None,
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_P=pow2_at_least(num_kv_heads), BLOCK_SIZE=block_size,
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_g,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(gate_up_ptr + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(gate_up_ptr + row * stride_g + N + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounds before the product, as eager
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(g.dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up output.

    Args:
        gate_up: ``[T, 2 * N]``: gate in the first ``N`` columns, up in the rest.

    Returns:
        ``[T, N]`` in ``gate_up``'s dtype.
    """
    num_rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0:
        return out
    block = min(1024, pow2_at_least(n))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=4
    )
    return out
