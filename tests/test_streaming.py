"""The streaming front: enqueue-only add_request, worker thread, streams.

Timing is never measured: a gate on ``runner.forward`` holds the worker inside
a step until the test releases it, so every interleaving asserted here is
forced, not raced. Every ``stream()`` read has a timeout, so a bug shows up as
a failure, never as a hung test run.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from conftest import tiny_model  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.detokenizer import IncrementalDetokenizer  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.executor.streaming import (  # noqa: E402
    EngineClosedError,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
    StreamBusyError,
    StreamingEngine,
    StreamOutput,
)
from roseinfer.executor.validation import InvalidRequestError  # noqa: E402
from roseinfer.request import Request, SamplingParams  # noqa: E402

torch.set_num_threads(1)

BLOCK_SIZE = 4
TIMEOUT_S = 10.0
GREEDY = SamplingParams()  # ignore_eos: exactly max_tokens tokens
CORPUS = ["hello world, héllo wörld 你好世界 🌹 roses are red, violets are blue"] * 20


# ----------------------------------------------------------------- helpers


def small_vocab_model(vocab_size: int = 1000):
    """The shared tiny model with a small vocabulary and token 0 as BOS and EOS."""
    return tiny_model("tiny-gpt2", vocab_size=vocab_size, bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def model():
    return small_vocab_model()


def byte_level_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained offline on a tiny corpus (``<eos>`` is id 0).
    ``vocab_size=257`` learns no merges: every byte is its own token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False
    )


def make_engine(model, num_kv_blocks: int = 64, **cfg) -> Engine:
    config = SchedulerConfig(
        num_kv_blocks=num_kv_blocks,
        block_size=BLOCK_SIZE,
        **{"max_num_seqs": 8, "max_model_len": 128, **cfg},
    )
    runner = ModelRunner(
        model, num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32
    )
    return Engine(runner, config)


class Gate:
    """Holds ``runner.forward`` until the test releases steps; counts forwards."""

    def __init__(self, runner: ModelRunner) -> None:
        self.permits = threading.Semaphore(0)
        self.entered = threading.Event()  # a forward is waiting at the gate
        self.num_forwards = 0
        forward = runner.forward

        def gated(inputs):
            self.entered.set()
            assert self.permits.acquire(timeout=TIMEOUT_S), "the test never released this step"
            self.entered.clear()
            self.num_forwards += 1
            return forward(inputs)

        runner.forward = gated

    def release(self, num_steps: int = 1) -> None:
        self.permits.release(num_steps)

    def open(self) -> None:
        self.permits.release(100_000)


class Harness:
    """A streaming engine plus the checks every test ends with."""

    def __init__(self, model, tokenizer=None, gate: bool = False, **cfg) -> None:
        self.engine = make_engine(model, **cfg)
        self.gate = Gate(self.engine.runner) if gate else None
        self.ends: collections.Counter[str] = collections.Counter()
        sched = self.engine.scheduler
        end = sched._end

        def counted_end(seq, *args, **kwargs):
            self.ends[seq.request_id] += 1
            return end(seq, *args, **kwargs)

        sched._end = counted_end
        self.se = StreamingEngine(self.engine, tokenizer=tokenizer, idle_wait_s=0.01)

    def tokens(self, rid: str) -> list[StreamOutput]:
        return list(self.se.stream(rid, timeout_s=TIMEOUT_S))

    def shutdown(self) -> None:
        if self.gate is not None:
            self.gate.open()
        self.se.close(timeout_s=TIMEOUT_S)
        assert not self.se._worker.is_alive(), "worker did not stop"

    def record(self, rid: str):  # type: ignore[no-untyped-def]
        """The record of an ended request (the worker filed it before its stream ended)."""
        return self.engine.records.frame().set_index("request_id").loc[rid]

    def assert_clean(self) -> None:
        """Worker stopped; every request ended exactly once; no KV block held."""
        self.shutdown()
        sched = self.engine.scheduler
        assert not sched.has_unfinished()
        records = self.engine.records.frame()  # token times agree with token counts
        assert records["request_id"].is_unique
        assert dict(self.ends) == {rid: 1 for rid in records["request_id"]}
        assert sched.block_manager.num_used_blocks == 0
        sched.check_invariants()


@pytest.fixture
def harness(model):
    made: list[Harness] = []

    def make(**kw) -> Harness:
        h = Harness(kw.pop("model", model), **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


def prompts_of(*lengths: int, seed: int = 3, vocab: int = 1000) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def offline(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from the offline engine (same model, fresh KV pool)."""
    reqs = [
        Request(f"o{i}", 0.0, len(p), max_tokens, tuple(p), sampling=GREEDY)
        for i, p in enumerate(prompts)
    ]
    result = make_engine(model).run(reqs)
    by_id = dict(zip(result.records["request_id"], result.records["output_token_ids"]))
    return [by_id[f"o{i}"] for i in range(len(prompts))]


