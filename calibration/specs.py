"""Model and device specs: the numbers the analytical cost model is built from.

A :class:`ModelSpec` is the shape of a decoder-only transformer (what a
transformers ``config.json`` says); a :class:`DeviceSpec` is one accelerator's
datasheet peaks plus the fractions of them a serving engine reaches in
practice. Both are frozen and validated on construction.

Built-ins are looked up by lowercase name or alias with :func:`get_model_spec`
and :func:`get_device_spec`; :meth:`ModelSpec.from_hf_config` reads any GPT-2
or Llama-family (Llama, Qwen2, Mistral) transformers config, as a ``config.json``
dict or a loaded config object: the one reading of a config, so the simulator and
the executor size KV (:attr:`ModelSpec.kv_bytes_per_token`) alike.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DATASHEET_DEVICES",
    "DEVICES",
    "LINKS",
    "MODELS",
    "DeviceSpec",
    "MEASURED",
    "PROVENANCE_KINDS",
    "LinkSpec",
    "Measurement",
    "ModelSpec",
    "Provenance",
    "UnknownSpecError",
    "get_device_spec",
    "get_link_spec",
    "get_model_spec",
    "model_spec_from_hf_config",
    "summarize_devices",
]

GB = 10**9  # datasheets quote decimal gigabytes
TERA = 10**12


class UnknownSpecError(KeyError, ValueError):
    """A model or device name that is not in the built-in registry.

    A ``KeyError`` (it is a failed lookup) and a ``ValueError`` (CLIs report
    it as a bad argument). The message lists the known names.
    """

    def __str__(self) -> str:
        # KeyError.__str__ would repr() the message, adding quotes.
        return str(self.args[0]) if self.args else ""


def _check_positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {getattr(obj, name)}")


_MODEL_INT_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_model_len",
    "dtype_bytes",
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shape of a decoder-only transformer.

    Attributes:
        name: display name.
        num_layers: decoder blocks.
        hidden_size: model width (elements).
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (< query heads under GQA).
        head_dim: elements per head.
        intermediate_size: MLP inner width (elements).
        vocab_size: tokens in the vocabulary (embedding and LM-head rows).
        max_model_len: longest context in tokens.
        gated_mlp: SwiGLU MLP with 3 matrices (gate, up, down); False for
            GPT-2's 2-matrix MLP.
        tied_embeddings: the LM head shares the input embedding matrix.
        dtype_bytes: bytes per weight/KV element (2 for bf16/fp16, 4 for fp32).
        learned_position_embeddings: a ``max_model_len x hidden_size`` position
            table (GPT-2); False for rotary embeddings (Llama family).

    Biases and norm weights are not counted: under 0.1% of the parameters.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    gated_mlp: bool
    tied_embeddings: bool
    dtype_bytes: int = 2
    learned_position_embeddings: bool = False

    @classmethod
    def from_hf_config(
        cls, config: object, *, name: str | None = None, dtype_bytes: int | None = None
    ) -> ModelSpec:
        """The spec of a transformers config (see :func:`model_spec_from_hf_config`
        for the keys read).

        Args:
            config: a ``config.json`` dict, or a transformers ``PretrainedConfig``
                (anything with ``to_dict()``).
            name: display name (default: the config's ``_name_or_path`` or type).
            dtype_bytes: bytes per weight/KV element at the run's dtype (default:
                the config's ``torch_dtype``, 2 when absent), e.g. 4 for an fp32
                run of a bf16 checkpoint.

        Raises:
            KeyError: if a required key is missing.
            ValueError: if ``config`` is neither a mapping nor a config object, or
                its values do not make a valid spec.
        """
        if not isinstance(config, Mapping):
            to_dict = getattr(config, "to_dict", None)
            if not callable(to_dict):
                kind = type(config).__name__
                raise ValueError(f"a model config is a JSON object or a config, got {kind}")
            config = to_dict()
        spec = model_spec_from_hf_config(config)  # type: ignore[arg-type]
        changes: dict[str, Any] = {"name": name} if name else {}
        if dtype_bytes is not None:
            changes["dtype_bytes"] = dtype_bytes
        return dataclasses.replace(spec, **changes) if changes else spec

    def __post_init__(self) -> None:
        _check_positive(self, _MODEL_INT_FIELDS)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def attention_params_per_layer(self) -> int:
        """Q, K, V and output projection weights of one layer."""
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        return 2 * self.hidden_size * q_width + 2 * self.hidden_size * kv_width

    @property
    def mlp_params_per_layer(self) -> int:
        """MLP weights of one layer: 3 matrices if gated (SwiGLU), else 2."""
        num_matrices = 3 if self.gated_mlp else 2
        return num_matrices * self.hidden_size * self.intermediate_size

    @property
    def num_nonembedding_params(self) -> int:
        """Parameters of the decoder blocks (no embeddings, no LM head)."""
        return self.num_layers * (self.attention_params_per_layer + self.mlp_params_per_layer)

    @property
    def num_lm_head_params(self) -> int:
        """Parameters of the LM head (``vocab_size x hidden_size``), tied or not."""
        return self.vocab_size * self.hidden_size

    @property
    def num_embedding_params(self) -> int:
        """Token (and learned position) embedding parameters."""
        positions = self.max_model_len if self.learned_position_embeddings else 0
        return (self.vocab_size + positions) * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters; a tied LM head is counted once."""
        lm_head = 0 if self.tied_embeddings else self.num_lm_head_params
        return self.num_nonembedding_params + self.num_embedding_params + lm_head

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in device memory."""
        return self.num_params * self.dtype_bytes

    @property
    def streamed_weight_bytes(self) -> int:
        """Weight bytes one forward pass reads: the blocks and the LM head.

        The input embedding is a gather of a few rows, not a full read, so an
        untied embedding table is left out.
        """
        return (self.num_nonembedding_params + self.num_lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token: K and V for every layer and KV head, at
        ``dtype_bytes`` (``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def flops_per_token(self) -> int:
        """Linear-layer FLOPs for one token whose logits are computed.

        ``2 * (non-embedding params + LM head)`` (one multiply-add per weight);
        attention over the context comes on top and depends on its length.
        """
        return 2 * (self.num_nonembedding_params + self.num_lm_head_params)


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator: datasheet peaks and the fractions a serving engine reaches.

    Attributes:
        name: display name.
        peak_flops: dense peak in FLOP/s at the run dtype (bf16 on GPUs, no
            2:4 sparsity).
        mem_bandwidth: peak memory bandwidth in bytes/s.
        mem_bytes: device memory in bytes.
        mfu: achievable fraction of ``peak_flops`` for a whole forward pass
            (model FLOPs utilization), in (0, 1].
        bandwidth_efficiency: achievable fraction of ``mem_bandwidth`` when
            streaming weights and KV, in (0, 1].
        overhead_s: fixed seconds per iteration outside the roofline: kernel
            launches, scheduling, input preparation, sampling.
        kv_bandwidth_efficiency: achievable fraction of ``mem_bandwidth`` when
            attention reads and writes the paged KV cache, in (0, 1]; None: the
            same as ``bandwidth_efficiency`` (one memory roof for weights and KV).
        overhead_per_seq_s: seconds per sequence of a step on top of
            ``overhead_s``: its inputs, sampling and bookkeeping (>= 0).
        eager_launch_s_per_layer: host seconds to launch one layer's kernels in a
            step that is not replayed from a CUDA graph (any prefill token, or a
            decode batch past the captured sizes; :mod:`~roseinfer.calibration.graph_replay`): such a step takes at
            least ``num_layers`` times this, a third roof beside compute and
            memory (>= 0; 0: launches never bound a step, as the datasheet
            specs assume).
        decode_imbalance_s_per_token: seconds per token by which the longest
            decode context of a step exceeds the mean, in a batch large enough
            not to split keys (>= 0; 0: contexts never unbalance a step, as the
            datasheet specs assume). See
            :class:`~roseinfer.calibration.cost_model.RooflineCostModel`.
        decode_split_programs: attention programs (sequences x KV heads) a
            decode batch needs before roseinfer's Triton kernel stops splitting
            keys (``attn_triton.SPLIT_TARGET_WAVES`` x SMs: 4 x 132 = 528 on an
            H100 SXM); smaller batches spread the imbalance over the splits
            (0: no splits).
        dtype_bytes: bytes per element of the dtype models run in on this
            device (2 = bf16 on GPUs; the cpu spec assumes fp32, 4).
        link: name of the link between the GPUs of one server (a :data:`LINKS`
            key), which tensor- and pipeline-parallel collectives cross; "" for none.
        provenance: where the numbers come from (a datasheet, an assumption, or
            a measurement on the device); None when unstated (a user's spec).
        eager_step_ratios: ``(median_s, ratios)`` of eager step shapes timed
            several times on the device, each ratio ``repetition / median`` (a
            measured device: :data:`MEASURED_JITTER_FILE`); with ``rose-sim
            --step-jitter measured`` the roofline draws each eager step's factor
            from them (:class:`~roseinfer.calibration.jitter.StepJitter`, graph
            decodes at medians). ``()``: none measured.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int
    mfu: float
    bandwidth_efficiency: float
    overhead_s: float
    dtype_bytes: int = 2
    link: str = ""
    provenance: Provenance | None = None
    kv_bandwidth_efficiency: float | None = None
    overhead_per_seq_s: float = 0.0
    eager_launch_s_per_layer: float = 0.0
    decode_imbalance_s_per_token: float = 0.0
    decode_split_programs: int = 0
    eager_step_ratios: tuple[tuple[float, tuple[float, ...]], ...] = dataclasses.field(
        default=(), repr=False
    )

    def __post_init__(self) -> None:
        _check_positive(self, ("peak_flops", "mem_bandwidth", "mem_bytes", "dtype_bytes"))
        for name in ("mfu", "bandwidth_efficiency", "kv_bandwidth_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ValueError(f"DeviceSpec.{name} must be in (0, 1], got {value}")
        for name in ("overhead_s", "overhead_per_seq_s", "eager_launch_s_per_layer",
                     "decode_imbalance_s_per_token", "decode_split_programs"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceSpec.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def achievable_flops(self) -> float:
        """FLOP/s a forward pass reaches: ``peak_flops * mfu``."""
        return self.peak_flops * self.mfu

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes/s a forward pass reaches: ``mem_bandwidth * bandwidth_efficiency``."""
        return self.mem_bandwidth * self.bandwidth_efficiency

    @property
    def achievable_kv_bandwidth(self) -> float:
        """Bytes/s attention reaches on the KV cache: ``mem_bandwidth *
        kv_bandwidth_efficiency`` (:attr:`achievable_bandwidth` when unset)."""
        if self.kv_bandwidth_efficiency is None:
            return self.achievable_bandwidth
        return self.mem_bandwidth * self.kv_bandwidth_efficiency

    @property
    def provenance_label(self) -> str:
        """``datasheet (unmeasured)``, ``measured 2026-11 on ..., median step error
        4.1%`` ...: what the efficiency constants stand on (``unstated`` without a
        provenance)."""
        return self.provenance.label() if self.provenance is not None else "unstated"

    @property
    def ridge_intensity(self) -> float:
        """FLOPs per byte above which a step is compute-bound (the roofline ridge)."""
        return self.achievable_flops / self.achievable_bandwidth


PROVENANCE_KINDS = ("datasheet", "assumed", "measured")


@dataclass(frozen=True, kw_only=True)
class Provenance:
    """What a device spec's numbers stand on.

    Attributes:
        kind: ``datasheet`` (vendor peaks; efficiency constants assumed, not
            measured), ``assumed`` (no datasheet: an estimate) or ``measured``
            (efficiency constants fitted to steps timed on the device).
        source: the datasheet and the assumptions, or the files the fit read.
        gpu, driver, torch: the measured device and software (``measured``).
        date: when it was measured, ISO ``YYYY-MM-DD``.
        command: the command that measured and fitted it.
        models: the model shapes whose steps were fitted.
        num_steps: steps fitted.
        median_step_error, p90_step_error: relative error of the fitted roofline
            on held-out measured steps of the fitted shapes (0.05 = 5%).
        check_model: a shape left out of the fit; check_median_step_error: the
            fitted roofline's median relative error on its steps.

    Raises:
        ValueError: on another kind, or a measurement without its device, date,
            command or error.
    """

    kind: str
    source: str
    gpu: str = ""
    driver: str = ""
    torch: str = ""
    date: str = ""
    command: str = ""
    models: tuple[str, ...] = ()
    num_steps: int = 0
    median_step_error: float | None = None
    p90_step_error: float | None = None
    check_model: str = ""
    check_median_step_error: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in PROVENANCE_KINDS:
            raise ValueError(
                f"Provenance.kind must be one of {PROVENANCE_KINDS}, got {self.kind!r}"
            )
        if self.kind == "measured" and not (
            self.gpu and self.date and self.command and self.median_step_error is not None
        ):
            raise ValueError("a measured Provenance needs gpu, date, command and median_step_error")

    def label(self) -> str:
        """One phrase: ``datasheet (unmeasured)``, ``assumed (unmeasured)`` or
        ``measured 2026-11 on NVIDIA H100 80GB HBM3, median step error 4.1%``."""
        if self.kind != "measured":
            return f"{self.kind} (unmeasured)"
        return (
            f"measured {self.date[:7]} on {self.gpu}, median step error "
            f"{self.median_step_error:.1%}"
        )


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """A built-in device's efficiency constants fitted to its measured steps
    (``benchmarks/fit_device_spec.py``); its datasheet peaks stay.

    Attributes:
        mfu, bandwidth_efficiency, overhead_s, kv_bandwidth_efficiency,
        overhead_per_seq_s, eager_launch_s_per_layer, decode_imbalance_s_per_token:
        as :class:`DeviceSpec`'s.
        provenance: the measurement (kind ``measured``).
    """

    mfu: float
    bandwidth_efficiency: float
    overhead_s: float
    provenance: Provenance
    kv_bandwidth_efficiency: float | None = None
    overhead_per_seq_s: float = 0.0
    eager_launch_s_per_layer: float = 0.0
    decode_imbalance_s_per_token: float = 0.0

    def apply(self, datasheet: DeviceSpec) -> DeviceSpec:
        """``datasheet`` with these constants and this provenance."""
        return dataclasses.replace(
            datasheet, mfu=self.mfu, bandwidth_efficiency=self.bandwidth_efficiency,
            overhead_s=self.overhead_s, kv_bandwidth_efficiency=self.kv_bandwidth_efficiency,
            overhead_per_seq_s=self.overhead_per_seq_s,
            eager_launch_s_per_layer=self.eager_launch_s_per_layer,
            decode_imbalance_s_per_token=self.decode_imbalance_s_per_token,
            provenance=self.provenance,
        )  # fmt: skip


# --- models ------------------------------------------------------------------
# Numbers from each model's published Hugging Face config.json:
#   gpt2:          huggingface.co/openai-community/gpt2/blob/main/config.json
#   llama-3.1-8b:  huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
#   llama-3.1-70b: huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
#   opt-13b:       huggingface.co/facebook/opt-13b/blob/main/config.json (the model
#                  of DistServe's chatbot case; ReLU MLP of ffn_dim, tied embeddings,
#                  learned positions)
#   qwen2.5-7b:    huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json
#                  (max_position_embeddings 32768: the native window; the model
#                  card reaches 131072 only with YaRN rope scaling)
#   llama-3.2-3b:  huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
#                  (head_dim 128 as the config states; hidden_size / heads = 128)
# head_dim = hidden_size / num_attention_heads for all six.

_GPT2 = ModelSpec(
    name="gpt2",
    num_layers=12,
    hidden_size=768,
    num_attention_heads=12,
    num_kv_heads=12,
    head_dim=64,
    intermediate_size=3072,  # n_inner is null: 4 * n_embd
    vocab_size=50257,
    max_model_len=1024,
    gated_mlp=False,
    tied_embeddings=True,
    learned_position_embeddings=True,
)
_LLAMA_31_8B = ModelSpec(
    name="llama-3.1-8b",
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    max_model_len=131072,
    gated_mlp=True,
    tied_embeddings=False,
)
_LLAMA_31_70B = ModelSpec(
    name="llama-3.1-70b",
    num_layers=80,
    hidden_size=8192,
    num_attention_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
    max_model_len=131072,
    gated_mlp=True,
    tied_embeddings=False,
)
_OPT_13B = ModelSpec(
    name="opt-13b",
    num_layers=40,
    hidden_size=5120,
    num_attention_heads=40,
    num_kv_heads=40,
    head_dim=128,
    intermediate_size=20480,
    vocab_size=50272,
    max_model_len=2048,
    gated_mlp=False,
    tied_embeddings=True,
    learned_position_embeddings=True,
)
_QWEN25_7B = ModelSpec(
    name="qwen2.5-7b",
    num_layers=28,
    hidden_size=3584,
    num_attention_heads=28,
    num_kv_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
    max_model_len=32768,
    gated_mlp=True,
    tied_embeddings=False,
)
_LLAMA_32_3B = ModelSpec(
    name="llama-3.2-3b",
    num_layers=28,
    hidden_size=3072,
    num_attention_heads=24,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=8192,
    vocab_size=128256,
    max_model_len=131072,
    gated_mlp=True,
    tied_embeddings=True,
)

MODELS: dict[str, ModelSpec] = {
    "gpt2": _GPT2,
    "openai-community/gpt2": _GPT2,
    "llama-3.1-8b": _LLAMA_31_8B,
    "meta-llama/llama-3.1-8b": _LLAMA_31_8B,
    "meta-llama/llama-3.1-8b-instruct": _LLAMA_31_8B,
    "llama-3.1-70b": _LLAMA_31_70B,
    "meta-llama/llama-3.1-70b": _LLAMA_31_70B,
    "meta-llama/llama-3.1-70b-instruct": _LLAMA_31_70B,
    "opt-13b": _OPT_13B,
    "facebook/opt-13b": _OPT_13B,
    "qwen2.5-7b": _QWEN25_7B,
    "qwen/qwen2.5-7b": _QWEN25_7B,
    "qwen/qwen2.5-7b-instruct": _QWEN25_7B,
    "llama-3.2-3b": _LLAMA_32_3B,
    "meta-llama/llama-3.2-3b": _LLAMA_32_3B,
    "meta-llama/llama-3.2-3b-instruct": _LLAMA_32_3B,
}
"""Built-in model specs by lowercase name; Hugging Face repo ids are aliases."""

# --- devices -----------------------------------------------------------------
# Efficiency factors (rough, shared by the GPUs; a profiled cost model fitted
# from `rose-run profile` replaces them):
#   mfu 0.6: large bf16 GEMMs reach 60-75% of dense peak; a whole prefill
#     forward (norms, rotary, attention) lands near 50-60%.
#   bandwidth_efficiency 0.8: streaming reads (GEMV in decode) reach about
#     80-90% of HBM peak.
#   overhead_s 1 ms: the per-step time that neither FLOPs nor bytes explain:
#     scheduling, input preparation and sampling on the host plus launch gaps.
#     It puts Llama-3.1-8B batch-1 decode on an H100 near 7 ms (6 ms roofline
#     + 1 ms), the inter-token latency serving engines with CUDA graphs report;
#     an eager engine (no CUDA graphs, ~10 kernels x 32 layers x ~5 us) pays
#     a few ms more.
_GPU_MFU = 0.6
_GPU_BANDWIDTH_EFFICIENCY = 0.8
_GPU_OVERHEAD_S = 1e-3
_GPU_ASSUMED = "efficiency constants assumed (mfu 0.6, bandwidth 0.8, overhead 1 ms)"

# Measured efficiency constants, by built-in device name. The block between the
# markers is written by `python benchmarks/fit_device_spec.py ... --write-specs`
# from steps timed on the device (rerun it rather than editing by hand). A device
# listed here keeps its datasheet peaks below and takes these constants; the
# others keep the datasheet's assumed ones. Empty: no device measured yet.
# BEGIN MEASURED
MEASURED: dict[str, Measurement] = {
    "h100-sxm": Measurement(
        mfu=0.5976,
        bandwidth_efficiency=1.0,
        overhead_s=0.0024368,
        kv_bandwidth_efficiency=0.6995,
        overhead_per_seq_s=9.828e-06,
        eager_launch_s_per_layer=0.00031964,
        decode_imbalance_s_per_token=2.0246e-06,
        provenance=Provenance(
            kind="measured",
            source="benchmarks/gpu/results/h100-2026-11-26/llama-3.1-8b.json benchmarks/gpu/results/h100-2026-11-26/qwen2.5-7b.json benchmarks/gpu/results/h100-2026-11-26/llama-3.2-3b.json benchmarks/gpu/results/h100-2026-11-26/steps-budget.jsonl",
            gpu="NVIDIA H100 80GB HBM3",
            driver="580.159.04",
            torch="2.11.0+cu130",
            date="2026-11-26",
            command="bash benchmarks/gpu/fit_h100.sh (the profiles); python benchmarks/fit_device_spec.py --device h100-sxm --fit R/llama-3.1-8b.json R/qwen2.5-7b.json --check R/llama-3.2-3b.json --imbalance-steps R/steps-budget.jsonl --write-specs (R: the source's folder)",
            models=("llama-3.1-8b", "qwen2.5-7b"),
            num_steps=502,
            median_step_error=0.0224,
            p90_step_error=0.0896,
            check_model="llama-3.2-3b",
            check_median_step_error=0.0832,
        ),
    ),
}
# END MEASURED


MEASURED_JITTER_FILE = Path(__file__).with_name("measured_jitter.json")
"""The eager steps' measured spread of the :data:`MEASURED` devices, by name:
``{"h100-sxm": {"source": ..., "eager": [[median_s, [ratio, ...]], ...]}}``, each
ratio one repetition of a profiled eager shape over its median. Written with the
block above by ``benchmarks/fit_device_spec.py --write-specs`` from the fitted
profiles (on the 2026-11-26 H100 profiles: 296 repetitions of 138 shapes, mean
x1.03, p99 x2.13; the graph decodes' spread, p99 x1.46, is left out, so decode
runs stay at their roofline times)."""


def _eager_step_ratios(name: str) -> tuple[tuple[float, tuple[float, ...]], ...]:
    """``name``'s entry of :data:`MEASURED_JITTER_FILE` (``()`` without one)."""
    if not MEASURED_JITTER_FILE.exists():
        return ()
    entry = json.loads(MEASURED_JITTER_FILE.read_text()).get(name)
    if entry is None:
        return ()
    return tuple((float(m), tuple(float(r) for r in ratios)) for m, ratios in entry["eager"])


def _measured(datasheet: DeviceSpec) -> DeviceSpec:
    """``datasheet`` with its :data:`MEASURED` constants and eager step ratios
    (:data:`MEASURED_JITTER_FILE`) when it has them."""
    found = MEASURED.get(datasheet.name)
    if found is None:
        return datasheet
    ratios = _eager_step_ratios(datasheet.name)
    return dataclasses.replace(found.apply(datasheet), eager_step_ratios=ratios)


# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 tensor 312
# TFLOPS dense (624 with sparsity), HBM2e 2,039 GB/s, 80 GB. 108 SMs (NVIDIA
# A100 Tensor Core GPU Architecture whitepaper), so 4 x 108 decode programs.
_A100_80GB = DeviceSpec(
    name="a100-80gb",
    peak_flops=312 * TERA,
    mem_bandwidth=2039 * GB,
    mem_bytes=80 * GB,
    mfu=_GPU_MFU,
    bandwidth_efficiency=_GPU_BANDWIDTH_EFFICIENCY,
    overhead_s=_GPU_OVERHEAD_S,
    link="nvlink3",
    decode_split_programs=4 * 108,
    provenance=Provenance(
        kind="datasheet",
        source=f"NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM); {_GPU_ASSUMED}",
    ),
)
# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 tensor 1,979 TFLOPS
# with sparsity, so 989 dense; HBM3 3.35 TB/s; 80 GB. 132 SMs (NVIDIA H100
# Tensor Core GPU Architecture whitepaper, SXM5), so 4 x 132 decode programs.
_H100_SXM = DeviceSpec(
    name="h100-sxm",
    peak_flops=989 * TERA,
    mem_bandwidth=3350 * GB,
    mem_bytes=80 * GB,
    mfu=_GPU_MFU,
    bandwidth_efficiency=_GPU_BANDWIDTH_EFFICIENCY,
    overhead_s=_GPU_OVERHEAD_S,
    link="nvlink4",
    decode_split_programs=4 * 132,
    provenance=Provenance(
        kind="datasheet",
        source=f"NVIDIA H100 Tensor Core GPU datasheet (H100 SXM); {_GPU_ASSUMED}",
    ),
)
# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same compute as H100 SXM
# (989 TFLOPS BF16 dense), HBM3e 4.8 TB/s, 141 GB; the H100's 132 SMs.
_H200 = DeviceSpec(
    name="h200",
    peak_flops=989 * TERA,
    mem_bandwidth=4800 * GB,
    mem_bytes=141 * GB,
    mfu=_GPU_MFU,
    bandwidth_efficiency=_GPU_BANDWIDTH_EFFICIENCY,
    overhead_s=_GPU_OVERHEAD_S,
    link="nvlink4",
    decode_split_programs=4 * 132,
    provenance=Provenance(
        kind="datasheet",
        source=f"NVIDIA H200 Tensor Core GPU datasheet (H200 SXM); {_GPU_ASSUMED}",
    ),
)
# A generic small server CPU (about 2 cores) running PyTorch in fp32; an
# assumption, not a datasheet, good to an order of magnitude only:
#   peak 100 GFLOP/s: 2 cores x ~3 GHz x 32 fp32 FLOP/cycle (AVX2, 2 FMA
#     units) is ~190 GFLOP/s, and shared/virtual cores seldom get it all;
#   20 GB/s: a share of one DDR4/DDR5 socket;
#   mfu 0.5: eager PyTorch matmuls on small batches;
#   overhead 2 ms: eager op dispatch, ~10 us x ~15 ops x layers, plus Python.
_CPU = DeviceSpec(
    name="cpu",
    peak_flops=100e9,
    mem_bandwidth=20 * GB,
    mem_bytes=16 * GB,
    mfu=0.5,
    bandwidth_efficiency=0.7,
    overhead_s=2e-3,
    dtype_bytes=4,
    provenance=Provenance(kind="assumed", source="a generic 2-core server CPU, fp32 (above)"),
)

DATASHEET_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec for spec in (_A100_80GB, _H100_SXM, _H200, _CPU)
}
"""The built-in devices as their datasheets (or assumptions) give them, before
any :data:`MEASURED` constants: the base a fit starts from."""
_BUILTIN = {name: _measured(spec) for name, spec in DATASHEET_DEVICES.items()}
DEVICES: dict[str, DeviceSpec] = {
    alias: _BUILTIN[name]  # one object per device, whatever alias names it
    for alias, name in {
        "a100-80gb": "a100-80gb",
        "a100": "a100-80gb",
        "h100-sxm": "h100-sxm",
        "h100": "h100-sxm",
        "h200": "h200",
        "h200-sxm": "h200",
        "cpu": "cpu",
    }.items()
}
"""Built-in device specs by lowercase name, with short aliases (measured
constants applied where :data:`MEASURED` has them)."""


