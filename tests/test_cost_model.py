"""The analytical cost model and the model/device specs behind it.

Properties: more tokens or longer contexts are never cheaper; the vectorized
decode run equals a step-by-step loop; compute- and memory-bound regimes cross
at the roofline ridge. Sanity: published parameter counts, and step times of
the right order for Llama-3.1-8B on an H100 and GPT-2 on a small CPU.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roseinfer.calibration.cost_model import (
    BatchShape,
    CostModel,
    RooflineCostModel,
    loop_decode_run_times_s,
    make_cost_model,
)
from roseinfer.calibration.specs import (
    DATASHEET_DEVICES,
    DEVICES,
    MODELS,
    LinkSpec,
    ModelSpec,
    UnknownSpecError,
    get_device_spec,
    get_model_spec,
    model_spec_from_hf_config,
)

H100_8B = make_cost_model("llama-3.1-8b", "h100-sxm")
COST_MODELS = {
    "8b-h100": H100_8B,
    "70b-a100-tp4": make_cost_model("llama-3.1-70b", "a100-80gb", tensor_parallel=4),
    "gpt2-cpu": make_cost_model("gpt2", "cpu"),
}

# Subsets of the published Hugging Face config.json files.
GPT2_CONFIG = {
    "model_type": "gpt2",
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "n_inner": None,
    "n_positions": 1024,
    "vocab_size": 50257,
}
LLAMA_31_8B_CONFIG = {
    "_name_or_path": "meta-llama/Llama-3.1-8B",
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def prefill(new: list[int], context: list[int] | None = None) -> BatchShape:
    return BatchShape(np.array(new), np.array(context if context is not None else new))


def time_s(shape: BatchShape, cost_model: CostModel = H100_8B) -> float:
    return cost_model.step_time_s(shape)


# --- specs -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("gpt2", 124e6),
        ("llama-3.1-8b", 8.03e9),
        ("llama-3.1-70b", 70.6e9),
        ("qwen2.5-7b", 7.61e9),
        ("llama-3.2-3b", 3.21e9),
    ],
)
def test_param_counts_near_published(name: str, published: float) -> None:
    assert get_model_spec(name).num_params == pytest.approx(published, rel=0.03)


def test_derived_sizes_of_llama_8b() -> None:
    spec = get_model_spec("llama-3.1-8b")
    assert spec.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert spec.weight_bytes == 2 * spec.num_params
    # The untied input embedding is gathered, not streamed.
    assert spec.streamed_weight_bytes < spec.weight_bytes
    assert spec.flops_per_token == pytest.approx(2 * 7.5e9, rel=0.02)


def test_qwen_nonembedding_params_match_model_card() -> None:
    # Qwen2.5-7B model card: 7.61B parameters, 6.53B non-embedding.
    assert get_model_spec("qwen2.5-7b").num_nonembedding_params == pytest.approx(6.53e9, rel=0.01)


def test_lookup_is_case_insensitive_with_aliases() -> None:
    assert get_model_spec(" Meta-Llama/Llama-3.1-8B ") is get_model_spec("llama-3.1-8b")
    assert get_device_spec("H100") is get_device_spec("h100-sxm")
    assert all(name == name.lower() for name in [*MODELS, *DEVICES])


@pytest.mark.parametrize(
    ("lookup", "known"), [(get_model_spec, MODELS), (get_device_spec, DEVICES)]
)
def test_unknown_names_list_known_ones(lookup, known) -> None:
    with pytest.raises(UnknownSpecError) as info:
        lookup("no-such-thing")
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "no-such-thing" in message
    assert all(name in message for name in known)


def test_model_spec_validation() -> None:
    spec = get_model_spec("llama-3.1-8b")
    with pytest.raises(ValueError, match="num_layers"):
        replace(spec, num_layers=0)
    with pytest.raises(ValueError, match="multiple"):
        replace(spec, num_kv_heads=5)


def test_device_spec_validation() -> None:
    spec = get_device_spec("h100-sxm")
    with pytest.raises(ValueError, match="mfu"):
        replace(spec, mfu=0.0)
    with pytest.raises(ValueError, match="bandwidth_efficiency"):
        replace(spec, bandwidth_efficiency=1.5)
    with pytest.raises(ValueError, match="overhead_s"):
        replace(spec, overhead_s=-1.0)


def test_datasheet_numbers() -> None:
    h100, h200, a100 = (get_device_spec(n) for n in ("h100-sxm", "h200", "a100-80gb"))
    assert (h100.peak_flops, h100.mem_bandwidth) == (989e12, 3.35e12)
    assert (h200.peak_flops, h200.mem_bandwidth, h200.mem_bytes) == (989e12, 4.8e12, 141e9)
    assert (a100.peak_flops, a100.mem_bandwidth) == (312e12, 2.039e12)
    assert get_device_spec("cpu").dtype_bytes == 4


def spec_fields(spec: ModelSpec) -> ModelSpec:
    """The spec without its name, for comparing shapes."""
    return replace(spec, name="x")


def test_hf_config_gpt2() -> None:
    spec = model_spec_from_hf_config(GPT2_CONFIG)
    assert spec_fields(spec) == spec_fields(get_model_spec("gpt2"))
    assert spec.name == "gpt2"


def test_hf_config_llama() -> None:
    spec = model_spec_from_hf_config(LLAMA_31_8B_CONFIG)
    assert spec_fields(spec) == spec_fields(get_model_spec("llama-3.1-8b"))
    assert spec.name == "meta-llama/Llama-3.1-8B"


def test_hf_config_defaults_and_dtype() -> None:
    config = {**LLAMA_31_8B_CONFIG, "torch_dtype": "float32", "head_dim": 64}
    del config["num_key_value_heads"], config["tie_word_embeddings"]
    spec = model_spec_from_hf_config(config)
    assert (spec.dtype_bytes, spec.head_dim, spec.num_kv_heads) == (4, 64, 32)
    assert not spec.tied_embeddings


def test_hf_config_missing_keys_raise_key_error() -> None:
    with pytest.raises(KeyError):
        model_spec_from_hf_config({k: v for k, v in GPT2_CONFIG.items() if k != "n_embd"})
    with pytest.raises(KeyError, match="num_hidden_layers"):
        model_spec_from_hf_config({"model_type": "mamba"})


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-qwen2"])
def test_one_reading_of_a_loaded_config_sizes_kv_as_the_executor_allocates(name: str) -> None:
    """``ModelSpec.from_hf_config`` takes the config object the executor loads (not
    only a config.json dict) and prices a token's KV as the runner's tensors hold it
    (K and V of ``[num_kv_heads, head_dim]`` per layer, at the run's dtype)."""
    torch = pytest.importorskip("torch")
    from roseinfer.calibration.specs import ModelSpec
    from roseinfer.executor.models import build_model, make_adapter

    model, _, _ = build_model(name, seed=0, dtype=torch.float32, device="cpu")
    shape = make_adapter(model).shape
    spec = ModelSpec.from_hf_config(model.config, name=name, dtype_bytes=4)
    assert spec.kv_bytes_per_token == 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
    assert (spec.name, spec.dtype_bytes, spec.vocab_size) == (name, 4, shape.vocab_size)
    assert spec == ModelSpec.from_hf_config(model.config.to_dict(), name=name, dtype_bytes=4)
    with pytest.raises(ValueError, match="a model config is a JSON object or a config"):
        ModelSpec.from_hf_config("gpt2")


# --- batch shape -------------------------------------------------------------


def test_batch_shape_coerces_and_counts() -> None:
    shape = BatchShape([3, 5], [10, 5], [7, 8, 9])
    assert shape.prefill_new_tokens.dtype == np.int64
    assert (shape.num_seqs, shape.num_tokens) == (5, 11)
    assert BatchShape().is_empty
    with pytest.raises(AttributeError):  # read-only
        shape.decode_context_tokens = np.zeros(0, np.int64)  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_new_tokens": [1, 2], "prefill_context_tokens": [2]},
        {"prefill_new_tokens": [5], "prefill_context_tokens": [4]},
        {"prefill_new_tokens": [0], "prefill_context_tokens": [4]},
        {"decode_context_tokens": [3, 0]},
        {"decode_context_tokens": [[3]]},
    ],
)
def test_batch_shape_rejects_bad_counts(kwargs) -> None:
    with pytest.raises(ValueError):
        BatchShape(**kwargs)


