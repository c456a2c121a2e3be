"""The decode graph runner: capture sizes, padding, static buffers, replay bookkeeping.

Without CUDA the graph runner runs its static-buffer path eagerly with the Triton
backend in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
imported): everything but ``torch.cuda.CUDAGraph`` itself. The CUDA graphs are
checked in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_model_runner import prompts_of, tiny  # noqa: E402

from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.graph_runner import (  # noqa: E402
    GraphCaptureError,
    capture_sizes,
    padded_size,
)
from roseinfer.executor.input_batch import InputBatch, host_arrays  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner, SeqInput  # noqa: E402
from roseinfer.executor.warmup import warm_up  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs the triton package"
)


def test_capture_sizes_are_vllms_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(13) == [1, 2, 4, 8]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(4096)[-1] == 512 and len(capture_sizes(4096)) == 67
    assert padded_size(3, [1, 2, 4, 8]) == 4 and padded_size(8, [1, 2, 4, 8]) == 8
    assert padded_size(9, [1, 2, 4, 8]) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_host_arrays_pack_a_step_and_pad_decodes():
    """Positions, slot mapping, query starts and block tables from numpy; a decode
    batch padded with rows that store nothing (slot -1) and see nothing (length 0)."""
    seqs = [SeqInput([7, 8, 9], 2, [5, 6]), SeqInput([4], 6, [1, 3])]
    fields, host = host_arrays(seqs, block_size=4)
    assert fields["positions"].tolist() == [2, 3, 4, 6]
    assert fields["slot_mapping"].tolist() == [22, 23, 24, 14]
    assert fields["query_start_loc"].tolist() == [0, 3, 4]
    assert fields["last_token_indices"].tolist() == [2, 3]
    assert host.seq_lens.tolist() == [5, 7] and host.block_tables.tolist() == [[5, 6], [1, 3]]
    decodes = [SeqInput([4], 6, [1, 3]), SeqInput([2], 0, [9])]
    fields, host = host_arrays(decodes, block_size=4, pad_to=4)
    assert fields["slot_mapping"].tolist() == [14, 36, -1, -1]
    assert fields["seq_lens"].tolist() == [7, 1, 0, 0]
    assert fields["query_start_loc"].tolist() == [0, 1, 2, 3, 4]
    assert host.block_tables.tolist() == [[1, 3], [9, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="decode batch"):
        host_arrays(seqs, block_size=4, pad_to=4)


@settings(max_examples=60, deadline=None)
@given(
    contexts=st.lists(st.integers(0, 70), min_size=1, max_size=9),
    extra_rows=st.integers(0, 5),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_a_decode_batchs_arrays_are_each_tokens_own(contexts, extra_rows, block_size):
    """A decode batch's arrays (built at their padded length) against the rule, row by
    row: each token at its context's position, in the slot its table gives that
    position; padding rows store nothing and see nothing; tables zero-padded."""
    rng = np.random.default_rng(len(contexts) * 100 + extra_rows)
    tables = [rng.permutation(200)[: c // block_size + 1].tolist() for c in contexts]
    seqs = [SeqInput([7 + i], c, t) for i, (c, t) in enumerate(zip(contexts, tables))]
    rows = len(seqs) + extra_rows
    fields, host = host_arrays(seqs, block_size, pad_to=rows)
    pad = [0] * extra_rows
    assert fields["token_ids"].tolist() == [7 + i for i in range(len(seqs))] + pad
    assert fields["positions"].tolist() == contexts + pad
    assert fields["seq_lens"].tolist() == [c + 1 for c in contexts] + pad
    expected_slots = [t[c // block_size] * block_size + c % block_size
                      for c, t in zip(contexts, tables)]  # fmt: skip
    assert fields["slot_mapping"].tolist() == expected_slots + [-1] * extra_rows
    assert fields["query_start_loc"].tolist() == list(range(rows + 1))
    assert fields["last_token_indices"].tolist() == list(range(rows))
    width = max(len(t) for t in tables)
    assert (
        host.block_tables.tolist()
        == [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * extra_rows
    )
    assert host.query_lens.tolist() == [1] * rows


def test_input_batch_views_share_one_buffer_and_grow():
    batch_maker = InputBatch(torch.device("cpu"), block_size=4, initial_capacity=8)
    seqs = [SeqInput(list(range(9)), 0, [0, 1, 2])]
    batch = batch_maker.build(seqs, lambda q, m, s: {}, num_kv_blocks=4)
    assert batch.token_ids.tolist() == list(range(9))
    assert batch.block_tables.tolist() == [[0, 1, 2]]
    base = batch.token_ids.untyped_storage().data_ptr()
    assert batch.slot_mapping.untyped_storage().data_ptr() == base  # one buffer


def test_every_field_starts_128_byte_aligned():
    """Fields of odd sizes still start at 128-byte boundaries: Triton compiles per
    pattern of aligned pointers, so a misaligned field would recompile mid-run."""
    batch_maker = InputBatch(torch.device("cpu"), block_size=4)
    for lengths in ((3,), (5, 1, 7), (1, 1, 1)):
        seqs = [SeqInput(list(range(n)), i, [0, 1, 2]) for i, n in enumerate(lengths)]
        extra = lambda q, m, s: {"odd": np.arange(len(q) * 3 + 1)}  # noqa: E731
        batch = batch_maker.build(seqs, extra, num_kv_blocks=4)
        fields = [*batch.flat_fields().values(), batch.block_tables, *batch.extra.values()]
        base = batch.token_ids.untyped_storage().data_ptr()  # CUDA's allocator: 512-aligned
        assert all((t.data_ptr() - base) % 128 == 0 for t in fields)
        assert batch.extra["odd"].tolist() == list(range(len(lengths) * 3 + 1))
        assert batch.positions.tolist() == [i + p for i, n in enumerate(lengths) for p in range(n)]


@needs_triton
def test_a_graph_pass_arrives_in_the_static_buffers_in_one_region():
    """The static fields are views of one region, each 128-byte aligned (so a graph's
    kernels keep their aligned-pointer variant); a padded decode's host batch lands
    in them and in the block table as the eager batch of the same inputs has them, a
    shorter batch after it overwrites only what it uses, and a field the buffers do
    not have room for is one ValueError naming it."""
    model = tiny("tiny-llama").to(DEVICE)
    runner = runner_for(model)
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=32)
    family = runner.graphs.decode
    base = family.region.data_ptr()
    assert all(t.data_ptr() - base >= 0 and (t.data_ptr() - base) % 128 == 0
               for t in family.flat.values())  # fmt: skip
    make = runner.input_batch
    seqs = [SeqInput([5], 9, [3, 4, 7]), SeqInput([6], 2, [8])]
    host = make.host_batch(seqs, runner.backend.host_fields, pad_to=4)
    family.load(host)
    eager = make.build(seqs, runner.backend.host_fields, 64, pad_to=4)
    for name, values in eager.flat_fields().items():
        assert family.flat[name][: values.numel()].tolist() == values.tolist(), name
    assert family.tables[:4, :3].tolist() == eager.block_tables.tolist()
    family.load(make.host_batch(seqs[1:], runner.backend.host_fields, pad_to=1))
    assert family.flat["token_ids"][:4].tolist() == [6, 6, 0, 0]  # rows past 1 as they were
    assert family.tables[0, :1].tolist() == [8] and family.tables[1, :3].tolist() == [8, 0, 0]
    host.fields["token_ids"] = np.zeros(5, np.int64)
    with pytest.raises(ValueError, match="'token_ids' of 5 does not fit"):
        family.load(host)
    host.fields = {"tokens": np.zeros(1, np.int64)}
    with pytest.raises(ValueError, match="have no field 'tokens'"):
        family.load(host)


def runner_for(model, **kw):
    return ModelRunner(
        model, num_kv_blocks=64, block_size=4, device=DEVICE, dtype=torch.float32,
        attention_backend="triton", **kw,
    )  # fmt: skip


def decode_tokens(runner, prompts, tables, num_steps):
    logits = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts, tables)])
    outs = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(num_steps):
        step = [SeqInput([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, outs, tables)]
        for out, token in zip(outs, runner.forward(step).argmax(-1).tolist()):
            out.append(token)
    return outs


@needs_triton
def test_static_decode_path_gives_the_eager_tokens(monkeypatch):
    """Decodes of 3 sequences run padded to 4 through the static buffers (the
    graph path) and give the tokens of the eager runner; a batch past the largest
    size runs eagerly."""
    model = tiny("tiny-llama").to(DEVICE)
    prompts, tables = prompts_of(3, 9, 6), [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    eager = decode_tokens(runner_for(model, enforce_eager=True), prompts, tables, 3)
    runner = runner_for(model)
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=32)
    assert runner.graphs is not None and runner.graphs.captured_sizes == [1, 2, 4]
    sizes = []
    real_run = runner.graphs.run
    monkeypatch.setattr(runner.graphs, "run", lambda b: sizes.append(b.num_seqs) or real_run(b))
    assert decode_tokens(runner, prompts, tables, 3) == eager
    assert sizes == [4, 4, 4]
    five = [SeqInput([1], 3, [40 + i]) for i in range(5)]
    runner.forward(five)
    assert sizes == [4, 4, 4]  # 5 > 4: eager


@needs_triton
def test_graphs_off_when_eager_or_backend_cannot_be_captured():
    model = tiny("tiny-llama").to(DEVICE)
    eager = runner_for(model, enforce_eager=True)
    assert eager.capture_cuda_graphs(8, 32) == 0.0 and eager.graphs is None
    assert eager.graph_batch_sizes == ()
    sdpa = ModelRunner(
        model, num_kv_blocks=8, block_size=4, device=DEVICE, dtype=torch.float32,
        attention_backend="sdpa",
    )  # fmt: skip
    assert sdpa.capture_cuda_graphs(8, 32) == 0.0 and sdpa.graph_batch_sizes == ()


@needs_triton
def test_warm_up_captures_first_and_reallocation_drops_graphs():
    model = tiny("tiny-llama").to(DEVICE)
    runner = runner_for(model)
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_num_seqs=2, max_model_len=16)
    steps = warm_up(runner, config)
    assert steps[0].name == "cuda-graphs" and steps[0].num_seqs == 2
    assert runner.graphs is not None and runner.cuda_graph_capture_s > 0
    runner.allocate_kv_cache(32)
    assert runner.graphs is None and runner.num_kv_blocks == 32


def test_a_mixed_pass_pads_with_one_keyless_sequence():
    """A prefill/mixed pass padded to a token count: the padding tokens write no
    slot and belong to one extra sequence of length 0; the real rows are as built
    unpadded."""
    seqs = [SeqInput([5, 6, 7], 2, [0, 1]), SeqInput([9], 4, [2, 3])]
    plain, _ = host_arrays(seqs, 4)
    fields, host = host_arrays(seqs, 4, pad_tokens_to=8)
    assert fields["token_ids"].tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert fields["slot_mapping"].tolist() == [*plain["slot_mapping"].tolist(), -1, -1, -1, -1]
    assert fields["positions"].tolist()[4:] == [0] * 4
    assert fields["query_start_loc"].tolist() == [0, 3, 4, 8]
    assert fields["seq_lens"].tolist() == [5, 5, 0]
    assert host.query_lens.tolist() == [3, 1, 4] and host.block_tables.shape == (3, 2)
    exact, _ = host_arrays(seqs, 4, pad_tokens_to=4)  # no padding token: an empty sequence
    assert exact["query_start_loc"].tolist() == [0, 3, 4, 4]
    with pytest.raises(ValueError, match="cannot pad"):
        host_arrays(seqs, 4, pad_tokens_to=3)


def mixed_steps(runner, prompts, tables):
    """Two prompts prefilled, then one decodes while a third prompt is prefilled
    (a mixed pass), then a long prompt past the mixed sizes: every step's argmax."""
    tokens = []
    first = runner.forward([SeqInput(p, 0, t) for p, t in zip(prompts[:2], tables[:2])])
    tokens.append(first.argmax(-1).tolist())
    mixed = [SeqInput([tokens[0][0]], len(prompts[0]), tables[0]),
             SeqInput(prompts[2], 0, tables[2])]  # fmt: skip
    tokens.append(runner.forward(mixed).argmax(-1).tolist())
    tokens.append(runner.forward([SeqInput(prompts[3], 0, tables[3])]).argmax(-1).tolist())
    return tokens


