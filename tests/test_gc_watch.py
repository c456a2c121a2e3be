"""A timed run freezes the heap built before it and counts the collector's pauses.

Before: a full collection in the middle of a run walked the model, torch and
transformers with the GIL held, stalling one step by 256-280 ms in a 2,000-request
tiny-llama run on the CPU (``benchmarks/gc_pauses.py``), and nothing said so.
"""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import tiny_model  # noqa: E402

from roseinfer.cli.run import GC_PAUSE_WARN_S, warn_stalls  # noqa: E402
from roseinfer.config import SchedulerConfig  # noqa: E402
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.gc_watch import GcPauses, GcWatch, frozen_heap  # noqa: E402
from roseinfer.executor.model_runner import ModelRunner  # noqa: E402
from roseinfer.request import Request  # noqa: E402

BLOCKS, BLOCK_SIZE = 32, 4


def engine(on_step=None) -> Engine:
    model = tiny_model("tiny-gpt2")
    config = SchedulerConfig(num_kv_blocks=BLOCKS, block_size=BLOCK_SIZE, max_model_len=64)
    runner = ModelRunner(
        model, num_kv_blocks=BLOCKS, block_size=BLOCK_SIZE, device="cpu", dtype=torch.float32
    )
    return Engine(runner, config, on_step=on_step)


def requests(n: int = 3) -> list[Request]:
    return [Request(f"r{i}", 0.0, 5, 4, tuple(range(i, i + 5))) for i in range(n)]


@pytest.fixture
def unfrozen():
    """Each test starts and ends with nothing frozen, whatever ran before it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_model_is_frozen_during_the_run_and_thawed_after(unfrozen) -> None:
    seen: list[tuple[bool, int]] = []

    def on_step(*_args) -> None:
        walked = {id(o) for o in gc.get_objects()}
        seen.append((id(eng.runner.model) in walked, gc.get_freeze_count()))

    eng = engine(on_step)
    eng.run(requests())
    assert seen and all(not walked and frozen > 0 for walked, frozen in seen)
    assert gc.get_freeze_count() == 0
    assert id(eng.runner.model) in {id(o) for o in gc.get_objects()}


def test_a_callers_freeze_is_kept(unfrozen) -> None:
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_heap():
        pass
    assert gc.get_freeze_count() >= before > 0


def test_freezing_walks_no_full_heap_and_loses_no_garbage(unfrozen) -> None:
    """The freeze before a run collects only the young generations (a full
    collection walked ~420,000 objects of torch and transformers before every
    run); a cycle left before it is frozen, then freed once unfrozen."""
    import weakref

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    gc.collect()
    gc.collect()  # the pair now sits in the oldest generation... still referenced
    del a, b  # ...and is now garbage there
    generations: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with frozen_heap():
            assert alive() is not None  # frozen with the rest
    finally:
        gc.callbacks.remove(seen)
    assert 2 not in generations
    gc.collect()
    assert alive() is None


def test_collections_during_the_run_are_counted(unfrozen) -> None:
    def on_step(*_args) -> None:
        gc.collect()  # a full collection in the middle of the run

    result = engine(on_step).run(requests())
    steps = result.scheduler.step_log.num_steps
    pauses = result.gc
    assert pauses.full_collections >= steps and pauses.collections >= steps
    assert 0 < pauses.max_s <= pauses.total_s


def test_the_watch_counts_only_while_open() -> None:
    with GcWatch() as watch:
        gc.collect(0)
        gc.collect(2)
    gc.collect()
    pauses = watch.pauses()
    assert (pauses.collections, pauses.full_collections) == (2, 1)
    assert pauses.max_s <= pauses.total_s


def facts(max_s: float, retries: int | None) -> dict[str, object]:
    return {**GcPauses(3, 1, max_s * 2, max_s).facts(), "cuda_alloc_retries": retries}


def test_stalls_are_warned_and_quiet_runs_are_not() -> None:
    said: list[str] = []
    warn_stalls(facts(GC_PAUSE_WARN_S / 10, None), said.append)
    warn_stalls(facts(GC_PAUSE_WARN_S / 10, 0), said.append)
    assert said == []
    warn_stalls(facts(0.25, 2), said.append)
    assert len(said) == 2
    assert "250 ms" in said[0] and "1 full collections" in said[0]
    assert "retried 2 allocations" in said[1] and "--gpu-memory-utilization" in said[1]