# --- roofline: sanity targets --------------------------------------------------


def test_empty_batch_costs_nothing() -> None:
    assert time_s(BatchShape()) == 0.0
    assert np.array_equal(H100_8B.decode_run_times_s(np.zeros(0, np.int64), 3), np.zeros(3))
    assert H100_8B.decode_run_times_s(np.array([5]), 0).shape == (0,)


def test_llama_8b_h100_decode_is_weight_bandwidth_bound() -> None:
    t = time_s(BatchShape.decode([1000]))
    weights_s = 16e9 / 3.35e12  # ~4.8 ms at datasheet bandwidth
    assert weights_s < t < 2 * weights_s + 2e-3


def test_llama_8b_h100_prefill_2048() -> None:
    t = time_s(prefill([2048]))
    assert 30e-3 <= t <= 60e-3


def test_gpt2_cpu_decode_batch_8_tens_of_ms() -> None:
    t = time_s(BatchShape.decode([200] * 8), COST_MODELS["gpt2-cpu"])
    assert 10e-3 <= t <= 100e-3


def test_bigger_model_slower_faster_memory_faster() -> None:
    decode = BatchShape.decode([1000] * 4)
    h100 = DATASHEET_DEVICES["h100-sxm"]  # the datasheets: same efficiencies, other peaks
    h100_8b = make_cost_model("llama-3.1-8b", h100)
    h200_8b = make_cost_model("llama-3.1-8b", DATASHEET_DEVICES["h200"])
    assert time_s(decode, h200_8b) < time_s(decode, h100_8b)
    assert time_s(decode, make_cost_model("llama-3.1-70b", h100)) > 5 * time_s(decode, h100_8b)
    # Same compute peak: a compute-bound prefill barely changes.
    big = prefill([8192])
    assert time_s(big, h200_8b) == pytest.approx(time_s(big, h100_8b), rel=0.01)


