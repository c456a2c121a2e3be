"""The attention-backend interface every backend implements.

Per pass the runner asks its backend for:

* :meth:`AttentionBackend.host_fields`: extra integer arrays the backend wants
  in the pass's metadata (built on the host with numpy, sent to the device in
  the same single copy as the token ids, positions, slot mapping, ...);
* :meth:`AttentionBackend.build_metadata`: whatever it derives from the pass
  (:class:`~roseinfer.executor.input_batch.StepBatch`) once, for all layers;
* per layer, :meth:`AttentionBackend.write_kv` (store this pass's K/V at its
  slots; skipped when the model adapter stores them itself, as the fused Llama
  adapter's rotary kernel does: ``ModelAdapter.stores_kv``) and
  :meth:`AttentionBackend.forward` (attend).

CUDA graphs: a backend with ``supports_cuda_graphs`` builds its metadata from
device tensors and host integers that are fixed for a padded decode batch, so
the graph runner (:mod:`roseinfer.executor.graph_runner`) can capture its
kernels once over persistent buffers and replay them with new contents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .input_batch import StepBatch


LARGE_MIXED_TOKENS = 2048
"""Prefill tokens of a mixed pass large enough that a backend may launch its
decodes apart (the ``triton`` backend does, from :data:`LARGE_MIXED_DECODES`
decodes on); the warm-up runs one such pass, so that launch is compiled before
a run's clock starts."""
LARGE_MIXED_DECODES = 16


class AttentionBackend:
    """One way to attend over the paged KV cache (see the module doc).

    Attributes:
        name: the ``attention_backend`` value it answers to.
        supports_cuda_graphs: its decode metadata can be captured in a CUDA graph.
        decode_split_programs: programs (sequences x KV heads) a decode batch needs
            before the backend stops splitting keys (0: it never splits); profiles
            record it so a step model can price a batch's longest context.
        mixed_graph_max_tokens: the largest prefill or mixed pass (new tokens) whose
            metadata has one launch shape per token count, so a graph can replay it
            (:meth:`graph_host_fields`; 0: decodes only).
    """

    name = ""
    supports_cuda_graphs = False
    decode_split_programs = 0
    mixed_graph_max_tokens = 0

    def host_fields(
        self, query_lens: np.ndarray, max_query_len: int, seq_lens: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Extra int64 arrays for this pass, copied to the device with the rest.
        A padded decode batch's arrays must have lengths that depend on its rows
        only (the static buffers of its CUDA graph hold them).

        Args:
            query_lens: ``[num_seqs]`` new tokens per sequence.
            max_query_len: their maximum.
            seq_lens: ``[num_seqs]`` context tokens per sequence (0: padding).
        """
        return {}

    def graph_host_fields(
        self, query_lens: np.ndarray, num_tokens: int, num_seqs: int
    ) -> dict[str, np.ndarray]:
        """:meth:`host_fields` of a prefill or mixed pass padded for a CUDA graph of
        ``num_tokens`` tokens and ``num_seqs`` sequence rows (the padding one
        last): arrays whose lengths depend on those two only.

        Raises:
            NotImplementedError: on a backend without mixed graphs.
        """
        raise NotImplementedError(f"{self.name} attention has no mixed-pass graphs")

    def build_metadata(self, batch: StepBatch) -> Any:
        """What every layer of this pass needs (built once per pass)."""
        return None

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: StepBatch,
    ) -> None:
        """Store ``[num_tokens, num_kv_heads, head_dim]`` K/V at the pass's slots
        (``index_copy_``: every slot must be a real one)."""
        heads = (-1, k_cache.shape[2], k_cache.shape[3])
        k_cache.view(heads).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(heads).index_copy_(0, batch.slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
        batch: StepBatch,
        scale: float,
    ) -> torch.Tensor:
        """Attention outputs ``[num_tokens, num_heads, head_dim]``.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``; k, v: this pass's new K/V
                ``[num_tokens, num_kv_heads, head_dim]`` (already in the cache).
            k_cache, v_cache: the layer's ``[num_blocks, block_size, num_kv_heads,
                head_dim]`` pools.
            meta: :meth:`build_metadata`'s result; batch: the pass.
            scale: softmax scale of q.k in this layer.
        """
        raise NotImplementedError

    def tune(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        max_num_seqs: int,
        max_model_len: int,
        max_pass_tokens: int,
    ) -> float:
        """Time launch options on representative passes over this pool (a layer's
        ``k_cache``/``v_cache``; contents are read, never written) and keep the
        fastest per launch kind. Called once in the warm-up, before CUDA graphs
        are captured. Returns the seconds spent (0 for backends with nothing to tune).
        """
        return 0.0

    def tune_facts(self) -> dict[str, Any]:
        """What :meth:`tune`'s choice depends on besides the model, pool and limits
        (JSON-able; part of the shared cache's key,
        :mod:`~roseinfer.executor.tune_cache`)."""
        return {"backend": self.name}

    def tuned_launches(self) -> dict[str, Any]:
        """The launch options :meth:`tune` chose, JSON-able (``{}``: none); result
        files record them, and the shared cache stores them."""
        return {}

    def adopt_launches(self, launches: Mapping[str, Any]) -> bool:
        """Take launch options :meth:`tuned_launches` gave (another process's, from
        the shared cache) instead of tuning. Returns False, changing nothing, on
        anything but a well-formed set (the caller then tunes)."""
        return False


class BackendUnavailable(RuntimeError):
    """A backend's kernel failed to build or run here (the runner may fall back)."""


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)`` (Triton block shapes)."""
    return max(floor, 1 << max(0, n - 1).bit_length())
