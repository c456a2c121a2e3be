"""Cost models: one engine iteration's batch shape -> seconds.

The simulator asks a :class:`CostModel` how long each iteration takes. The
embedded default is :class:`RooflineCostModel`, an analytical roofline built
from a :class:`~roseinfer.calibration.specs.ModelSpec` and a
:class:`~roseinfer.calibration.specs.DeviceSpec`: an iteration is one forward
pass that is either compute-bound (FLOPs / achievable FLOP/s) or memory-bound
(bytes / achievable bandwidth), plus a fixed per-iteration overhead. A
profiled cost model (fitted from executor measurements) implements the same
:class:`CostModel` protocol.

No torch here: the simulator runs without it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

import numpy as np

from roseinfer.calibration.graph_replay import DECODE_GRAPHS, GraphReplay, runs_eagerly
from roseinfer.calibration.jitter import StepJitter
from roseinfer.calibration.specs import (
    DeviceSpec,
    LinkSpec,
    ModelSpec,
    get_device_spec,
    get_link_spec,
    get_model_spec,
)
from roseinfer.scheduler import StepTotals

__all__ = [
    "BatchShape",
    "StepTotals",
    "CostModel",
    "RooflineCostModel",
    "cost_model_source",
    "loop_decode_run_times_s",
    "make_cost_model",
]


_Num = float | np.ndarray  # a scalar or a float64 array: the same arithmetic on both


def _as_tokens(values: object, what: str) -> np.ndarray:
    """A 1-D int64 view of ``values`` (no copy when it already is one)."""
    tokens = np.asarray(values, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tokens.shape}")
    return tokens


class BatchShape:
    """What one iteration computes, as the cost model sees it.

    All arrays are 1-D int64 token counts; any may be empty. Cost models read
    the :meth:`totals` (counts and sums); the arrays are there for the models
    and reports that need each sequence. A shape made by the simulator from a
    scheduler output (:meth:`lazy`) carries the totals the scheduler counted
    while planning and builds its arrays only when asked.

    Attributes:
        prefill_new_tokens: per prefilling sequence, tokens computed this
            step (a whole prompt, or one chunk of it); each >= 1.
        prefill_context_tokens: per prefilling sequence, the context length
            after this step (prefix-cached or earlier chunks + new); each >=
            the matching ``prefill_new_tokens``.
        decode_context_tokens: per decoding sequence, the context length
            including the token decoded this step; each >= 1.

    Raises:
        ValueError: on a wrong shape, a length mismatch or a count out of range.
    """

    __slots__ = ("_arrays", "_source", "_totals")

    def __init__(
        self,
        prefill_new_tokens: object = (),
        prefill_context_tokens: object = (),
        decode_context_tokens: object = (),
    ) -> None:
        new = _as_tokens(prefill_new_tokens, "prefill_new_tokens")
        context = _as_tokens(prefill_context_tokens, "prefill_context_tokens")
        decode = _as_tokens(decode_context_tokens, "decode_context_tokens")
        if len(new) != len(context):
            raise ValueError(
                f"{len(new)} prefill_new_tokens but {len(context)} prefill_context_tokens"
            )
        if new.size and (new.min() < 1 or (context < new).any()):
            raise ValueError("prefill needs 1 <= new tokens <= context tokens per sequence")
        if decode.size and decode.min() < 1:
            raise ValueError("decode_context_tokens must be >= 1")
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = (new, context, decode)
        self._source: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._totals: StepTotals | None = None

    @classmethod
    def lazy(
        cls,
        totals: StepTotals,
        source: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
    ) -> BatchShape:
        """A shape known by its ``totals``, whose arrays ``source()`` makes when asked."""
        shape = cls.__new__(cls)
        shape._arrays, shape._source, shape._totals = None, source, totals
        return shape

    @classmethod
    def decode(cls, context_tokens: object) -> BatchShape:
        """A pure-decode step over sequences with these context lengths."""
        return cls(decode_context_tokens=_as_tokens(context_tokens, "context_tokens"))

    def _get(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._arrays is None:
            assert self._source is not None
            self._arrays = self._source()
        return self._arrays

    @property
    def prefill_new_tokens(self) -> np.ndarray:
        """Per prefilling sequence, tokens computed this step."""
        return self._get()[0]

    @property
    def prefill_context_tokens(self) -> np.ndarray:
        """Per prefilling sequence, its context after this step."""
        return self._get()[1]

    @property
    def decode_context_tokens(self) -> np.ndarray:
        """Per decoding sequence, its context including the token decoded."""
        return self._get()[2]

    def totals(self) -> StepTotals:
        """Counts and sums of the step (what every cost model reads)."""
        if self._totals is None:
            new, context, decode = self._get()
            num_prefills, num_decodes = len(new), len(decode)
            self._totals = StepTotals(
                num_prefills + num_decodes,
                int(new.sum()) + num_decodes,
                num_prefills,
                int((new * context - new * (new - 1) // 2).sum()),
                int(context.sum()),
                int(decode.sum()),
                int(decode.max()) if num_decodes else 0,
            )
        return self._totals

    @property
    def num_seqs(self) -> int:
        """Sequences in the step (prefilling + decoding)."""
        return self.totals().num_seqs

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step: new prefill tokens + one per decode."""
        return self.totals().num_tokens

    @property
    def is_empty(self) -> bool:
        """True when nothing is computed."""
        return self.totals().num_seqs == 0

    def __repr__(self) -> str:
        new, context, decode = self._get()
        return f"BatchShape(prefill={new.tolist()}/{context.tolist()}, decode={decode.tolist()})"