def test_tensor_parallel_splits_the_work() -> None:
    decode = BatchShape.decode([1000] * 8)
    tp1 = make_cost_model("llama-3.1-70b", "h100")
    tp4 = make_cost_model("llama-3.1-70b", "h100", tensor_parallel=4)
    assert time_s(decode, tp4) < time_s(decode, tp1) / 3
    with pytest.raises(ValueError, match="tensor_parallel"):
        make_cost_model("llama-3.1-70b", "h100", tensor_parallel=3)


def test_tensor_parallel_pays_two_all_reduces_per_layer() -> None:
    """Megatron-LM's TP: two all-reduces of tokens x hidden per layer, each a ring
    all-reduce of latency + 2 (tp - 1) / tp x bytes / bandwidth over the link."""
    from roseinfer.calibration.specs import LINKS

    model = get_model_spec("llama-3.1-70b")
    link = LINKS["nvlink4"]
    tp8 = make_cost_model(model, "h200", tensor_parallel=8)
    assert isinstance(tp8, RooflineCostModel) and tp8.link == link
    free = RooflineCostModel(tp8.model, tp8.device, 8, 1, LinkSpec(name="free", bandwidth=1e30,
                                                                   latency_s=0.0))  # fmt: skip
    for tokens in (1, 4096):
        shape = prefill([tokens])
        comm = (
            2
            * model.num_layers
            * (link.latency_s + 2 * 7 / 8 * tokens * model.hidden_size * 2 / link.bandwidth)
        )
        assert time_s(shape, tp8) - time_s(shape, free) == pytest.approx(comm, rel=1e-9)
    one = make_cost_model(model, "h200")
    assert isinstance(one, RooflineCostModel) and one.link is None  # no collectives on one GPU