def summarize_devices() -> str:
    """The built-in devices and what each stands on, for ``--help``: e.g.
    ``a100-80gb (a100): datasheet (unmeasured); ...``."""
    aliases: dict[str, list[str]] = {}
    for alias, spec in DEVICES.items():
        aliases.setdefault(spec.name, []).append(alias)
    parts = []
    for name, names in sorted(aliases.items()):
        other = sorted(n for n in names if n != name)
        also = f" ({', '.join(other)})" if other else ""
        parts.append(f"{name}{also}: {DEVICES[name].provenance_label}")
    return "; ".join(parts)


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A link data crosses between GPUs: tensor-parallel all-reduces and pipeline
    stage handoffs inside a replica, or KV transfers between replicas.

    Attributes:
        name: display name.
        bandwidth: achievable bytes/s in one direction per GPU (the datasheet
            rate times an efficiency, see :data:`LINKS`).
        latency_s: fixed seconds per message (a collective or a transfer).
    """

    name: str
    bandwidth: float
    latency_s: float

    def __post_init__(self) -> None:
        _check_positive(self, ("bandwidth",))
        if not self.latency_s >= 0:
            raise ValueError(f"LinkSpec.latency_s must be >= 0, got {self.latency_s}")


# Links. Bandwidths are per direction per GPU: the datasheet rate x an efficiency
# (0.8 for NVLink/PCIe/RDMA, what NCCL's bus bandwidth reaches on large messages
# in nccl-tests; 0.6 for TCP, which pays for its protocol stack). Latencies are
# the order of a small message: NCCL all-reduce on NVLink ~10 us (nccl-tests),
# RDMA ~5 us, TCP ~50 us (an assumption: kernel network stack round trip).
#   nvlink4: NVIDIA H100/H200 SXM datasheet, NVLink 900 GB/s per GPU (both
#     directions together), so 450 GB/s each way.
#   nvlink3: NVIDIA A100 SXM datasheet, NVLink 600 GB/s, so 300 GB/s each way.
#   pcie5 / pcie4: PCI Express 5.0 / 4.0 x16, 32 / 16 GT/s x 16 lanes with
#     128b/130b coding: 63 / 31.5 GB/s each way.
#   rdma-400g: 400 Gb/s InfiniBand NDR or RoCE (ConnectX-7), 50 GB/s each way.
#   tcp-100g: 100 Gb/s Ethernet, 12.5 GB/s each way.
LINKS: dict[str, LinkSpec] = {
    "nvlink4": LinkSpec(name="nvlink4", bandwidth=0.8 * 450 * GB, latency_s=10e-6),
    "nvlink3": LinkSpec(name="nvlink3", bandwidth=0.8 * 300 * GB, latency_s=10e-6),
    "pcie5": LinkSpec(name="pcie5", bandwidth=0.8 * 63 * GB, latency_s=10e-6),
    "pcie4": LinkSpec(name="pcie4", bandwidth=0.8 * 31.5 * GB, latency_s=10e-6),
    "rdma-400g": LinkSpec(name="rdma-400g", bandwidth=0.8 * 50 * GB, latency_s=5e-6),
    "tcp-100g": LinkSpec(name="tcp-100g", bandwidth=0.6 * 12.5 * GB, latency_s=50e-6),
}

DEFAULT_KV_TRANSFER_LINK = "rdma-400g"
"""Between the GPUs of two replicas: one 400 Gb/s RDMA NIC per GPU, as DGX H100
nodes have (DistServe's testbed used InfiniBand too)."""
"""Built-in links by name (sources above)."""


def get_link_spec(name: str) -> LinkSpec:
    """The built-in link called ``name``.

    Raises:
        UnknownSpecError: listing the known links.
    """
    spec: LinkSpec = _lookup("link", LINKS, name)
    return spec


def _lookup(kind: str, registry: Mapping[str, Any], name: str) -> Any:
    key = name.strip().lower()
    if key not in registry:
        known = ", ".join(sorted(registry))
        raise UnknownSpecError(f"unknown {kind} {name!r}; known {kind}s: {known}")
    return registry[key]


def get_model_spec(name: str) -> ModelSpec:
    """The built-in model spec for ``name`` (case-insensitive, aliases allowed).

    Raises:
        UnknownSpecError: if no built-in model has that name; lists the known ones.
    """
    spec: ModelSpec = _lookup("model", MODELS, name)
    return spec


def get_device_spec(name: str) -> DeviceSpec:
    """The built-in device spec for ``name`` (case-insensitive, aliases allowed).

    Raises:
        UnknownSpecError: if no built-in device has that name; lists the known ones.
    """
    spec: DeviceSpec = _lookup("device", DEVICES, name)
    return spec


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}


