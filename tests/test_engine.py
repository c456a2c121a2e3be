"""The executor engine: the shared scheduler driving a real model.

Greedy output through ``Engine`` (paged KV, continuous batching, prefix cache,
preemption by recompute, every built-in policy) must equal ``transformers``
``generate()`` token for token. Tiny random models in float32 on CPU with
``initializer_range=0.5`` so that outputs vary (a broken attention would not
"match" by repeating the last prompt token).
"""

from __future__ import annotations

import collections

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import tiny_model  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine, RunResult  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.interface import Phase, PolicyOptions  # noqa: E402
from roseinfer.request import Request, SamplingParams  # noqa: E402
from roseinfer.scheduler import SchedulerOutput  # noqa: E402

torch.set_num_threads(1)

BLOCK_SIZE = 4
MODEL_NAMES = ("tiny-gpt2", "tiny-llama")


# ----------------------------------------------------------------- helpers


def tiny(name: str, **overrides):
    """The shared tiny model (``conftest.tiny_model``)."""
    return tiny_model(name, **overrides)


_MODELS: dict[str, object] = {}


def cached_model(name: str):
    """One model per name for the whole module (weights are never changed)."""
    if name not in _MODELS:
        _MODELS[name] = tiny(name)
    return _MODELS[name]


def make_engine(model, num_kv_blocks: int = 128, **cfg) -> Engine:
    config = SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=BLOCK_SIZE,
        **{"max_num_seqs": 16, "max_model_len": 256, **cfg},
    )
    runner = ModelRunner(
        model,
        num_kv_blocks=num_kv_blocks,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype=torch.float32,
    )
    return Engine(runner, config)


def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=gen).tolist()


def request(i: int, prompt: list[int], max_tokens: int, arrival: float = 0.0, **kw) -> Request:
    return Request(f"r{i}", arrival, len(prompt), max_tokens, tuple(prompt), **kw)


_HF_CACHE: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def hf_greedy(model, prompt: list[int] | tuple[int, ...], num_tokens: int) -> list[int]:
    """``generate()`` with EOS off, so it runs exactly ``num_tokens`` steps."""
    key = (id(model), tuple(prompt), num_tokens)
    if key not in _HF_CACHE:
        config = GenerationConfig(
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=0,
        )
        ids = torch.tensor([list(prompt)])
        # NOTE: an explicit mask, else generate() masks prompt tokens equal to pad_token_id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _HF_CACHE[key] = out[0, len(prompt) :].tolist()
    return _HF_CACHE[key]


def run(engine: Engine, requests: list[Request]) -> tuple[RunResult, list[SchedulerOutput]]:
    """``engine.run`` while logging every non-empty step and counting request ends."""
    sched = engine.scheduler
    steps: list[SchedulerOutput] = []
    ends: collections.Counter[str] = collections.Counter()
    schedule, end = sched.schedule, sched._end

    def logged_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if not out.is_empty:
            steps.append(out)
        return out

    def counted_end(seq, *args, **kwargs):
        ends[seq.request_id] += 1
        return end(seq, *args, **kwargs)

    sched.schedule = logged_schedule
    sched._end = counted_end
    result = engine.run(requests)
    assert dict(ends) == {r.request_id: 1 for r in requests}, "a request did not end exactly once"
    assert sched.block_manager.num_used_blocks == 0
    sched.check_invariants()
    assert len(result.records) == len(requests)
    return result, steps


def outputs(result: RunResult) -> dict[str, list[int]]:
    records = result.records
    return dict(zip(records["request_id"], map(list, records["output_token_ids"])))


def assert_matches_generate(model, requests: list[Request], result: RunResult) -> None:
    got = outputs(result)
    for r in requests:
        expected = hf_greedy(model, r.prompt_token_ids, r.max_output_tokens)
        if len(expected) >= 4:
            assert len(set(expected)) > 2, f"degenerate {expected}: raise initializer_range"
        assert got[r.request_id] == expected, r.request_id
    assert (result.records["status"] == "finished").all()
    counts = dict(zip(result.records["request_id"], result.records["num_output_tokens"]))
    assert counts == {r.request_id: r.max_output_tokens for r in requests}