def test_pipeline_parallel_adds_handoffs_not_speed() -> None:
    decode = BatchShape.decode([1000] * 8)
    pp1 = make_cost_model("llama-3.1-70b", "h200", tensor_parallel=2)
    pp4 = make_cost_model("llama-3.1-70b", "h200", tensor_parallel=2, pipeline_parallel=4)
    assert time_s(decode, pp4) > time_s(decode, pp1)  # one batch at a time: the bubble
    assert time_s(decode, pp4) - time_s(decode, pp1) < 1e-3  # three small handoffs
    with pytest.raises(ValueError, match="pipeline_parallel"):
        make_cost_model("gpt2", "h100", pipeline_parallel=13)
    with pytest.raises(ValueError, match="no link"):
        make_cost_model("gpt2", "cpu", tensor_parallel=2)
    context = np.array([300, 90])
    assert np.array_equal(pp4.decode_run_times_s(context, 40),
                          loop_decode_run_times_s(pp4, context, 40))  # fmt: skip


def test_make_cost_model_dtype() -> None:
    cpu = make_cost_model("gpt2", "cpu")
    assert isinstance(cpu, RooflineCostModel)
    assert cpu.model.dtype_bytes == 4
    forced = make_cost_model(get_model_spec("gpt2"), get_device_spec("cpu"), dtype_bytes=2)
    assert isinstance(forced, RooflineCostModel)
    assert forced.model.dtype_bytes == 2
    assert isinstance(cpu, CostModel)
    assert "gpt2" in cpu.describe() and "cpu" in cpu.describe()


# --- roofline: structure -------------------------------------------------------


def test_decode_is_a_one_token_prefill() -> None:
    assert time_s(prefill([1], [777])) == time_s(BatchShape.decode([777]))


def test_chunked_prefill_attention_adds_up() -> None:
    # Causal attention pairs of chunks 300 + 700 equal those of one 1000-token
    # prefill; only the extra chunk's LM-head row differs.
    whole = H100_8B.flops(prefill([1000]))
    chunks = H100_8B.flops(prefill([300])) + H100_8B.flops(prefill([700], [1000]))
    lm_head = 2 * get_model_spec("llama-3.1-8b").num_lm_head_params
    assert chunks - lm_head == pytest.approx(whole, rel=1e-12)


def test_mixed_batch_is_additive() -> None:
    mixed = BatchShape([512], [1024], [300, 400])
    parts = [prefill([512], [1024]), BatchShape.decode([300, 400])]
    assert H100_8B.flops(mixed) == pytest.approx(sum(H100_8B.flops(p) for p in parts))
    weights = H100_8B.model.streamed_weight_bytes
    parts_bytes = sum(H100_8B.memory_bytes(p) for p in parts) - weights
    assert H100_8B.memory_bytes(mixed) == pytest.approx(parts_bytes)


def test_regimes_cross_at_the_ridge() -> None:
    device = H100_8B.device
    # Short contexts: a decode step does ~2 FLOPs per 2-byte weight per
    # sequence, so it turns compute-bound near batch = ridge intensity.
    bound = [H100_8B.is_compute_bound(BatchShape.decode([16] * b)) for b in range(1, 1024)]
    crossover_batch = bound.index(True) + 1
    assert all(bound[crossover_batch - 1 :])
    assert 0.7 * device.ridge_intensity < crossover_batch < 1.3 * device.ridge_intensity
    assert not H100_8B.is_compute_bound(BatchShape.decode([4096] * 64))
    assert H100_8B.is_compute_bound(prefill([2048]))