# ------------------------------------------------------------------ streams


def test_add_request_only_enqueues_and_streams_equal_the_offline_engine(harness, model):
    h = harness(gate=True)
    prompts = prompts_of(5, 11, 3)
    rids: list[str] = []
    adder = threading.Thread(
        target=lambda: rids.extend(
            h.se.add_request(p, max_tokens=9, sampling=GREEDY) for p in prompts
        )
    )
    adder.start()
    adder.join(TIMEOUT_S)
    # add_request returned while no forward has run (one may wait at the gate)
    assert not adder.is_alive() and len(rids) == 3 and len(set(rids)) == 3
    assert h.gate.num_forwards == 0 and h.engine.scheduler.step_log.num_steps == 0
    with pytest.raises(queue.Empty):
        next(h.se.stream(rids[0], timeout_s=0.05))
    h.gate.open()
    streams = [h.tokens(rid) for rid in rids]
    assert [[o.token_id for o in s] for s in streams] == offline(model, prompts, 9)
    for s in streams:
        assert [o.finished for o in s] == [False] * 8 + [True]
        assert s[-1].stop_reason == "length" and all(o.stop_reason == "" for o in s[:-1])
        times = [o.time_s for o in s]
        assert times == sorted(times) and len(set(times)) == len(times)
    with pytest.raises(KeyError):  # a stream read to its end is gone
        next(h.se.stream(rids[0]))
    h.assert_clean()
    assert (h.engine.records.frame()["status"] == "finished").all()


def test_streams_stay_exact_through_preemptions(harness, model):
    """A 12-block pool for 4 requests growing to 5 blocks each: streams carry on
    after recompute with neither a lost nor a repeated token."""
    h = harness(num_kv_blocks=12)
    prompts = prompts_of(7, 9, 6, 8, seed=5)
    rids = [h.se.add_request(p, max_tokens=12, sampling=GREEDY) for p in prompts]
    got = [[o.token_id for o in h.tokens(rid)] for rid in rids]
    assert got == offline(model, prompts, 12)
    assert h.engine.scheduler.num_preemptions > 0
    h.assert_clean()


def test_text_pieces_concatenate_to_the_decoded_output(harness):
    tokenizer = byte_level_tokenizer()
    model = small_vocab_model(len(tokenizer))
    h = harness(model=model, tokenizer=tokenizer)
    text = "héllo wörld 你好"
    rid = h.se.add_request(text, max_tokens=40, sampling=GREEDY)
    outs = h.tokens(rid)
    ids = [o.token_id for o in outs]
    assert len(ids) == 40
    prompts = h.engine.records.frame().set_index("request_id")["prompt_token_ids"]
    assert prompts[rid] == tokenizer.encode(text)
    assert "".join(o.text for o in outs) == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(1 for o in outs if o.text) > 1  # pieces arrive as tokens do, not all at the end
    h.assert_clean()