@needs_triton
def test_full_mode_replays_small_prefill_and_mixed_passes(monkeypatch):
    """``cudagraph_mode="FULL"``: prefill and mixed passes up to the largest mixed
    size run padded to a captured token count through the static buffers (the
    graph path) and give the eager runner's tokens and KV cache; a longer pass, one
    with no row left for the padding sequence, or a context past the static block
    tables runs eagerly; the default mode captures no mixed size."""
    model = tiny("tiny-llama").to(DEVICE)
    prompts, tables = prompts_of(5, 9, 6, 30), [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    eager_runner = runner_for(model, enforce_eager=True)
    eager = mixed_steps(eager_runner, prompts, tables)
    runner = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=24)
    assert runner.mixed_graph_max_tokens == 24
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    assert runner.graphs is not None and runner.graphs.captured_mixed_sizes == [2, 4, 8, 16, 24]
    sizes = []
    real = runner.graphs.run_mixed
    monkeypatch.setattr(runner.graphs, "run_mixed", lambda b: sizes.append(b.num_tokens) or real(b))
    assert mixed_steps(runner, prompts, tables) == eager
    assert sizes == [16, 8, 24, 8]  # 5 + 9 tokens, then 1 + 6, then passes of 24 and 6
    assert torch.allclose(runner.kv_cache, eager_runner.kv_cache, atol=1e-5)
    graphs = runner.graphs
    assert graphs.padded_tokens(25, 1, 1) is None  # past the largest size: eagerly
    assert graphs.padded_tokens(8, 5, 1) is None  # past max_num_seqs: no rows for it
    assert graphs.padded_tokens(8, 4, 1) == 8 and graphs.padded_tokens(3, 1, 11) is None
    default = runner_for(model)
    default.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    assert default.mixed_graph_max_tokens == 0 and default.graphs.mixed_sizes == []
    with pytest.raises(ValueError, match="cudagraph_mode"):
        runner_for(model, cudagraph_mode="PIECEWISE")