def test_a100_ridge_is_lower_than_h100() -> None:
    assert get_device_spec("a100").ridge_intensity < get_device_spec("h100").ridge_intensity


# --- properties ------------------------------------------------------------------

contexts = st.lists(st.integers(1, 200_000), min_size=0, max_size=24)


@st.composite
def batch_shapes(draw: st.DrawFn) -> BatchShape:
    context = draw(st.lists(st.integers(1, 50_000), max_size=8))
    new = [draw(st.integers(1, c)) for c in context]
    return BatchShape(new, context, draw(contexts))


def grow_prefill(shape: BatchShape, i: int, extra: int) -> BatchShape:
    """One more prefill chunk of ``extra`` tokens for sequence ``i`` (same cached part)."""
    new, context = shape.prefill_new_tokens.copy(), shape.prefill_context_tokens.copy()
    new[i] += extra
    context[i] += extra
    return BatchShape(new, context, shape.decode_context_tokens)


def longer_context(shape: BatchShape, i: int, extra: int) -> BatchShape:
    """Prefill ``i`` computes the same new tokens behind ``extra`` more cached ones."""
    context = shape.prefill_context_tokens.copy()
    context[i] += extra
    return BatchShape(shape.prefill_new_tokens, context, shape.decode_context_tokens)


@pytest.mark.parametrize("cost_model", COST_MODELS.values(), ids=COST_MODELS.keys())
@given(shape=batch_shapes(), extra=st.integers(1, 5000), data=st.data())
@settings(max_examples=60, deadline=None)
def test_more_tokens_or_longer_contexts_never_cheaper(cost_model, shape, extra, data) -> None:
    base = cost_model.step_time_s(shape)
    decode = shape.decode_context_tokens
    bigger = [
        BatchShape(shape.prefill_new_tokens, shape.prefill_context_tokens, [*decode, extra]),
        BatchShape(
            [*shape.prefill_new_tokens, extra], [*shape.prefill_context_tokens, extra], decode
        ),
    ]
    if len(decode):
        i = data.draw(st.integers(0, len(decode) - 1))
        longer = decode.copy()
        longer[i] += extra
        bigger.append(BatchShape(shape.prefill_new_tokens, shape.prefill_context_tokens, longer))
    if len(shape.prefill_new_tokens):
        i = data.draw(st.integers(0, len(shape.prefill_new_tokens) - 1))
        bigger += [grow_prefill(shape, i, extra), longer_context(shape, i, extra)]
    for other in bigger:
        assert cost_model.step_time_s(other) >= base


@pytest.mark.parametrize("cost_model", COST_MODELS.values(), ids=COST_MODELS.keys())
@given(context=contexts, num_steps=st.integers(0, 40))
@settings(max_examples=60, deadline=None)
def test_decode_run_equals_step_loop(cost_model, context, num_steps) -> None:
    context_tokens = np.array(context, dtype=np.int64)
    fast = cost_model.decode_run_times_s(context_tokens, num_steps)
    slow = loop_decode_run_times_s(cost_model, context_tokens, num_steps)
    assert fast.shape == (num_steps,) and fast.dtype == np.float64
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=0)
    assert (np.diff(fast) >= 0).all()  # contexts only grow


def test_decode_run_is_vectorized() -> None:
    # 100k steps of a 256-sequence batch: a Python loop would take seconds.
    start = time.perf_counter()
    times = H100_8B.decode_run_times_s(np.full(256, 1000), 100_000)
    assert time.perf_counter() - start < 1.0
    assert times.shape == (100_000,)
    with pytest.raises(ValueError, match="num_steps"):
        H100_8B.decode_run_times_s(np.array([1]), -1)


# --- roofline: the measured specs' host terms -------------------------------------

H100_DATASHEET = DATASHEET_DEVICES["h100-sxm"]