def test_default_sampling_stops_at_the_tokenizer_eos(harness):
    """Without SamplingParams a request stops at the tokenizer's EOS: with the
    EOS id set to the first greedy token, the stream is one token, reason "stop"."""
    tokenizer = byte_level_tokenizer()
    model = small_vocab_model(len(tokenizer))
    h = harness(model=model, tokenizer=tokenizer)
    prompt = tokenizer.encode("roses are red")
    first = h.tokens(h.se.add_request(prompt, max_tokens=5, sampling=GREEDY))[0].token_id
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)
    assert tokenizer.eos_token_id == first
    outs = h.tokens(h.se.add_request(prompt, max_tokens=5))
    assert [o.token_id for o in outs] == [first]
    assert outs[0].finished and outs[0].stop_reason == "stop"
    h.assert_clean()


@pytest.mark.parametrize("vocab", [257, 300], ids=["bytes", "bpe"])
def test_incremental_detokenizer_holds_back_split_characters(vocab):
    """Multi-byte characters split over tokens come out whole, never as U+FFFD,
    and the pieces add up to the text (a prompt gives the first piece context)."""
    tokenizer = byte_level_tokenizer(vocab)
    text = "héllo wörld 你好世界 🌹 ok"
    ids = tokenizer.encode(text)
    if vocab == 257:
        assert len(ids) == len(text.encode())  # one token per byte
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("roses "))
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    if vocab == 257:
        assert "你" in pieces and "🌹" in pieces  # 3- and 4-byte characters, each one piece


# -------------------------------------------------------------------- abort


def test_abort_ends_the_stream_and_frees_its_blocks(harness, model):
    h = harness(gate=True)
    prompt = prompts_of(9)[0]
    rid = h.se.add_request(prompt, max_tokens=50, sampling=GREEDY)
    h.gate.release(3)  # prefill + 2 decodes
    stream = h.se.stream(rid, timeout_s=TIMEOUT_S)
    got = [next(stream).token_id for _ in range(3)]
    assert h.gate.entered.wait(TIMEOUT_S)  # the worker waits inside step 4
    h.se.abort(rid)
    h.gate.open()
    got += [o.token_id for o in stream]  # ends without an error
    assert 3 <= len(got) < 50
    assert got == offline(model, [prompt], len(got))[0]
    rec = h.record(rid)
    assert rec.status == "rejected" and rec.reject_reason == "aborted"
    assert h.engine.scheduler.block_manager.num_used_blocks == 0  # freed before the stream ended
    h.se.abort(rid)  # again: ignored
    h.se.abort("no-such-request")
    h.assert_clean()


def test_abort_right_after_add_request_is_never_lost(harness, model):
    """The abort is queued behind its request: B ends with no token even though
    the worker sees both only after the step it is stuck in."""
    h = harness(gate=True)
    a, b = prompts_of(6, 7)
    rid_a = h.se.add_request(a, max_tokens=4, sampling=GREEDY)
    assert h.gate.entered.wait(TIMEOUT_S)  # A's prefill waits at the gate
    rid_b = h.se.add_request(b, max_tokens=4, sampling=GREEDY)
    h.se.abort(rid_b)
    h.gate.open()
    assert h.tokens(rid_b) == []
    assert [o.token_id for o in h.tokens(rid_a)] == offline(model, [a], 4)[0]
    assert h.record(rid_b).reject_reason == "aborted"
    h.assert_clean()


# ------------------------------------------------------------ close, faults