@needs_triton
def test_triton_pads_a_mixed_pass_query_blocks_to_a_count_fixed_by_its_size():
    """Query blocks of a padded mixed pass: the real ones, then blocks of the last
    (padding) sequence starting past every query, up to ceil(tokens / block_q) +
    rows whatever the lengths; more sequences than rows are refused."""
    from roseinfer.executor.attn_triton import TritonBackend, query_blocks

    backend = TritonBackend(8, 2, torch.device("cpu"))  # 4 query heads per KV head
    block_q = backend.block_q(2)
    for lens in ([3, 1, 4], [16], [1, 1, 1, 13]):
        q = np.array(lens, np.int64)
        fields = backend.graph_host_fields(q, 16, 5)
        seq, start = query_blocks(q, block_q)
        capacity = -(-16 // block_q) + 5
        assert len(fields["q_block_seq"]) == len(fields["q_block_start"]) == capacity
        assert fields["q_block_seq"][: len(seq)].tolist() == seq.tolist()
        assert fields["q_block_start"][: len(seq)].tolist() == start.tolist()
        assert set(fields["q_block_seq"][len(seq) :].tolist()) <= {len(lens) - 1}
        assert set(fields["q_block_start"][len(seq) :].tolist()) <= {16}
    with pytest.raises(ValueError, match="do not fit"):
        backend.graph_host_fields(np.ones(6, np.int64), 16, 5)


@needs_triton
def test_any_small_pass_replays_as_it_runs_eagerly():
    """Random passes of up to 24 tokens, each sequence a fresh prompt, a chunk over
    a cached prefix or a decode, run through the FULL-mode static path and eagerly
    over the same cache: the same logits and the same cache after (the padding
    sequence and its query blocks change nothing)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    model = tiny("tiny-llama").to(DEVICE)
    eager = runner_for(model, enforce_eager=True)
    full = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=24)
    full.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    assert full.graphs is not None
    piece = st.tuples(st.integers(0, 12), st.integers(1, 8))  # (cached prefix, new tokens)

    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(pieces=st.lists(piece, min_size=1, max_size=4), seed=st.integers(0, 99))
    def check(pieces: list[tuple[int, int]], seed: int) -> None:
        rng = np.random.default_rng(seed)
        steps = []
        for i, (cached, new) in enumerate(pieces):
            table = list(range(i * 10, i * 10 + 10))
            tokens = rng.integers(0, 100, cached + new).tolist()
            steps.append((SeqInput(tokens[:cached], 0, table) if cached else None,
                          SeqInput(tokens[cached:], cached, table)))  # fmt: skip
        for runner in (eager, full):
            runner.kv_cache.zero_()
            prefixes = [p for p, _ in steps if p is not None]
            if prefixes:
                runner.forward(prefixes)
        used = []
        real = full.graphs.run_mixed
        full.graphs.run_mixed = lambda b: used.append(b.num_tokens) or real(b)
        try:
            replayed = full.forward([s for _, s in steps])
        finally:
            full.graphs.run_mixed = real
        expected = eager.forward([s for _, s in steps])
        assert torch.allclose(replayed, expected, atol=1e-4, rtol=1e-4)
        # float32 GEMMs over a padded pass round differently (seen: 1.9e-5 on a K entry)
        assert torch.allclose(full.kv_cache, eager.kv_cache, atol=1e-4, rtol=1e-4)
        if any(new > 1 for _, new in pieces):  # a decode-only batch takes the decode graphs
            assert used

    check()


class _InvalidatedCapture:
    """``torch.cuda.graph`` whose capture CUDA invalidated (as on the H100)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        raise RuntimeError(
            "CUDA error: operation failed due to a previous error during capture\nSearch for ..."
        )


@needs_triton
def test_a_refused_capture_is_one_error_line_naming_the_flag(monkeypatch):
    """A capture CUDA refuses is a ``ValueError`` (one CLI error line) naming the
    pass and the flag that avoids it; an out-of-memory stays one (the memory
    planner names the flags for it)."""
    model = tiny("tiny-llama").to(DEVICE)
    runner = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=24)
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    graphs = runner.graphs
    monkeypatch.setattr(torch.cuda, "graph", _InvalidatedCapture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(graphs, "use_cuda_graphs", True)
    with pytest.raises(GraphCaptureError) as err:
        graphs._capture_one(graphs.mixed, 24, pool=object())
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    assert "prefill/mixed pass of 24 tokens" in message and "previous error during" in message
    assert "--cudagraph-mode FULL_DECODE_ONLY" in message
    with pytest.raises(GraphCaptureError, match="decode batch of 4 sequences.*--enforce-eager"):
        graphs._capture_one(graphs.decode, 4, pool=object())

    class OutOfMemory(_InvalidatedCapture):
        def __exit__(self, *exc):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch.cuda, "graph", OutOfMemory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        graphs._capture_one(graphs.decode, 4, pool=object())


@needs_triton
def test_no_automatic_collection_runs_inside_a_capture(monkeypatch):
    """The collector is off while a graph is captured (a finalizer calling into CUDA
    mid-capture can invalidate it) and on again after, also when the capture fails."""
    import gc

    model = tiny("tiny-llama").to(DEVICE)
    runner = runner_for(model)
    runner.capture_cuda_graphs(max_num_seqs=2, max_model_len=16)
    graphs, seen = runner.graphs, []

    class Recording(_InvalidatedCapture):
        def __enter__(self):
            seen.append(gc.isenabled())
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(torch.cuda, "graph", Recording)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(graphs, "use_cuda_graphs", True)
    assert gc.isenabled()
    graphs._capture_one(graphs.decode, 2, pool=object())
    monkeypatch.setattr(torch.cuda, "graph", _InvalidatedCapture)
    with pytest.raises(GraphCaptureError):
        graphs._capture_one(graphs.decode, 2, pool=object())
    assert seen == [False] and gc.isenabled()


@needs_triton
def test_a_released_runner_is_freed_at_once_with_its_graphs_destroyed(monkeypatch):
    """A released graph runner (FULL mode: a mixed family too) holds no reference
    cycle, so it and its graphs go when released, not at a later garbage collection
    that could land in the middle of another capture; its graphs are reset first."""
    import gc
    import weakref

    model = tiny("tiny-llama").to(DEVICE)
    runner = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=24)
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    graphs = runner.graphs
    resets = []

    class Graph:
        def reset(self):
            resets.append(self)

    first = next(iter(graphs.mixed.captured.values()))
    monkeypatch.setattr(first, "graph", Graph())
    gone = weakref.ref(graphs)
    del graphs
    was_enabled = gc.isenabled()
    gc.disable()  # only reference counting may free it
    try:
        runner.release_cuda_graphs()
        assert gone() is None and len(resets) == 1 and runner.graphs is None
    finally:
        if was_enabled:
            gc.enable()