def with_host_terms(**terms: float) -> RooflineCostModel:
    """Llama-3.1-8B on an H100 whose spec sets some of the three host terms."""
    base = replace(H100_DATASHEET, kv_bandwidth_efficiency=None, overhead_per_seq_s=0.0,
                   eager_launch_s_per_layer=0.0, provenance=None)  # fmt: skip
    return RooflineCostModel(get_model_spec("llama-3.1-8b"), replace(base, **terms))


@given(shape=batch_shapes())
@settings(max_examples=60, deadline=None)
def test_unset_host_terms_price_as_the_two_roofs(shape: BatchShape) -> None:
    cost = with_host_terms()
    device = cost.device
    two_roofs = max(cost.flops(shape) / device.achievable_flops,
                    cost.memory_bytes(shape) / device.achievable_bandwidth)  # fmt: skip
    expected = 0.0 if shape.is_empty else two_roofs + device.overhead_s
    assert cost.step_time_s(shape) == expected  # bit for bit: the formula before the terms


def test_an_eager_step_takes_at_least_its_launches() -> None:
    cost, plain = with_host_terms(eager_launch_s_per_layer=1e-3), with_host_terms()
    launches = 32 * 1e-3 + cost.device.overhead_s  # 32 layers
    small_prefill = prefill([16])
    assert cost.step_time_s(small_prefill) == pytest.approx(launches, rel=1e-12)
    assert plain.step_time_s(small_prefill) < 10e-3
    for graphed in (BatchShape.decode([500] * 8), BatchShape.decode([500] * 512)):
        assert cost.step_time_s(graphed) == plain.step_time_s(graphed)  # replayed from a graph
    assert cost.step_time_s(BatchShape.decode([16] * 513)) == pytest.approx(launches)
    assert cost.step_time_s(prefill([1], [777])) == plain.step_time_s(prefill([1], [777]))
    big = prefill([8192])  # the GPU takes longer than the launches: they are hidden
    assert cost.step_time_s(big) == plain.step_time_s(big) > launches


def test_per_sequence_overhead_adds_per_sequence() -> None:
    cost, plain = with_host_terms(overhead_per_seq_s=1e-5), with_host_terms()
    for shape in (BatchShape.decode([300] * 64), BatchShape([100, 50], [100, 50], [9] * 7)):
        extra = cost.step_time_s(shape) - plain.step_time_s(shape)
        assert extra == pytest.approx(1e-5 * shape.num_seqs, rel=1e-9)


def test_kv_bandwidth_prices_only_kv_bytes() -> None:
    cost = with_host_terms(kv_bandwidth_efficiency=0.4)
    plain = with_host_terms()
    device = cost.device
    kv_per_token = cost.model.kv_bytes_per_token
    for contexts in ([100], [4000] * 64):
        shape = BatchShape.decode(contexts)
        kv_bytes = kv_per_token * (sum(contexts) + len(contexts))
        slower = kv_bytes / device.achievable_kv_bandwidth - kv_bytes / device.achievable_bandwidth
        extra = cost.step_time_s(shape) - plain.step_time_s(shape)
        assert extra == pytest.approx(slower, rel=1e-9)
    assert cost.memory_bytes(BatchShape.decode([4000])) == plain.memory_bytes(
        BatchShape.decode([4000])
    )  # bytes are bytes; only their time changes
    with pytest.raises(ValueError, match="kv_bandwidth_efficiency"):
        replace(H100_DATASHEET, kv_bandwidth_efficiency=1.5)
    with pytest.raises(ValueError, match="eager_launch_s_per_layer"):
        replace(H100_DATASHEET, eager_launch_s_per_layer=-1.0)


@given(context=contexts, num_steps=st.integers(0, 20), wide=st.booleans())
@settings(max_examples=40, deadline=None)
def test_decode_runs_with_host_terms_equal_the_step_loop(context, num_steps, wide) -> None:
    cost = with_host_terms(kv_bandwidth_efficiency=0.6, overhead_per_seq_s=1e-5,
                           eager_launch_s_per_layer=5e-4)  # fmt: skip
    context_tokens = np.array(context * (60 if wide else 1), dtype=np.int64)  # up to 1,440
    fast = cost.decode_run_times_s(context_tokens, num_steps)
    slow = loop_decode_run_times_s(cost, context_tokens, num_steps)
    np.testing.assert_allclose(fast, slow, rtol=1e-12, atol=0)