def test_close_ends_every_open_stream(harness):
    h = harness(gate=True)
    short, long_a, long_b = prompts_of(4, 5, 6)
    rid_short = h.se.add_request(short, max_tokens=1, sampling=GREEDY)
    rid_a = h.se.add_request(long_a, max_tokens=60, sampling=GREEDY)
    rid_b = h.se.add_request(long_b, max_tokens=60, sampling=GREEDY)
    h.gate.release(2)
    done = h.tokens(rid_short)  # finished before the close: ends normally
    assert len(done) == 1 and done[0].finished
    assert h.gate.entered.wait(TIMEOUT_S)
    closer = threading.Thread(target=h.se.close, kwargs={"timeout_s": TIMEOUT_S})
    closer.start()
    h.gate.open()
    closer.join(TIMEOUT_S)
    assert not closer.is_alive()
    for rid in (rid_a, rid_b):
        got: list[StreamOutput] = []
        with pytest.raises(EngineClosedError, match="closed"):
            got.extend(h.se.stream(rid, timeout_s=TIMEOUT_S))
        assert len(got) < 60 and not any(o.finished for o in got)
    with pytest.raises(EngineClosedError):
        h.se.add_request([1, 2, 3], max_tokens=2)
    h.assert_clean()
    assert h.record(rid_a).reject_reason == "aborted"


def test_a_worker_fault_ends_every_stream_with_its_cause(harness):
    h = harness()
    runner = h.engine.runner
    forward, calls = runner.forward, itertools.count()
    boom = RuntimeError("boom: device lost")

    def faulty(inputs):
        if next(calls) == 2:
            raise boom
        return forward(inputs)

    runner.forward = faulty
    rids = [h.se.add_request(p, max_tokens=20, sampling=GREEDY) for p in prompts_of(5, 8)]
    for rid in rids:
        with pytest.raises(EngineClosedError, match="worker failed") as info:
            h.tokens(rid)
        assert info.value.__cause__ is boom
    with pytest.raises(EngineClosedError) as info:
        h.se.add_request([1, 2], max_tokens=2)
    assert info.value.__cause__ is boom
    h.assert_clean()
    assert set(h.engine.records.frame()["reject_reason"]) == {"aborted"}


def test_done_callbacks_hear_of_the_end_once(harness):
    h = harness()
    runner = h.engine.runner
    boom = RuntimeError("boom")
    heard: list[object] = []
    h.se.add_done_callback(lambda err: heard.append(("before", err)))
    h.se.on_fatal = lambda err: heard.append(("on_fatal", err))
    runner.forward = lambda inputs: (_ for _ in ()).throw(boom)
    rid = h.se.add_request([1, 2, 3], max_tokens=2, sampling=GREEDY)
    with pytest.raises(EngineClosedError):
        h.tokens(rid)
    h.se.close(timeout_s=TIMEOUT_S)
    h.se.add_done_callback(lambda err: heard.append(("after", err)))  # called at once
    assert heard == [("before", boom), ("on_fatal", boom), ("after", boom)]
    closed = harness()
    closed.se.close(timeout_s=TIMEOUT_S)
    closed.se.add_done_callback(lambda err: heard.append(("closed", err)))
    assert heard[-1] == ("closed", None)


def test_the_worker_steps_with_the_engines_own_step(harness, model):
    """One step rule: the worker runs ``Engine.step`` (it used to repeat its body)."""
    h = harness(tokenizer=byte_level_tokenizer())
    step, calls = h.engine.step, itertools.count()

    def counted(*args, **kwargs):
        next(calls)
        return step(*args, **kwargs)

    h.engine.step = counted
    rid = h.se.add_request("hello world", max_tokens=3, sampling=GREEDY)
    assert len(h.tokens(rid)) == 3
    assert next(calls) == 3  # one prefill-and-sample step, two decodes
    h.assert_clean()


# ----------------------------------------------------------------- refusals