def mixed_requests(seed: int = 1) -> list[Request]:
    """Different prompt and output lengths, plus a shared 13-token prefix (3 full
    blocks) and two identical prompts, all arriving at once."""
    lengths, outs = (3, 9, 14, 21, 6), (8, 5, 10, 7, 9)
    reqs = [request(i, random_ids(n, seed + i), m) for i, (n, m) in enumerate(zip(lengths, outs))]
    prefix = random_ids(13, seed + 100)
    reqs.append(request(5, prefix + random_ids(4, seed + 101), 6))
    reqs.append(request(6, prefix + random_ids(7, seed + 102), 8))
    twin = random_ids(10, seed + 103)
    reqs.append(request(7, twin, 7))
    reqs.append(request(8, twin, 7))
    return reqs


# --------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_batched_greedy_equals_generate(name, prefix_caching):
    model = cached_model(name)
    reqs = mixed_requests()
    result, steps = run(make_engine(model, enable_prefix_caching=prefix_caching), reqs)
    assert_matches_generate(model, reqs, result)

    first = steps[0]
    assert first.phase is Phase.PREFILL and len(first.prefills) == len(reqs)  # one batch
    num_prompt_tokens = sum(r.num_prompt_tokens for r in reqs)
    num_computed = sum(out.num_prefill_tokens for out in steps if out.phase is Phase.PREFILL)
    cached = dict(zip(result.records["request_id"], result.records["num_cached_prompt_tokens"]))
    if prefix_caching:
        # r6 reuses r5's 3 prefix blocks and r8 its twin's 2 full blocks, in the same step
        assert cached["r6"] == 12 and cached["r8"] == 8 and cached["r7"] == 0
        assert num_computed == num_prompt_tokens - 20
    else:
        assert set(cached.values()) == {0}
        assert num_computed == num_prompt_tokens


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_preemption_by_recompute_keeps_greedy_output(name, prefix_caching):
    """A 14-block pool for 6 requests that each grow to 5-6 blocks: decodes run
    dry, requests are preempted and recomputed, outputs stay exact."""
    model = cached_model(name)
    reqs = [request(i, random_ids(9 + i, 40 + i), 12) for i in range(6)]
    result, steps = run(make_engine(model, 14, enable_prefix_caching=prefix_caching), reqs)
    assert_matches_generate(model, reqs, result)
    assert result.scheduler.num_preemptions > 0
    assert result.records["num_preemptions"].sum() == result.scheduler.num_preemptions
    assert any(out.preempted for out in steps)
    assert result.scheduler.max_used_blocks <= 14


CHUNKED = {
    "mixed": dict(
        loop_order="mixed",
        enable_chunked_prefill=True,
        long_prefill_token_threshold=16,
        max_num_batched_tokens=40,
    ),
    "prefill-first": dict(enable_chunked_prefill=True, max_num_batched_tokens=16),
}