# ------------------------------------------------------------ decode imbalance
def test_a_long_context_among_short_ones_costs_its_excess_over_the_mean() -> None:
    """The measured H100 spec prices the longest decode context's excess over the
    mean (the attention's tail), spread over the splits of a small batch; an even
    batch of the same total pays none of it."""
    device = DEVICES["h100-sxm"]
    c, spread = device.decode_imbalance_s_per_token, device.decode_split_programs / 8
    assert c > 0 and spread == 66.0  # 4 waves x 132 SMs over Llama-8B's 8 KV heads
    even, skewed = (
        BatchShape.decode([1000] * 128),
        BatchShape.decode([4000] + [1000 - 3000 // 127] * 127),
    )
    excess = 128 * 4000 - int(skewed.decode_context_tokens.sum())
    no_tail = RooflineCostModel(H100_8B.model, replace(device, decode_imbalance_s_per_token=0.0))
    assert H100_8B.step_time_s(even) == no_tail.step_time_s(even)
    extra = H100_8B.step_time_s(skewed) - no_tail.step_time_s(skewed)
    assert extra == pytest.approx(c * excess / 128, rel=1e-9)
    small = BatchShape.decode([4000, 1000, 1000, 1000])  # 4 decodes split their keys: spread 66
    extra = H100_8B.step_time_s(small) - no_tail.step_time_s(small)
    assert extra == pytest.approx(c * (4 * 4000 - 7000) / spread, rel=1e-9)
    # on the memory roof: a launch-bound eager step hides it
    eager = BatchShape([64], [64], [4000, 10])
    assert H100_8B.step_time_s(eager) == no_tail.step_time_s(eager)


def test_the_datasheet_specs_have_no_imbalance() -> None:
    assert all(d.decode_imbalance_s_per_token == 0 for d in DATASHEET_DEVICES.values())
    assert DEVICES["a100"].decode_imbalance_s_per_token == 0


def test_the_device_fit_recovers_a_known_imbalance_from_served_steps() -> None:
    """Steps priced by a known spec (profiles of two shapes with even decodes, a
    served run with skewed ones): the two-stage fit finds its imbalance again."""
    from roseinfer.calibration import ProfileSample
    from roseinfer.calibration.roofline_fit import fit_device_constants

    base = DATASHEET_DEVICES["h100-sxm"]
    truth = replace(DEVICES["h100-sxm"], decode_imbalance_s_per_token=1.5e-6, provenance=None)
    rng = np.random.default_rng(0)

    def samples(model: ModelSpec, shapes: list[BatchShape]) -> list[ProfileSample]:
        cost = RooflineCostModel(model, truth)
        return [ProfileSample("x", s, (cost.step_time_s(s),)) for s in shapes]

    even = [BatchShape.decode([c] * n) for n in (1, 8, 64, 256) for c in (128, 1024, 4096)]
    even += [BatchShape([n], [n], []) for n in (16, 256, 2048, 8192)]
    skewed = [BatchShape.decode(rng.lognormal(6.5, 1.0, n).astype(int) + 1) for n in
              rng.integers(8, 256, 60)]  # fmt: skip
    llama, qwen = get_model_spec("llama-3.1-8b"), get_model_spec("qwen2.5-7b")
    fit = fit_device_constants(
        base, [(llama, samples(llama, even)), (qwen, samples(qwen, even))],
        imbalance_steps=[(llama, samples(llama, skewed))],
    )  # fmt: skip
    assert fit.device.decode_imbalance_s_per_token == pytest.approx(1.5e-6, rel=0.02)
    assert fit.device.mfu == pytest.approx(truth.mfu, rel=0.02)
