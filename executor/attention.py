"""The choice of one attention backend per runner.

A backend (the interface: :class:`~roseinfer.executor.attn_base.AttentionBackend`)
is an object chosen once, when the runner is built; every layer of every pass
calls the same object (no name re-tested per layer).

Backends (``attention_backend``):

* ``sdpa`` (:mod:`~roseinfer.executor.attn_sdpa`, any device): the reference,
  torch's ``scaled_dot_product_attention``, gathering each prefill's cached
  prefix and each decode group's context.
* ``flex`` (:mod:`~roseinfer.executor.attn_flex`, CPU): decodes in one compiled
  ``flex_attention`` call whose block mask is the block table. Not on CUDA: see
  :data:`FLEX_CUDA_REASON`.
* ``triton`` (:mod:`~roseinfer.executor.attn_triton`, CUDA): one paged-attention
  kernel for prefills, chunks and decodes in one launch; CUDA graphs.
* ``flash_attn`` (:mod:`~roseinfer.executor.attn_flash`, CUDA, optional
  package): ``flash_attn_varlen_func`` over the paged cache.

``auto`` picks, on CUDA: ``triton`` (the fastest that reads the cache in place
and works with CUDA graphs) when Triton is importable, else ``flash_attn`` when
installed and the block size is a multiple of 256, else ``sdpa``; on CPU:
``flex`` when it compiles here, else ``sdpa`` (the CPU's fastest; the Triton
kernels run on CPU only in Triton's slow interpreter).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch

from .attn_base import AttentionBackend, BackendUnavailable

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "BackendUnavailable",
    "make_backend",
    "resolve_backend",
]

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "triton", "flash_attn")
FLEX_CUDA_REASON = (
    "inductor's flex kernels on CUDA need the block mask's query block to be a multiple "
    "of their BLOCK_M (>= 16 rows), and the paged decode mask has one query row per block, "
    "so no kernel configuration is valid (NoValidChoicesError); the triton backend reads "
    "the paged cache in place on CUDA"
)
"""Why ``flex`` is CPU-only. Source: torch/_inductor/kernel/flex/flex_decoding.py and
flex_attention.py (torch 2.13), which skip every config with ``SPARSE_Q_BLOCK_SIZE %
BLOCK_M != 0``."""
logger = logging.getLogger(__name__)


def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (not imported here)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_on() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(
    requested: str, device: torch.device, dtype: torch.dtype, block_size: int
) -> tuple[str, str]:
    """The backend name to build for ``requested`` and the reason, e.g.
    ``("triton", "auto on cuda: ...")``.

    Raises:
        ValueError: on an unknown name, or an explicit backend that cannot run
            here (flash_attn not installed, flex on CUDA or without
            ``BlockMask.from_kv_blocks``, triton not installed or on CPU without
            the interpreter).
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested != "auto":
        _check_explicit(requested, device)
        return requested, "asked for"
    if device.type == "cuda":
        if triton_importable():
            return "triton", "auto on cuda: Triton's paged kernel (in place, CUDA graphs)"
        from .attn_flash import load_flash_varlen

        fits = dtype in (torch.float16, torch.bfloat16) and block_size % 256 == 0
        if fits and load_flash_varlen() is not None:
            return "flash_attn", "auto on cuda: triton is not installed"
        return "sdpa", "auto on cuda: triton is not installed"
    from .attn_flex import flex_available

    if device.type == "cpu" and flex_available():
        return "flex", "auto on cpu: flex decode reads the cache in place"
    return "sdpa", f"auto on {device.type}"


def _check_explicit(name: str, device: torch.device) -> None:
    """Raise ValueError if an explicitly asked backend cannot run on ``device``."""
    if name == "flash_attn":
        from .attn_flash import load_flash_varlen

        if load_flash_varlen() is None:
            raise ValueError(
                "attention_backend='flash_attn' but flash_attn (>= 2.5) is not importable"
            )
    if name == "flex":
        from .attn_flex import flex_available

        if device.type == "cuda":
            raise ValueError(f"attention_backend='flex' runs on CPU only: {FLEX_CUDA_REASON}")
        if not flex_available():
            raise ValueError(
                f"attention_backend='flex' needs torch.nn.attention.flex_attention with "
                f"BlockMask.from_kv_blocks (torch {torch.__version__} lacks it); use 'sdpa'"
            )
    if name == "triton":
        if not triton_importable():
            raise ValueError(
                "attention_backend='triton' needs the triton package (pip install triton)"
            )
        if device.type != "cuda" and not triton_interpreter_on():
            raise ValueError(
                f"attention_backend='triton' runs on CUDA; on {device.type} only in Triton's "
                "interpreter (TRITON_INTERPRET=1, slow: for tests); use 'sdpa' or 'flex'"
            )


def make_backend(name: str, **kwargs: Any) -> AttentionBackend:
    """Build the backend ``name`` (a resolved name, not ``auto``).

    Args:
        kwargs: what the backends take (``num_heads``, ``num_kv_heads``,
            ``head_dim``, ``block_size``, ``num_kv_blocks``, ``dtype``, ``device``);
            each takes the ones it needs.
    """
    if name == "sdpa":
        from .attn_sdpa import SdpaBackend

        return SdpaBackend()
    if name == "flex":
        from .attn_flex import FlexBackend

        return FlexBackend()
    if name == "flash_attn":
        from .attn_flash import FlashAttnBackend, load_flash_varlen

        fn = load_flash_varlen()
        if fn is None:
            raise ValueError("flash_attn is not importable")
        return FlashAttnBackend(fn)
    if name == "triton":
        from .attn_triton import TritonBackend

        return TritonBackend(
            num_heads=kwargs["num_heads"],
            num_kv_heads=kwargs["num_kv_heads"],
            device=kwargs["device"],
        )
    raise ValueError(f"unknown attention backend {name!r}")