@runtime_checkable
class CostModel(Protocol):
    """Maps an iteration's batch shape to seconds. Implementations are immutable.

    Attributes:
        name: short identifier of the model kind (``"roofline"``, ``"profiled"``).

    A cost model may also have a ``source`` attribute: one line saying what its
    numbers stand on (read it with :func:`cost_model_source`).
    """

    name: str

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one iteration with this batch takes; 0.0 for an empty batch."""
        ...

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        """Seconds of each of ``num_steps`` consecutive pure-decode iterations.

        Step ``j`` (0-based) decodes the same sequences with contexts
        ``context_tokens + j``. Must equal :func:`loop_decode_run_times_s`
        but in O(num_steps) vectorized numpy: the simulator uses it to jump
        over long decode runs. Returns a float64 array of length ``num_steps``.
        """
        ...

    def describe(self) -> str:
        """One line naming the model and its parameters, for run reports."""
        ...


def cost_model_source(cost_model: CostModel) -> str:
    """What ``cost_model``'s numbers stand on, in one line: its ``source`` (e.g.
    ``roofline h100-sxm, datasheet (unmeasured)``, ``profile FILE``, ``step log
    FILE (N steps)``, ``calibrated roofline from FILE``), or, for a cost model
    without one, its kind with ``source unstated``."""
    source = getattr(cost_model, "source", None)
    return str(source) if source else f"{cost_model.name} (source unstated)"


def loop_decode_run_times_s(
    cost_model: CostModel, context_tokens: np.ndarray, num_steps: int
) -> np.ndarray:
    """The reference meaning of ``decode_run_times_s``: one ``step_time_s`` per step.

    Slow (a Python loop); for tests and as a fallback for cost models that
    cannot vectorize.
    """
    context = _as_tokens(context_tokens, "context_tokens")
    times = [cost_model.step_time_s(BatchShape.decode(context + j)) for j in range(num_steps)]
    return np.asarray(times, dtype=np.float64)


_SCALAR_RUN_STEPS = 12  # decode runs up to this long are priced step by step in Python


class RooflineCostModel:
    """Analytical roofline: ``max(FLOPs / achievable FLOP/s, bytes / achievable B/s,
    launch) + overhead``.

    One iteration is one forward pass over all its tokens; prefill and decode
    in the same batch add up in both FLOPs and bytes.

    FLOPs (per device, divided by ``tensor_parallel``):
      * linear layers: ``2 * non-embedding params`` per computed token (one
        multiply-add per weight; Kaplan et al. 2020, "Scaling Laws", sec. 2.1);
      * LM head: ``2 * vocab * hidden`` per sequence, since only each
        sequence's last position is sampled (vLLM computes logits only there);
      * attention: ``4 * layers * heads * head_dim`` per (query, key) pair,
        QK^T and AV at 2 FLOPs per multiply-add each. A prefill of ``n`` new
        tokens on a context of ``c`` is causal, so query ``i`` sees
        ``c - n + i + 1`` keys: ``n * c - n * (n - 1) / 2`` pairs. A decode is
        the ``n = 1`` case: ``c`` pairs.

    Bytes (per device):
      * weights, read once per iteration: blocks + LM head
        (:attr:`ModelSpec.streamed_weight_bytes`), split by ``tensor_parallel``;
      * KV cache read: every sequence's whole context once
        (``context * kv_bytes_per_token``), as paged/flash attention does;
      * KV written: one entry per new token;
      * activations are ignored: a few MB per step against GBs of weights
        (they matter only for very large prefills, which are compute-bound
        anyway).

    KV heads are replicated once ``tensor_parallel`` exceeds them. KV bytes
    move at the device's :attr:`~roseinfer.calibration.specs.DeviceSpec.achievable_kv_bandwidth`
    (paged attention reaches less of the peak than streaming weights), weights
    at its :attr:`~roseinfer.calibration.specs.DeviceSpec.achievable_bandwidth`.

    Host time:
      * ``overhead_s`` per step plus ``overhead_per_seq_s`` per sequence;
      * launch: a step not replayed from a CUDA graph (``graphs``: under
        rose-run's default any prefill token, or a decode batch past the
        captured sizes; under ``--cudagraph-mode FULL`` only passes of more new
        tokens than it captures) launches every layer's kernels from the host,
        so it takes at least ``num_layers x eager_launch_s_per_layer``; the GPU
        works while the host launches, so this is a third roof, not a sum.

    Decode imbalance (on the memory roof: it is attention's time reading the
    KV cache, so a compute- or launch-bound step hides it): the attention of a decode batch ends with its
    longest context. With one program per sequence and KV head, the longest
    one reads ``max - mean`` context tokens after the others are done; a batch
    too small to fill the GPU splits every context into key ranges, which
    spreads that tail too. So a step with ``d`` decodes of longest context
    ``m`` and summed context ``S`` pays
    ``decode_imbalance_s_per_token x (d x m - S) / max(d, spread)`` seconds,
    where ``spread = decode_split_programs / KV heads per device`` is the batch
    at which roseinfer's attention kernel stops splitting (0 for uniform
    contexts; measured on an H100: see ``calibration/specs.py``).

    Communication (on the critical path, added to the step):
      * tensor parallelism: two all-reduces of the activations (``tokens x
        hidden x dtype`` bytes) per layer, after attention and after the MLP
        (Megatron-LM: Shoeybi et al. 2019, sec. 3); a ring all-reduce takes
        ``latency + 2 (tp - 1) / tp x bytes / bandwidth`` (Patarasuk and Yuan,
        2009), as Vidur's TP model;
      * pipeline parallelism: the layers are split into ``pipeline_parallel``
        stages run one after another, each on its own GPUs, with the
        activations handed over between stages (``pp - 1`` transfers per step).
        A replica runs one batch through its stages at a time: the other stages
        idle meanwhile (the bubble), so pipeline parallelism adds memory and
        transfers, not speed (engines that keep several batches in flight fill
        the bubble; this model does not).

    Step jitter (opt-in, a measured device only): the times above are medians.
    Eager steps of a real executor scatter around theirs (host hiccups stretch a
    launch-bound step: on the H100, 3-12% of them over 1.25x). With
    :meth:`with_step_jitter`, :attr:`jitter` holds the device's measured eager
    repetitions (:attr:`~roseinfer.calibration.specs.DeviceSpec.eager_step_ratios`)
    and the simulator multiplies each eager step by a factor drawn from them by
    step index (:class:`~roseinfer.calibration.jitter.StepJitter`). Graph
    decodes stay at these times: their measured spread (p99 x1.1-1.5) is within
    the fit's own error. :meth:`step_time_s` itself is always the median.

    Args:
        model: the model's shape; its ``dtype_bytes`` sets weight and KV bytes.
        device: peaks, efficiency factors and per-iteration overhead.
        tensor_parallel: GPUs each stage is sharded over (>= 1, dividing the
            attention heads).
        pipeline_parallel: stages the layers are split into (1..num_layers).
        link: the link the collectives cross (default: the device's own).
        graphs: which steps the priced executor replays from CUDA graphs
            (:class:`~roseinfer.calibration.graph_replay.GraphReplay`; default
            rose-run's ``FULL_DECODE_ONLY``).

    Raises:
        ValueError: on a bad ``tensor_parallel`` or ``pipeline_parallel``, or a
            parallel replica on a device without a link.
    """

    name = "roofline"

    def __init__(
        self,
        model: ModelSpec,
        device: DeviceSpec,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        link: LinkSpec | None = None,
        graphs: GraphReplay = DECODE_GRAPHS,
    ) -> None:
        if tensor_parallel < 1 or model.num_attention_heads % tensor_parallel:
            raise ValueError(
                f"tensor_parallel must be >= 1 and divide num_attention_heads "
                f"({model.num_attention_heads}), got {tensor_parallel}"
            )
        if not 1 <= pipeline_parallel <= model.num_layers:
            raise ValueError(
                f"pipeline_parallel must be in 1..{model.num_layers} (the layers), "
                f"got {pipeline_parallel}"
            )
        if link is None and (tensor_parallel > 1 or pipeline_parallel > 1):
            if not device.link:
                raise ValueError(f"{device.name} has no link between GPUs; name one")
            link = get_link_spec(device.link)
        self.model = model
        self.device = device
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.link = link
        self.graphs = graphs
        kv_shards = min(tensor_parallel, model.num_kv_heads)
        # Per-device coefficients, as Python floats so scalar and vectorized
        # paths do the same float64 arithmetic (bit-identical results).
        q_width = model.num_attention_heads * model.head_dim
        self._flops_per_token = 2.0 * model.num_nonembedding_params / tensor_parallel
        self._flops_per_seq = 2.0 * model.num_lm_head_params / tensor_parallel
        self._flops_per_attn_pair = 4.0 * model.num_layers * q_width / tensor_parallel
        self._weight_bytes = float(model.streamed_weight_bytes) / tensor_parallel
        self._achievable_flops = device.achievable_flops
        self._achievable_bandwidth = device.achievable_bandwidth
        self._overhead_s = device.overhead_s
        self._kv_bytes_per_token = float(model.kv_bytes_per_token) / kv_shards
        # KV bytes as the weight bytes that take as long (x 1.0, exactly, when the
        # device has one memory roof: the same float arithmetic as before)
        self._kv_priced_bytes_per_token = self._kv_bytes_per_token * (
            device.achievable_bandwidth / device.achievable_kv_bandwidth
        )
        self._overhead_per_seq_s = device.overhead_per_seq_s
        self._eager_launch_s = device.eager_launch_s_per_layer * model.num_layers
        self._imbalance_s_per_token = device.decode_imbalance_s_per_token
        self._imbalance_spread_seqs = split_spread_seqs(
            device.decode_split_programs, model.num_kv_heads // tensor_parallel
        )
        self._comm_s, self._comm_s_per_token = self._communication()
        self.jitter: StepJitter | None = None

    def with_step_jitter(self) -> RooflineCostModel:
        """This roofline with its device's measured eager step jitter
        (``rose-sim --step-jitter measured``; see the class doc); unchanged for a
        device without measured repetitions."""
        out = copy.copy(self)
        out.jitter = eager_jitter(self.device.eager_step_ratios, self.graphs)
        return out

    def _communication(self) -> tuple[float, float]:
        """(seconds per step, seconds per computed token) of the collectives."""
        link, tp, pp = self.link, self.tensor_parallel, self.pipeline_parallel
        if link is None:
            return 0.0, 0.0
        token_bytes = float(self.model.hidden_size * self.model.dtype_bytes)
        fixed = per_token = 0.0
        if tp > 1:
            num_all_reduces = 2 * self.model.num_layers
            fixed += num_all_reduces * link.latency_s
            per_token += num_all_reduces * 2.0 * (tp - 1) / tp * token_bytes / link.bandwidth
        if pp > 1:
            fixed += (pp - 1) * link.latency_s
            per_token += (pp - 1) * token_bytes / link.bandwidth
        return fixed, per_token

    def pricing_terms(self) -> tuple[float, ...]:
        """The sixteen floats of one step's time, for a compiled pricing loop (the
        simulator's) that evaluates :meth:`_time_s`'s expression with them, in its
        order, bit for bit: FLOPs per token, per sequence and per attention pair,
        achievable FLOP/s, weight bytes, KV bytes per token priced at the weights'
        bandwidth, achievable B/s, overhead (s), communication s per step and s
        per token, overhead s per sequence, launch s of an eager step, decode
        imbalance s per token and its spread (sequences), and the largest decode
        batch (sequences) and pass with prefill tokens (tokens) replayed from
        graphs (:attr:`graphs`)."""
        return (
            self._flops_per_token, self._flops_per_seq, self._flops_per_attn_pair,
            self._achievable_flops, self._weight_bytes, self._kv_priced_bytes_per_token,
            self._achievable_bandwidth, self._overhead_s, self._comm_s, self._comm_s_per_token,
            self._overhead_per_seq_s, self._eager_launch_s, self._imbalance_s_per_token,
            self._imbalance_spread_seqs, float(self.graphs.max_decode_seqs),
            float(self.graphs.max_mixed_tokens),
        )  # fmt: skip

    def flops(self, shape: BatchShape) -> float:
        """Per-device FLOPs of one iteration."""
        num_tokens, num_seqs, attn_pairs, _ = self._aggregates(shape)
        return float(self._flops(num_tokens, num_seqs, attn_pairs))

    def memory_bytes(self, shape: BatchShape) -> float:
        """Per-device bytes moved by one iteration (weights + KV read + KV written)."""
        num_tokens, _, _, kv_read_tokens = self._aggregates(shape)
        return float(self._bytes(num_tokens, kv_read_tokens))

    def is_compute_bound(self, shape: BatchShape) -> bool:
        """True when the FLOPs term dominates the memory term."""
        num_tokens, num_seqs, attn_pairs, kv_read_tokens = self._aggregates(shape)
        compute_s = self._flops(num_tokens, num_seqs, attn_pairs) / self._achievable_flops
        return bool(compute_s >= self._memory_s(num_tokens, kv_read_tokens))

    def step_time_s(self, shape: BatchShape) -> float:
        """Seconds one iteration takes; 0.0 for an empty batch."""
        if shape.is_empty:
            return 0.0
        t = shape.totals()
        num_decodes = t.num_seqs - t.num_prefills
        excess = num_decodes * t.decode_max_context - t.decode_context_tokens
        imbalance_s = self.imbalance_s(float(num_decodes), float(excess))
        return float(self._time_s(*self._aggregates(shape), imbalance_s))

    def imbalance_s(self, num_decodes: float, excess_tokens: float) -> float:
        """Seconds the longest decode context adds to a step (see the class doc):
        ``excess_tokens`` = decodes x longest context - summed context."""
        if excess_tokens <= 0 or not self._imbalance_s_per_token:
            return 0.0
        spread = (
            num_decodes
            if num_decodes > self._imbalance_spread_seqs
            else self._imbalance_spread_seqs
        )
        return self._imbalance_s_per_token * excess_tokens / spread

    def decode_run_times_s(self, context_tokens: np.ndarray, num_steps: int) -> np.ndarray:
        """Seconds of ``num_steps`` pure-decode steps; step ``j`` sees ``context_tokens + j``.

        Vectorized: O(num_steps) numpy. Equal to :func:`loop_decode_run_times_s`.

        Raises:
            ValueError: if ``num_steps < 0`` or a context is < 1.
        """
        context = np.asarray(context_tokens, dtype=np.int64)
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if context.size == 0:
            return np.zeros(num_steps, dtype=np.float64)
        if context.ndim != 1 or context.min() < 1:
            raise ValueError("context_tokens must be a 1-D array of counts >= 1")
        num_seqs, total = float(len(context)), float(context.sum())
        # Every context grows by one per step, so the summed context grows by
        # num_seqs per step: exact in float64 (integers far below 2**53), so the
        # same values step_time_s sums, with the same arithmetic (bit-identical).
        # The longest context grows by one too, so the imbalance stays.
        excess = len(context) * int(context.max()) - int(context.sum())
        imbalance_s = self.imbalance_s(num_seqs, float(excess))
        if num_steps <= _SCALAR_RUN_STEPS:  # NOTE: numpy's per-call cost dominates short runs
            return np.array(
                [
                    self._time_s(num_seqs, num_seqs, x, x, imbalance_s)
                    for x in (total + num_seqs * j for j in range(num_steps))
                ],  # fmt: skip
                dtype=np.float64,
            )
        sum_context = np.arange(num_steps, dtype=np.float64) * num_seqs + total
        return np.asarray(self._time_s(num_seqs, num_seqs, sum_context, sum_context, imbalance_s))

    @property
    def source(self) -> str:
        """``roofline h100-sxm, datasheet (unmeasured)``: the device spec and what its
        efficiency constants stand on, then its step jitter's summary when it has one."""
        jitter = "" if self.jitter is None else f"; eager {self.jitter.summary()}"
        return f"roofline {self.device.name}, {self.device.provenance_label}{jitter}"

    def describe(self) -> str:
        """One line: model, dtype, device, parallelism, achievable peaks, overhead."""
        device = self.device
        parallel = f"TP{self.tensor_parallel}" + (
            f" PP{self.pipeline_parallel}" if self.pipeline_parallel > 1 else ""
        )
        link = f" over {self.link.name}" if self.link is not None else ""
        return (
            f"roofline: {self.model.name} ({self.model.dtype_bytes}-byte weights) on "
            f"{device.name} {parallel}{link}; "
            f"{device.achievable_flops / 1e12:.3g} TFLOP/s (mfu {device.mfu:.2f}), "
            f"{device.achievable_bandwidth / 1e9:.4g} GB/s "
            f"(bw eff {device.bandwidth_efficiency:.2f}), "
            f"overhead {device.overhead_s * 1e3:.2f} ms/step{self._host_terms()}"
        )

    def _host_terms(self) -> str:
        """The measured specs' extra terms, for :meth:`describe` ("" when unset)."""
        device, parts = self.device, []
        if device.kv_bandwidth_efficiency is not None:
            parts.append(
                f"KV at {device.achievable_kv_bandwidth / 1e9:.4g} GB/s "
                f"(eff {device.kv_bandwidth_efficiency:.2f})"
            )
        if device.overhead_per_seq_s:
            parts.append(f"{device.overhead_per_seq_s * 1e6:.3g} us/seq")
        if device.eager_launch_s_per_layer:
            parts.append(f"eager steps >= {self._eager_launch_s * 1e3:.2f} ms (launches; "
                         f"{self.graphs.describe()})")  # fmt: skip
        if self._imbalance_s_per_token:
            parts.append(
                f"decode imbalance {self._imbalance_s_per_token * 1e6:.3g} us per token of the "
                f"longest context over the mean (from {self._imbalance_spread_seqs:.0f} seqs)"
            )
        return "".join(f", {part}" for part in parts)

    def __repr__(self) -> str:
        return f"RooflineCostModel({self.describe()})"

    @staticmethod
    def _aggregates(shape: BatchShape) -> tuple[float, float, float, float]:
        """(tokens computed, sequences, attention query-key pairs, KV tokens read)."""
        t = shape.totals()
        return (
            float(t.num_tokens),
            float(t.num_seqs),
            float(t.prefill_attn_pairs + t.decode_context_tokens),
            float(t.prefill_context_tokens + t.decode_context_tokens),
        )

    # The helpers below take Python floats (step_time_s) or float64 arrays
    # (decode_run_times_s) and do the same arithmetic on both.
    def _flops(self, num_tokens: _Num, num_seqs: _Num, attn_pairs: _Num) -> _Num:
        return (
            self._flops_per_token * num_tokens
            + self._flops_per_seq * num_seqs
            + self._flops_per_attn_pair * attn_pairs
        )

    def _bytes(self, num_tokens: _Num, kv_read_tokens: _Num) -> _Num:
        # KV written for every computed token, KV read for every context token.
        return self._weight_bytes + self._kv_bytes_per_token * (kv_read_tokens + num_tokens)

    def _memory_s(self, num_tokens: _Num, kv_read_tokens: _Num) -> _Num:
        kv_tokens = kv_read_tokens + num_tokens  # read every context token, write every new one
        return (
            self._weight_bytes + self._kv_priced_bytes_per_token * kv_tokens
        ) / self._achievable_bandwidth

    def _launch_s(self, num_tokens: float, num_seqs: float) -> float:
        """Host launch roof of a step (:attr:`graphs`; a decode run's steps all
        share one token and sequence count)."""
        return self._eager_launch_s if runs_eagerly(num_tokens, num_seqs, self.graphs) else 0.0

    def _time_s(
        self,
        num_tokens: _Num,
        num_seqs: _Num,
        attn_pairs: _Num,
        kv_read_tokens: _Num,
        imbalance_s: float = 0.0,
    ) -> _Num:
        compute_s = self._flops(num_tokens, num_seqs, attn_pairs) / self._achievable_flops
        memory_s = self._memory_s(num_tokens, kv_read_tokens) + imbalance_s  # attention's tail
        launch_s = self._launch_s(num_tokens, num_seqs)  # type: ignore[arg-type]
        comm_s = self._comm_s + self._comm_s_per_token * num_tokens
        host_s = self._overhead_s + self._overhead_per_seq_s * num_seqs
        if isinstance(compute_s, float):  # NOTE: a ufunc call costs more than this step
            roof_s = max(compute_s, memory_s, launch_s)  # type: ignore[type-var]
            return roof_s + host_s + comm_s  # type: ignore[operator]
        return np.maximum(np.maximum(compute_s, memory_s), launch_s) + host_s + comm_s


def split_spread_seqs(decode_split_programs: float, kv_heads_per_device: int) -> float:
    """The decode batch (sequences) at which an attention kernel that splits keys
    until it has ``decode_split_programs`` programs stops splitting: the programs
    over the KV heads each GPU holds (at least 1). The decode imbalance of a
    smaller batch is spread over this many sequences."""
    return max(1.0, decode_split_programs / max(1, kv_heads_per_device))


@functools.lru_cache(maxsize=8)
def eager_jitter(
    ratios: tuple[tuple[float, tuple[float, ...]], ...], graphs: GraphReplay = DECODE_GRAPHS
) -> StepJitter | None:
    """The step jitter of a device's measured eager step ratios
    (:attr:`~roseinfer.calibration.specs.DeviceSpec.eager_step_ratios`): eager
    steps (by ``graphs``) draw from them, graph-replayed steps keep their roofline
    time; None without ratios. Cached: one spec's pools are built once per process."""
    if not ratios:
        return None
    return StepJitter(ratios, (), eager_only=True, graphs=graphs)


def make_cost_model(
    model: str | ModelSpec,
    device: str | DeviceSpec,
    dtype_bytes: int | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    link: str | LinkSpec | None = None,
    graphs: GraphReplay = DECODE_GRAPHS,
) -> CostModel:
    """A roofline cost model from built-in names (or specs).

    Args:
        model: a built-in model name/alias or a :class:`ModelSpec`.
        device: a built-in device name/alias or a :class:`DeviceSpec`.
        dtype_bytes: bytes per weight/KV element; ``None`` takes the device's
            run dtype (2 = bf16 on GPUs, 4 = fp32 on ``cpu``), overriding the
            model spec's.
        tensor_parallel: GPUs each pipeline stage is sharded over.
        pipeline_parallel: pipeline stages.
        link: the link between the GPUs (a :data:`LINKS` name or spec; default
            the device's).
        graphs: which steps replay CUDA graphs (:class:`RooflineCostModel`'s).

    Raises:
        UnknownSpecError: for an unknown name (lists the known ones).
        ValueError: on a parallelism the model or device cannot take.
    """
    model_spec = get_model_spec(model) if isinstance(model, str) else model
    device_spec = get_device_spec(device) if isinstance(device, str) else device
    dtype_bytes = device_spec.dtype_bytes if dtype_bytes is None else dtype_bytes
    model_spec = replace(model_spec, dtype_bytes=dtype_bytes)
    link_spec = get_link_spec(link) if isinstance(link, str) else link
    return RooflineCostModel(
        model_spec, device_spec, tensor_parallel, pipeline_parallel, link_spec, graphs
    )