@needs_triton
def test_the_fused_adapters_kv_store_skips_the_graph_paths_padding():
    """The fused Llama adapter stores K/V in its rotary launch. Through the static
    buffers (decodes padded to a capture size, FULL passes padded with a keyless
    sequence: slot -1 rows) it gives the eager non-fused runner's tokens, and the KV
    pool holds the same values, padding rows writing nowhere."""
    from roseinfer.executor.llama_fused import FusedLlamaAdapter

    model = tiny("tiny-llama").to(DEVICE)
    prompts, tables = prompts_of(5, 9, 6, 30), [list(range(i * 10, i * 10 + 10)) for i in range(4)]
    eager_runner = runner_for(model, enforce_eager=True)
    eager = mixed_steps(eager_runner, prompts, tables)
    eager_decodes = decode_tokens(eager_runner, prompts[:3], tables[:3], 3)
    runner = runner_for(model, cudagraph_mode="FULL", max_tokens_per_pass=24,
                        adapter=FusedLlamaAdapter(model))  # fmt: skip
    assert runner.adapter.stores_kv
    runner.capture_cuda_graphs(max_num_seqs=4, max_model_len=40)
    assert mixed_steps(runner, prompts, tables) == eager
    assert decode_tokens(runner, prompts[:3], tables[:3], 3) == eager_decodes  # 3 padded to 4
    # fused and eager layers round apart (1e-4); blocks no table holds (40-63, the last
    # where a -1 slot would wrap to) stay exactly as the eager runner left them
    torch.testing.assert_close(runner.kv_cache, eager_runner.kv_cache, rtol=1e-4, atol=1e-4)
    assert torch.equal(runner.kv_cache[:, :, 40:], eager_runner.kv_cache[:, :, 40:])
