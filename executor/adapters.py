"""Model adapters: a decoder-only LM split around its attention, on packed tokens.

A :class:`ModelAdapter` runs everything of a decoder layer except the attention
itself, on *packed* tokens (``[num_tokens, ...]``, no batch axis, no padding);
the runner owns the attention and the paged KV cache. Architectures: GPT-2
(:class:`Gpt2Adapter`) and the Llama family (:class:`LlamaAdapter`: Llama,
Mistral, Qwen2). :func:`roseinfer.executor.models.make_adapter` picks one.

The adapters call the model's own leaf modules (``nn.Linear``, GPT-2's
``Conv1D``, layer norms, MLPs), so their numerics are those of ``transformers``;
only the attention, the positions and the residual wiring are written here,
following ``modeling_gpt2.py`` and ``modeling_llama.py`` of transformers 5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """Shapes of one model's attention (same for every layer).

    Attributes:
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (< num_heads under GQA).
        head_dim: channels per head.
        vocab_size: logits width.
        max_context_tokens: the longest context the model may attend over, or
            None when unbounded: GPT-2's learned positions, or a sliding window
            (not implemented, so longer contexts are refused).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_tokens: int | None


class ModelAdapter:
    """A decoder-only LM split around its attention, on packed tokens.

    The runner calls, per forward: :meth:`embed`, :meth:`position_context`
    once, then per layer :meth:`qkv` -> (its own attention) -> :meth:`finish_layer`,
    and :meth:`logits` on the last token of each sequence.
    """

    shape: AttentionShape
    stores_kv = False
    """Whether the adapter writes a pass's K/V into the paged cache itself
    (:meth:`qkv_stored`, the fused Llama adapter's); otherwise the runner has the
    attention backend store what :meth:`qkv` returns."""

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids and positions -> hidden ``[num_tokens, hidden]``."""
        raise NotImplementedError

    def position_context(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-forward position data shared by all layers (RoPE cos/sin)."""
        return None

    def qkv(self, layer_idx: int, hidden: Any, pos_ctx: Any):
        """Hidden ``[T, hidden]`` (or what the previous :meth:`finish_layer`
        returned) -> q ``[T, num_heads, head_dim]``, k and v ``[T, num_kv_heads,
        head_dim]``, positions applied."""
        raise NotImplementedError

    def qkv_stored(
        self,
        layer_idx: int,
        hidden: Any,
        pos_ctx: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ):
        """:meth:`qkv`, with the pass's K/V also written at ``slot_mapping`` into
        the layer's ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches (-1:
        no store). Only where :attr:`stores_kv` is set.

        Raises:
            NotImplementedError: on an adapter that does not store K/V itself.
        """
        raise NotImplementedError(f"{type(self).__name__} does not store K/V itself")

    def attn_scale(self, layer_idx: int) -> float:
        """Softmax scale of q.k in this layer."""
        return 1.0 / math.sqrt(self.shape.head_dim)

    def finish_layer(self, layer_idx: int, hidden: Any, attn: torch.Tensor):
        """Residual stream ``[T, hidden]`` plus attention output ``[T, num_heads *
        head_dim]`` -> the layer's output ``[T, hidden]`` (o-proj, MLP, residuals).

        Between layers an adapter may hand on its own form of the output (the
        fused Llama adapter leaves the last residual add to the next layer's
        norm); the last layer's output is always the tensor."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[B, hidden]`` -> logits ``[B, vocab]`` (final norm, head)."""
        raise NotImplementedError


