"""The Llama-family adapter with fused weights and fused small kernels (CUDA).

:class:`FusedLlamaAdapter` runs the same layer as
:class:`~roseinfer.executor.adapters.LlamaAdapter` in fewer, larger kernels:

* one qkv matrix product instead of three, and one gate/up product instead of
  two (the weights are concatenated once, layer by layer, and the model's own
  ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj`` weights become
  views of the fused ones, so no memory is added and the transformers model
  still runs as before);
* RMSNorm with the residual add, rotary embedding in place over q and k (which
  also writes the pass's K/V into the paged cache: :meth:`FusedLlamaAdapter.qkv_stored`,
  so the attention backend's store launch is skipped), and SwiGLU as single
  Triton kernels (:mod:`~roseinfer.executor.layer_kernels`);
* a layer's MLP output left unsummed (:class:`Unsummed`): the next layer's
  input RMSNorm adds it to the residual stream in its own kernel, as vLLM's
  ``fused_add_rms_norm`` does, so no layer but the last launches an add;
* rotary cos/sin read from a table of every position the model allows,
  computed once as transformers computes them (float32 angles, cast to the
  model's dtype).

Per layer that is 9 launches where the eager adapter makes about 35. The
model runner uses it on CUDA when Triton is installed
(:func:`~roseinfer.executor.models.make_adapter`); the CPU keeps the eager
modules (the CPU tests compare them with transformers bit for bit).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from . import layer_kernels as kernels
from .adapters import LlamaAdapter


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate ``linears``' weights (and biases) along the output dimension and
    make each module's parameters views of the result.

    Returns:
        the fused weight ``[sum(out), in]`` and bias ``[sum(out)]`` (None when the
        modules have no bias).

    Raises:
        ValueError: if some have a bias and others do not.
    """
    has_bias = {m.bias is not None for m in linears}
    if len(has_bias) != 1:
        raise ValueError("cannot fuse linear layers where only some have a bias")
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias == {True} else None
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


class Unsummed(NamedTuple):
    """A layer's output as two addends ``[T, hidden]`` each: its MLP output and
    the residual stream it adds to. The next layer's input RMSNorm adds them in
    place into ``mlp_out`` (which is the residual stream from then on)."""

    mlp_out: torch.Tensor
    residual: torch.Tensor


class FusedLlamaAdapter(LlamaAdapter):
    """Llama, Mistral and Qwen2 with fused weights and kernels (see the module doc).

    Args:
        model: a Llama-family ``*ForCausalLM`` on its device, in its dtype (its
            projection weights are re-pointed into the fused tensors).

    Raises:
        ValueError: if the MLP is not SwiGLU (``gate_proj``/``up_proj``, silu).
    """

    stores_kv = True

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if not self._silu:
            raise ValueError("the fused Llama adapter needs a SwiGLU MLP (silu, gate/up)")
        self.qkv_weights, self.gate_up_weights = [], []
        with torch.no_grad():
            for layer in self.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.qkv_weights.append(fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]))
                self.gate_up_weights.append(fuse_linears([mlp.gate_proj, mlp.up_proj]))
            self.cos, self.sin = self._rope_tables(model)
        self.eps = [float(layer.input_layernorm.variance_epsilon) for layer in self.layers]
        self.post_eps = [
            float(layer.post_attention_layernorm.variance_epsilon) for layer in self.layers
        ]
        s = self.shape
        self._q_cols = s.num_heads * s.head_dim
        self._qk_cols = (s.num_heads + s.num_kv_heads) * s.head_dim

    def _rope_tables(self, model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[max_positions, head_dim / 2]`` in the model's dtype, as
        ``LlamaRotaryEmbedding.forward`` computes them (float32 angles times
        ``attention_scaling``, then cast)."""
        head: Any = self.lm_head
        weight: torch.Tensor = head.weight
        positions = torch.arange(int(model.config.max_position_embeddings), device=weight.device)
        inv_freq: Any = self.inv_freq
        freqs = positions[:, None].float() * inv_freq.to(weight.device)[None, :]
        cos = (freqs.cos() * self.rope_scaling).to(weight.dtype).contiguous()
        sin = (freqs.sin() * self.rope_scaling).to(weight.dtype).contiguous()
        return cos, sin

    def position_context(self, positions, dtype):
        return positions  # the kernel reads the tables at these positions

    def qkv(self, layer_idx, hidden, pos_ctx):
        return self._qkv(layer_idx, hidden, pos_ctx, None)

    def qkv_stored(self, layer_idx, hidden, pos_ctx, k_cache, v_cache, slot_mapping):
        """:meth:`qkv`, with this pass's K/V also written into the paged cache by
        the rotary kernel (:func:`~roseinfer.executor.layer_kernels.rotary_embedding`
        with ``store``): one launch a layer where rotating and then storing take two.

        Args:
            k_cache, v_cache: the layer's ``[num_blocks, block_size, num_kv_heads,
                head_dim]`` caches.
            slot_mapping: ``[>= T]`` int slots; -1 (padding) stores nothing.
        """
        return self._qkv(layer_idx, hidden, pos_ctx, (k_cache, v_cache, slot_mapping))

    def _qkv(self, layer_idx, hidden, pos_ctx, store):
        weight = self.layers[layer_idx].input_layernorm.weight
        if isinstance(hidden, Unsummed):  # the previous layer's add, into mlp_out
            x = kernels.rms_norm(hidden.mlp_out, weight, self.eps[layer_idx], hidden.residual)
        else:
            x = kernels.rms_norm(hidden, weight, self.eps[layer_idx])
        weight, bias = self.qkv_weights[layer_idx]
        qkv = torch.nn.functional.linear(x, weight, bias)
        qk, v_cols = qkv[:, : self._qk_cols], qkv[:, self._qk_cols :]
        kernels.rotary_embedding(
            qk, pos_ctx, self.cos, self.sin, None if store is None else (v_cols, *store)
        )
        t, d = qkv.shape[0], self.shape.head_dim
        q = qkv[:, : self._q_cols].view(t, -1, d)
        k = qkv[:, self._q_cols : self._qk_cols].view(t, -1, d)
        v = qkv[:, self._qk_cols :].view(t, -1, d)
        return q, k, v

    def finish_layer(self, layer_idx, hidden, attn):
        """As :meth:`LlamaAdapter.finish_layer`, but every layer except the last
        returns :class:`Unsummed`: :meth:`qkv` of the next layer, which the runner
        always calls first, completes the add."""
        if isinstance(hidden, Unsummed):
            hidden = hidden.mlp_out  # summed in place by this layer's qkv
        layer = self.layers[layer_idx]
        residual = layer.self_attn.o_proj(attn)
        weight = layer.post_attention_layernorm.weight
        x = kernels.rms_norm(residual, weight, self.post_eps[layer_idx], residual=hidden)
        gate_up_w, gate_up_b = self.gate_up_weights[layer_idx]
        act = kernels.silu_and_mul(torch.nn.functional.linear(x, gate_up_w, gate_up_b))
        mlp_out = layer.mlp.down_proj(act)
        if layer_idx == len(self.layers) - 1:
            return mlp_out.add_(residual)
        return Unsummed(mlp_out, residual)

    def logits(self, hidden: Any) -> torch.Tensor:
        norm: Any = self.body.norm
        head: Any = self.lm_head
        return head(kernels.rms_norm(hidden, norm.weight, float(norm.variance_epsilon)))