def chunked_requests(seed: int = 7) -> list[Request]:
    """Prompts of 5-70 tokens (two share a 37-token prefix), arriving in three
    waves so later prompts are cut into chunks beside running decodes."""
    lengths = (70, 9, 41, 23, 5, 58)
    reqs = [
        request(i, random_ids(n, seed + i), 6 + i, arrival=0.01 * (i // 2))
        for i, n in enumerate(lengths)
    ]
    prefix = random_ids(37, seed + 50)
    reqs.append(request(6, prefix + random_ids(11, seed + 51), 7, arrival=0.0))
    reqs.append(request(7, prefix + random_ids(3, seed + 52), 9, arrival=0.02))
    return reqs


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("order", sorted(CHUNKED))
def test_chunked_prefill_and_mixed_steps_give_generate_output(name, order):
    model = cached_model(name)
    reqs = chunked_requests()
    result, steps = run(make_engine(model, max_num_seqs=8, **CHUNKED[order]), reqs)
    assert_matches_generate(model, reqs, result)
    partial = [i for out in steps for i in out.scheduled if not i.samples]
    assert partial and all(i.num_new_tokens <= 16 for i in partial)  # 16-token chunks
    assert any(out.prefills and out.decodes for out in steps) == (order == "mixed")
    assert result.records.set_index("request_id").loc["r7", "num_cached_prompt_tokens"] == 36


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_chunked_prefill_survives_preemption(name):
    """A 24-block pool for prompts of 23-70 tokens cut into 16-token chunks: partial
    prefills and decodes are preempted and recomputed, outputs stay exact."""
    model = cached_model(name)
    reqs = chunked_requests(seed=11)
    engine = make_engine(model, 26, max_num_seqs=8, **CHUNKED["mixed"])
    result, steps = run(engine, reqs)
    assert_matches_generate(model, reqs, result)
    assert result.scheduler.num_preemptions > 0


POLICIES = {
    "fifo": dict(policy="fifo", max_num_seqs=3),
    "budget": dict(policy="budget", prefill_max_tokens=16, max_num_seqs=4),
    "pack+force-fifo": dict(
        policy="pack",
        prefill_max_tokens=16,
        max_num_seqs=4,
        options=PolicyOptions(lookahead=4, force_fifo_every=2),
    ),
    "decode-first": dict(policy="fifo", loop_order="decode-first", max_num_seqs=3),
}


@pytest.mark.parametrize("case", sorted(POLICIES))
def test_every_builtin_policy_gives_generate_output(case):
    model = cached_model("tiny-gpt2")
    lengths = (5, 30, 3, 12, 25, 4, 8, 17)
    reqs = [
        request(i, random_ids(n, 60 + i), 4 + i % 5, arrival=0.002 * (i // 3))
        for i, n in enumerate(lengths)
    ]
    cfg = POLICIES[case]
    result, steps = run(make_engine(model, **cfg), reqs)
    assert_matches_generate(model, reqs, result)
    assert result.policy.startswith(cfg["policy"])
    budget = cfg.get("prefill_max_tokens")
    for out in steps:
        assert len(out.prefills) + len(out.decodes) <= cfg["max_num_seqs"]
        if budget is not None and len(out.prefills) > 1:
            assert out.num_prefill_tokens <= budget
    admitted = [[p.seq.request_id for p in out.prefills] for out in steps if out.prefills]
    assert len(admitted) > 1  # seats or the budget split admission over several steps


def test_decode_first_runs_the_decode_before_admitting():
    """Two seats; r0 ends after 2 tokens, freeing a seat while r1 runs and r2
    waits: prefill-first admits r2 before the next decode, decode-first after."""
    model = cached_model("tiny-gpt2")
    reqs = [request(i, random_ids(7, 180 + i), 2 if i == 0 else 6) for i in range(4)]

    def phases(order: str) -> list[str]:
        result, steps = run(make_engine(model, max_num_seqs=2, loop_order=order), reqs)
        assert_matches_generate(model, reqs, result)
        return [out.phase.value[0] for out in steps[:4]]

    assert phases("prefill-first") == ["p", "d", "p", "d"]
    assert phases("decode-first") == ["p", "d", "d", "p"]


# ------------------------------------------------------------ stop and errors


def test_stop_token_ends_a_request_early():
    model = cached_model("tiny-llama")
    prompt = random_ids(7, 90)
    full = hf_greedy(model, prompt, 10)
    stop_at = next(i for i in range(2, 10) if full[i] not in full[:i])
    eos = full[stop_at]
    sampling = SamplingParams(ignore_eos=False, stop_token_ids=(eos,))
    reqs = [
        request(0, prompt, 10, sampling=sampling),
        request(1, prompt, 10),  # ignore_eos (default): runs to its length
    ]
    result, _ = run(make_engine(model), reqs)
    got = outputs(result)
    assert got["r0"] == full[: stop_at + 1]
    assert got["r1"] == full
    rec = result.records.set_index("request_id")
    assert rec.loc["r0", "stop_reason"] == "stop" and rec.loc["r1", "stop_reason"] == "length"
    assert rec.loc["r0", "status"] == "finished"
    assert list(result.records["num_output_tokens"]) == [stop_at + 1, 10]


def test_requests_without_token_ids_are_refused_before_any_step():
    model = cached_model("tiny-gpt2")
    engine = make_engine(model)
    good = request(0, random_ids(5, 1), 3)
    with pytest.raises(ValueError, match="no prompt token ids.*with_token_ids"):
        engine.run([good, Request("lengths-only", 0.0, 5, 3)])
    with pytest.raises(ValueError, match="token id 5000 outside"):
        engine.run([request(2, [1, 5000, 2], 3)])
    with pytest.raises(ValueError, match="no prompt token ids"):
        engine.add_request(Request("x", 0.0, 5, 3))
    assert engine.scheduler.num_submitted == 0
    assert engine.scheduler.block_manager.num_used_blocks == 0


def test_rejected_last_request_does_not_stall_the_run():
    """A request longer than max_model_len is rejected with a reason, even when it
    is the last to arrive and nothing else is left to run."""
    model = cached_model("tiny-gpt2")
    reqs = [request(0, random_ids(5, 2), 4), request(1, random_ids(60, 3), 10, arrival=0.01)]
    engine = make_engine(model, max_model_len=64)
    ended: list[int] = []
    result = engine.run(reqs, progress=ended.append)
    assert sum(ended) == 2
    rec = result.records.set_index("request_id")
    assert rec.loc["r0", "status"] == "finished"
    assert (
        rec.loc["r1", "status"] == "rejected" and "max_model_len" in rec.loc["r1", "reject_reason"]
    )
    assert engine.scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(RuntimeError, match="new Engine"):
        engine.run(reqs)


def test_seeded_sampling_is_reproducible_whatever_the_batch():
    model = cached_model("tiny-gpt2")
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    target = request(0, random_ids(6, 4), 12, sampling=sampling)
    alone, _ = run(make_engine(model), [target])
    others = [request(i, random_ids(4 + i, 5 + i), 8, sampling=SamplingParams(1.0)) for i in (1, 2)]
    crowded, _ = run(make_engine(model), [others[0], target, others[1]])
    assert outputs(alone)["r0"] == outputs(crowded)["r0"]
    assert outputs(alone)["r0"] != hf_greedy(model, target.prompt_token_ids, 12)


def test_runner_and_config_pools_must_match():
    model = cached_model("tiny-gpt2")
    runner = ModelRunner(model, num_kv_blocks=8, block_size=4, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="differs from the scheduler config"):
        Engine(runner, SchedulerConfig(num_kv_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the 256 tokens"):
        Engine(runner, SchedulerConfig(num_kv_blocks=8, block_size=4))  # GPT-2 positions


def test_step_timings_are_recorded_when_asked():
    model = cached_model("tiny-gpt2")
    config = SchedulerConfig(num_kv_blocks=32, block_size=BLOCK_SIZE, max_model_len=128)
    runner = ModelRunner(
        model, num_kv_blocks=32, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32
    )
    engine = Engine(runner, config, record_timings=True)
    result = engine.run([request(i, random_ids(5, i), 3) for i in range(2)])
    assert len(result.timings) == result.scheduler.step_log.num_steps == 3
    assert [t.phase for t in result.timings] == ["prefill", "decode", "decode"]
    assert [t.num_tokens for t in result.timings] == [10, 2, 2]
    assert all(t.forward_s > 0 and t.host_s >= 0 and t.num_seqs == 2 for t in result.timings)
    ends = list(result.scheduler.step_log.end_s)
    assert ends == sorted(ends) and result.duration_s == pytest.approx(ends[-1])
