"""Build a model, and read its weights layer by layer for the model runner.

Two parts:

* :func:`build_model` makes a ``transformers`` causal LM: from a local directory
  (``from_pretrained``) or, offline, from a built-in config name with random
  weights seeded by ``seed`` (:data:`BUILTIN_MODELS`).
* :func:`make_adapter` wraps a loaded model in the
  :class:`~roseinfer.executor.adapters.ModelAdapter` that fits it
  (:mod:`~roseinfer.executor.adapters`; on CUDA the Llama family's fused one,
  :mod:`~roseinfer.executor.llama_fused`). Architectures: GPT-2 and the Llama
  family (Llama, Mistral, Qwen2).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .adapters import Gpt2Adapter, LlamaAdapter, ModelAdapter

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
    # huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json (rope scaling as
    # Llama-3.1's, factor 32): the third shape of the H100 spec fit, built in so a
    # profile of it needs no checkpoint written to disk.
    "llama-3.2-3b": (
        "LlamaConfig",
        {
            "vocab_size": 128256,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": True,
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