class Gpt2Adapter(ModelAdapter):
    """GPT-2 (``GPT2LMHeadModel``): learned absolute positions, pre-LayerNorm,
    fused ``c_attn`` Conv1D (weights ``[in, out]``), GELU MLP, tied head."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.body = model.transformer
        self.lm_head = model.lm_head
        self.blocks = list(self.body.h)
        self.hidden_size = cfg.n_embd
        self.shape = AttentionShape(
            num_layers=cfg.n_layer,
            num_heads=cfg.n_head,
            num_kv_heads=cfg.n_head,
            head_dim=cfg.n_embd // cfg.n_head,
            vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.n_positions,
        )
        self._scale_weights = cfg.scale_attn_weights
        self._scale_by_layer = cfg.scale_attn_by_inverse_layer_idx
        self._gelu_new = cfg.activation_function == "gelu_new"

    def embed(self, token_ids, positions):
        return self.body.wte(token_ids) + self.body.wpe(positions)

    def qkv(self, layer_idx, hidden, pos_ctx):
        block = self.blocks[layer_idx]
        fused = block.attn.c_attn(block.ln_1(hidden))
        q, k, v = fused.split(self.hidden_size, dim=-1)
        heads = (hidden.shape[0], self.shape.num_heads, self.shape.head_dim)
        return q.view(heads), k.view(heads), v.view(heads)

    def attn_scale(self, layer_idx):
        # Source: GPT2Attention (scale_attn_weights, scale_attn_by_inverse_layer_idx).
        scale = 1.0 / math.sqrt(self.shape.head_dim) if self._scale_weights else 1.0
        return scale / (layer_idx + 1) if self._scale_by_layer else scale

    def finish_layer(self, layer_idx, hidden, attn):
        block = self.blocks[layer_idx]
        # In place on fresh outputs (a + b == b + a in IEEE): same bits, fewer
        # large allocations (each one page-faults in fresh memory on CPU).
        hidden = block.attn.c_proj(attn).add_(hidden)
        x = block.ln_2(hidden)
        if self._gelu_new:
            mlp = block.mlp
            x = mlp.c_proj(gelu_new_(mlp.c_fc(x)))
        else:
            x = block.mlp(x)
        return x.add_(hidden)

    def logits(self, hidden):
        return self.lm_head(self.body.ln_f(hidden))


def gelu_new_(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU (transformers' ``NewGELUActivation``), in place on ``x``.

    The same operations in the same order as ``0.5 * x * (1 + tanh(sqrt(2 / pi)
    * (x + 0.044715 * x ** 3)))``, hence the same bits (multiplying by 0.5 is
    exact in any order), with one temporary instead of seven: on a ``[8000,
    3072]`` float32 prefill activation about 3x faster on CPU. ``x`` is
    overwritten and returned.
    """
    y = torch.pow(x, 3.0).mul_(0.044715).add_(x).mul_(math.sqrt(2.0 / math.pi))
    return x.mul_(y.tanh_().add_(1.0)).mul_(0.5)


class LlamaAdapter(ModelAdapter):
    """Llama, Mistral and Qwen2 (``*ForCausalLM``): RoPE, RMSNorm, SwiGLU MLP,
    GQA; Qwen2's q/k/v biases live inside its ``nn.Linear`` modules.

    RoPE uses the model's own ``rotary_emb.inv_freq`` and ``attention_scaling``,
    so every static rope type of transformers (default, linear, llama3, yarn)
    matches; the dynamic NTK type, which recomputes ``inv_freq`` by length, does
    not.
    """

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.body = model.model
        self.lm_head = model.lm_head
        self.layers = list(self.body.layers)
        rotary = self.body.rotary_emb
        self.inv_freq = rotary.inv_freq  # [head_dim / 2] float32
        self.rope_scaling = float(rotary.attention_scaling)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.shape = AttentionShape(
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            max_context_tokens=_sliding_window(self.layers),
        )
        self._silu = getattr(cfg, "hidden_act", None) == "silu" and all(
            hasattr(layer.mlp, "gate_proj") for layer in self.layers
        )

    def embed(self, token_ids, positions):
        return self.body.embed_tokens(token_ids)

    def position_context(self, positions, dtype):
        # Source: LlamaRotaryEmbedding.forward (angles in float32, then cast).
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        cos = (emb.cos() * self.rope_scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.rope_scaling).to(dtype)[:, None, :]
        return cos, sin  # [T, 1, head_dim] each, broadcast over heads

    def qkv(self, layer_idx, hidden, pos_ctx):
        attn = self.layers[layer_idx].self_attn
        x = self.layers[layer_idx].input_layernorm(hidden)
        num_tokens, head_dim = hidden.shape[0], self.shape.head_dim
        q = attn.q_proj(x).view(num_tokens, -1, head_dim)
        k = attn.k_proj(x).view(num_tokens, -1, head_dim)
        v = attn.v_proj(x).view(num_tokens, -1, head_dim)
        cos, sin = pos_ctx
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def attn_scale(self, layer_idx):
        return float(self.layers[layer_idx].self_attn.scaling)

    def finish_layer(self, layer_idx, hidden, attn):
        layer = self.layers[layer_idx]
        hidden = layer.self_attn.o_proj(attn).add_(hidden)  # in place: same bits
        x = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        if self._silu:  # LlamaMLP: down(silu(gate(x)) * up(x)), in place: same bits
            x = mlp.down_proj(F.silu(mlp.gate_proj(x), inplace=True).mul_(mlp.up_proj(x)))
        else:
            x = mlp(x)
        return x.add_(hidden)

    def logits(self, hidden):
        return self.lm_head(self.body.norm(hidden))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``[T, heads, head_dim]`` by the half-split convention of HF's
    ``rotate_half`` / ``apply_rotary_pos_emb``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _sliding_window(layers: list[nn.Module]) -> int | None:
    """Smallest sliding window of any layer (Mistral, Qwen2 with
    ``use_sliding_window``), or None. Source: ``self_attn.sliding_window`` in
    transformers 5, or the config's ``sliding_window`` for Mistral."""
    windows = []
    for layer in layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is None and layer.self_attn.config.model_type == "mistral":
            window = getattr(layer.self_attn.config, "sliding_window", None)
        if window is not None:
            windows.append(int(window))
    return min(windows) if windows else None
