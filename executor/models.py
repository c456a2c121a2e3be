"""Build a model, and read its weights layer by layer for the model runner.

Two parts:

* :func:`build_model` makes a ``transformers`` causal LM: from a local directory
  (``from_pretrained``) or, offline, from a built-in config name with random
  weights seeded by ``seed`` (:data:`BUILTIN_MODELS`).
* :func:`make_adapter` wraps a loaded model in a :class:`ModelAdapter`, which
  runs everything of a decoder layer except the attention itself, on *packed*
  tokens (``[num_tokens, ...]``, no batch axis, no padding). The runner owns the
  attention and the paged KV cache. Architectures: GPT-2 and the Llama family
  (Llama, Mistral, Qwen2).

The adapters call the model's own leaf modules (``nn.Linear``, GPT-2's
``Conv1D``, layer norms, MLPs), so their numerics are those of ``transformers``;
only the attention, the positions and the residual wiring are written here,
following ``modeling_gpt2.py`` and ``modeling_llama.py`` of transformers 5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Built-in names -> (config class name, config kwargs). Tiny models are for tests;
# the others have the shapes of real checkpoints (random weights, no download).
_TINY_LLAMA = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
}
BUILTIN_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", {}),
    # GPT-2 124M's width and vocabulary at a third of its depth: steps about 3x
    # shorter than GPT-2's on a CPU, for fidelity runs of hundreds of requests.
    "gpt2-4l": ("GPT2Config", {"n_layer": 4}),
    "tiny-gpt2": (
        "GPT2Config",
        {
            "n_layer": 2,
            "n_embd": 64,
            "n_head": 4,
            "vocab_size": 1000,
            "n_positions": 256,
            # GPT-2's BOS/EOS is its last id (50256); keep that inside the tiny vocab.
            "bos_token_id": 999,
            "eos_token_id": 999,
        },
    ),
    "tiny-llama": ("LlamaConfig", dict(_TINY_LLAMA)),
    "tiny-qwen2": ("Qwen2Config", dict(_TINY_LLAMA)),
    "llama-3.1-8b": (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-7b": (
        "Qwen2Config",
        {
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
        },
    ),
}

LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
SUPPORTED_MODEL_TYPES = frozenset({"gpt2"}) | LLAMA_FAMILY


def builtin_config(name: str, **overrides: Any):
    """The ``transformers`` config of a built-in model name.

    Args:
        name: a key of :data:`BUILTIN_MODELS`.
        overrides: config fields to set, e.g. ``initializer_range=0.5`` for tests.

    Raises:
        ValueError: on an unknown name (the message lists the known ones).
    """
    if name not in BUILTIN_MODELS:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(
            f"unknown model {name!r}: known built-in names are {known}; "
            "a local directory holding a transformers checkpoint also works"
        )
    import transformers

    class_name, kwargs = BUILTIN_MODELS[name]
    return getattr(transformers, class_name)(**{**kwargs, **overrides})


def build_model(
    name_or_path: str,
    *,
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str,
    config_overrides: Mapping[str, Any] | None = None,
):
    """Make a causal LM, in eval mode on ``device`` in ``dtype``.

    Args:
        name_or_path: a local directory (``AutoModelForCausalLM.from_pretrained``,
            plus ``AutoTokenizer`` when the directory has one) or a built-in name
            of :data:`BUILTIN_MODELS` (random weights, no tokenizer).
        seed: seeds the random init of a built-in model (the global torch RNG
            is restored afterwards). Unused for a directory.
        dtype: parameter dtype, e.g. ``torch.float32`` or ``torch.bfloat16``.
        device: where the parameters live. A built-in model is initialised
            directly there (an 8B model never sits in CPU memory).
        config_overrides: config fields to set on a built-in config.

    Returns:
        ``(model, config, tokenizer_or_None)``.

    Raises:
        ValueError: on a name that is neither a directory nor a built-in name, a
            model type the runner cannot run (see :data:`SUPPORTED_MODEL_TYPES`),
            a config with a non-positive shape (e.g. zero heads), or a directory
            whose config or weights cannot be loaded (missing, broken, unreadable).
    """
    device = torch.device(device)
    if Path(name_or_path).is_dir():
        model, tokenizer = _load_local(name_or_path, dtype, device)
    else:
        config = builtin_config(name_or_path, **dict(config_overrides or {}))
        check_supported(config)
        model, tokenizer = _random_model(config, seed, dtype, device), None
    model.eval().requires_grad_(False)
    return model, model.config, tokenizer


_SHAPE_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
"""Config fields (GPT-2's ``n_*`` names map onto them) that must be positive ints when set."""


def check_supported(config) -> None:
    """Raise ValueError unless the runner can run ``config``: a supported
    ``model_type`` and positive integer shapes (zero heads would divide by zero)."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported by the model runner; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    for name in _SHAPE_FIELDS:
        value = getattr(config, name, None)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"model config num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )


def _load_local(path: str, dtype: torch.dtype, device: torch.device):
    """Config first (cheap checks), then weights; any failure of the files is a
    ValueError naming the directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = _loading(path, "config.json", lambda: AutoConfig.from_pretrained(path))
    check_supported(config)
    model = _loading(
        path,
        "weights (model.safetensors or pytorch_model.bin)",
        lambda: AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype),
    ).to(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # NOTE: a weights-only directory has no tokenizer files
    return model, tokenizer


def _loading(path: str, what: str, load: Any) -> Any:
    """``load()``, with any exception from reading third-party files (OSError,
    JSON, safetensors or pickle errors, missing keys) as one ValueError line."""
    try:
        return load()
    except Exception as err:  # noqa: BLE001 - the files can fail in many libraries' ways
        lines = str(err).strip().splitlines()
        detail = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
        raise ValueError(
            f"cannot load the {what} of --model {path} ({detail}); it needs config.json and "
            "model.safetensors (or pytorch_model.bin) of a gpt2/llama-family model"
        ) from None


def _random_model(config, seed: int, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


# ------------------------------------------------------------------ adapters


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

    def embed(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids and positions -> hidden ``[num_tokens, hidden]``."""
        raise NotImplementedError

    def position_context(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Per-forward position data shared by all layers (RoPE cos/sin)."""
        return None

    def qkv(self, layer_idx: int, hidden: torch.Tensor, pos_ctx: Any):
        """Hidden ``[T, hidden]`` -> q ``[T, num_heads, head_dim]``, k and v
        ``[T, num_kv_heads, head_dim]``, positions applied."""
        raise NotImplementedError

    def attn_scale(self, layer_idx: int) -> float:
        """Softmax scale of q.k in this layer."""
        return 1.0 / math.sqrt(self.shape.head_dim)

    def finish_layer(self, layer_idx: int, hidden: torch.Tensor, attn: torch.Tensor):
        """Residual stream ``[T, hidden]`` plus attention output ``[T, num_heads *
        head_dim]`` -> the layer's output ``[T, hidden]`` (o-proj, MLP, residuals)."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last hidden states ``[B, hidden]`` -> logits ``[B, vocab]`` (final norm, head)."""
        raise NotImplementedError


def make_adapter(model: nn.Module, fused: bool | None = None) -> ModelAdapter:
    """Wrap a GPT-2 or Llama-family ``*ForCausalLM``.

    Args:
        model: the model, on its device in its dtype.
        fused: for a Llama-family model with a SwiGLU MLP, use
            :class:`~roseinfer.executor.llama_fused.FusedLlamaAdapter` (fused
            qkv and gate/up weights, Triton kernels for RMSNorm, RoPE and SwiGLU);
            None = when the model is on CUDA and Triton is installed and not in
            interpreter mode. GPT-2 is never fused.

    Raises:
        ValueError: on another model type, or ``fused=True`` for a model that
            cannot be fused.
    """
    check_supported(model.config)
    if model.config.model_type == "gpt2":
        return Gpt2Adapter(model)
    if fused is None:
        fused = _fusable(model)
    if fused:
        from .llama_fused import FusedLlamaAdapter  # imports triton

        return FusedLlamaAdapter(model)
    return LlamaAdapter(model)


def _fusable(model: nn.Module) -> bool:
    """Whether the fused adapter is the default: CUDA, a SwiGLU MLP, Triton
    installed and compiling (not ``TRITON_INTERPRET``)."""
    import importlib.util
    import os

    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return False
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return getattr(model.config, "hidden_act", None) == "silu" and all(
        hasattr(layer.mlp, "gate_proj") for layer in model.model.layers
    )


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