def test_bad_requests_are_refused_clearly(harness):
    h = harness()
    with pytest.raises(ValueError, match="needs a tokenizer"):
        h.se.add_request("text without a tokenizer")
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        h.se.add_request([1, 1000], max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        h.se.add_request([1, 2], max_tokens=0)
    rid = h.se.add_request([1, 2, 3], max_tokens=200)  # 203 tokens > max_model_len 128
    with pytest.raises(RequestRejectedError, match="max_model_len 128"):
        h.tokens(rid)
    rid = h.se.add_request([4, 5], max_tokens=3, request_id="mine")
    assert rid == "mine"
    with pytest.raises(ValueError, match="already in use"):
        h.se.add_request([4, 5], max_tokens=3, request_id="mine")
    assert len(h.se.generate([6, 7, 8], max_tokens=3, sampling=GREEDY)) == 3
    assert len(h.tokens("mine")) == 3
    with pytest.raises(ValueError, match="already in use"):  # also once its stream is read
        h.se.add_request([4, 5], max_tokens=3, request_id="mine")
    mine = {h.se.add_request([4], max_tokens=1, request_id=f"req-{k}") for k in (20, 21)}
    generated = {h.se.add_request([4], max_tokens=1) for _ in range(25)}
    assert len(generated) == 25 and not generated & mine  # generated ids skip taken ones
    assert len(h.se.generate([9], max_tokens=2, sampling=GREEDY)) == 2  # the worker lives on
    h.assert_clean()


# ------------------------------------------------- validation at add_request

BAD_FIELDS = [
    ("temperature", {"sampling": SamplingParams(temperature=float("nan"))}),
    ("temperature", {"sampling": SamplingParams(temperature=float("inf"))}),
    ("seed", {"sampling": SamplingParams(temperature=1.0, seed=2**70)}),
    ("seed", {"sampling": SamplingParams(temperature=1.0, seed=-(2**64))}),
    ("seed", {"sampling": SamplingParams(temperature=1.0, seed=1.5)}),
    ("top_k", {"sampling": SamplingParams(temperature=1.0, top_k=2.5)}),
    ("ignore_eos", {"sampling": SamplingParams(ignore_eos="yes")}),
    ("stop_token_ids", {"sampling": SamplingParams(stop_token_ids=(1.5,))}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("max_tokens", {"max_tokens": True}),
    ("max_tokens", {"max_tokens": "3"}),
    ("max_tokens", {"max_tokens": 0}),
    ("prompt", {"prompt": [1.0, 2]}),
    ("prompt", {"prompt": [True, 2]}),
    ("prompt", {"prompt": [1, -1]}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": b"ab"}),
    ("request_id", {"request_id": 5}),
    ("request_id", {"request_id": ""}),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_FIELDS, ids=[f for f, _ in BAD_FIELDS])
def test_add_request_refuses_each_bad_field_by_name(harness, field, kwargs):
    """Values sampling cannot take, and Python's silent conversions (2.5 -> 3
    tokens, True -> 1, float ids truncated), are refused at add_request with the
    field named; nothing is queued and the engine keeps serving."""
    h = harness()
    prompt = kwargs.pop("prompt", [1, 2, 3])
    with pytest.raises(InvalidRequestError, match=f"^{field} ") as info:
        h.se.add_request(prompt, **{"max_tokens": 2, **kwargs})
    assert info.value.field == field
    assert h.engine.scheduler.num_submitted == 0
    assert len(h.se.generate([1, 2, 3], max_tokens=2, sampling=GREEDY)) == 2
    h.assert_clean()


def test_engine_api_refuses_requests_built_around_the_checks(model):
    """Engine.add_request / run check a Request whose constructor let a bad value by."""
    engine = make_engine(model)
    for field, request in [
        ("max_tokens", Request("a", 0.0, 2, 2.5, (1, 2))),
        ("max_tokens", Request("b", 0.0, 2, True, (1, 2))),
        ("prompt", Request("c", 0.0, 2, 2, (1.0, 2))),
        ("request_id", Request(7, 0.0, 2, 2, (1, 2))),  # type: ignore[arg-type]
        ("temperature", Request("d", 0.0, 2, 2, (1, 2), sampling=SamplingParams(float("nan")))),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(request)
        assert info.value.field == field
        with pytest.raises(InvalidRequestError):
            make_engine(model).run([request])
    assert engine.scheduler.num_submitted == 0


def test_top_k_minus_one_disables_top_k_as_in_vllm(harness):
    h = harness()
    a = h.se.generate([1, 2, 3], max_tokens=6, sampling=SamplingParams(1.0, top_k=-1, seed=4))
    b = h.se.generate([1, 2, 3], max_tokens=6, sampling=SamplingParams(1.0, top_k=0, seed=4))
    assert [o.token_id for o in a] == [o.token_id for o in b]
    h.assert_clean()


def test_a_sampling_failure_ends_that_request_only(harness, model):
    """A NaN temperature slipped in after the check (the state the review's
    ``temperature=nan`` reached): sampling raises for that row; its stream ends
    with RequestFailedError, its blocks are freed, the other request's tokens are
    exact, and the engine accepts new requests."""
    h = harness(gate=True)
    good, bad = prompts_of(6, 7)
    victim = SamplingParams(temperature=1.0, seed=1)
    rid_good = h.se.add_request(good, max_tokens=8, sampling=GREEDY)
    rid_bad = h.se.add_request(bad, max_tokens=8, sampling=victim)
    object.__setattr__(victim, "temperature", float("nan"))
    h.gate.open()
    with pytest.raises(RequestFailedError, match="sampling failed") as info:
        h.tokens(rid_bad)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert [o.token_id for o in h.tokens(rid_good)] == offline(model, [good], 8)[0]
    assert len(h.se.generate(good, max_tokens=3, sampling=GREEDY)) == 3
    rec = h.record(rid_bad)
    assert rec.status == "rejected" and rec.reject_reason.startswith("sampling failed")
    h.assert_clean()


def test_a_second_reader_is_refused_and_a_closed_reader_hands_over(harness, model):
    h = harness(gate=True)
    prompt = prompts_of(5)[0]
    rid = h.se.add_request(prompt, max_tokens=10, sampling=GREEDY)
    first = h.se.stream(rid, timeout_s=TIMEOUT_S)
    with pytest.raises(StreamBusyError, match="has a reader"):
        h.se.stream(rid)
    h.gate.open()
    got = [next(first).token_id for _ in range(4)]
    first.close()  # the first reader leaves early: no token is lost to anyone
    got += [o.token_id for o in h.se.stream(rid, timeout_s=TIMEOUT_S)]
    assert got == offline(model, [prompt], 10)[0]
    h.assert_clean()


def test_max_waiting_refuses_when_full_then_accepts_again(harness):
    h = harness(gate=True, max_num_seqs=1)
    h.se.max_waiting = 2
    rids = [h.se.add_request([1, 2], max_tokens=2, sampling=GREEDY)]
    assert h.gate.entered.wait(TIMEOUT_S)  # the first runs (stuck at the gate)
    rids += [h.se.add_request([3, 4], max_tokens=2, sampling=GREEDY) for _ in range(2)]
    assert h.se.num_waiting() == 2
    with pytest.raises(QueueFullError, match="max_waiting"):
        h.se.add_request([5, 6], max_tokens=2, sampling=GREEDY)
    h.gate.open()
    assert [len(h.tokens(r)) for r in rids] == [2, 2, 2]
    assert len(h.se.generate([5, 6], max_tokens=2, sampling=GREEDY)) == 2
    h.assert_clean()


def test_astream_reads_concurrent_streams_without_threads(harness, model):
    import asyncio

    h = harness()
    prompts = prompts_of(4, 9, 6)

    async def read_all() -> list[list[int]]:
        rids = [h.se.add_request(p, max_tokens=7, sampling=GREEDY) for p in prompts]

        async def one(rid: str) -> list[int]:
            return [o.token_id async for o in h.se.astream(rid)]

        return await asyncio.wait_for(asyncio.gather(*map(one, rids)), TIMEOUT_S)

    assert asyncio.run(read_all()) == offline(model, prompts, 7)
    h.assert_clean()