def _config_dtype_bytes(config: Mapping[str, Any]) -> int:
    """Bytes per element from ``torch_dtype`` (or newer ``dtype``); 2 if absent."""
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)


def _config_name(config: Mapping[str, Any]) -> str:
    return str(config.get("_name_or_path") or config.get("model_type") or "custom")


_GPT2_INT_KEYS = ("n_layer", "n_embd", "n_head", "n_inner", "vocab_size", "n_positions")
_LLAMA_INT_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


def _check_config_ints(config: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Raise ValueError for a shape key that is present (not null) but not an int > 0
    (zero heads would divide by zero)."""
    for key in keys:
        value = config.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value <= 0
        ):
            raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")


def _gpt2_spec(config: Mapping[str, Any]) -> ModelSpec:
    hidden, heads = config["n_embd"], config["n_head"]
    return ModelSpec(
        name=_config_name(config),
        num_layers=config["n_layer"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=config.get("n_inner") or 4 * hidden,
        vocab_size=config["vocab_size"],
        max_model_len=config["n_positions"],
        gated_mlp=False,
        tied_embeddings=config.get("tie_word_embeddings", True),
        dtype_bytes=_config_dtype_bytes(config),
        learned_position_embeddings=True,
    )


def _llama_spec(config: Mapping[str, Any]) -> ModelSpec:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return ModelSpec(
        name=_config_name(config),
        num_layers=config["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_model_len=config["max_position_embeddings"],
        gated_mlp=True,
        # LlamaConfig, Qwen2Config and MistralConfig all default to untied.
        tied_embeddings=config.get("tie_word_embeddings", False),
        dtype_bytes=_config_dtype_bytes(config),
    )


def model_spec_from_hf_config(config: Mapping[str, Any]) -> ModelSpec:
    """A :class:`ModelSpec` from a transformers ``config.json`` dict.

    GPT-2 keys (``n_layer``, ``n_embd``, ``n_head``, ``n_positions``) or
    Llama-family keys (``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``,
    ``max_position_embeddings``; Llama, Qwen2 and Mistral share them).
    ``dtype_bytes`` follows ``torch_dtype`` (2 when absent).

    Raises:
        KeyError: if a required key is missing.
        ValueError: if the values do not make a valid spec.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a model config is a JSON object, got {type(config).__name__}")
    if config.get("model_type") == "gpt2" or "n_layer" in config:
        _check_config_ints(config, _GPT2_INT_KEYS)
        return _gpt2_spec(config)
    if "num_hidden_layers" in config:
        _check_config_ints(config, _LLAMA_INT_KEYS)
        return _llama_spec(config)
    raise KeyError(
        "not a GPT-2 or Llama-family config: needs 'n_layer' or 'num_hidden_layers' "
        f"(model_type={config.get('model_type')!r})"
    )
