"""The garbage collector during a timed run: the start-up heap frozen, pauses counted.

A process that has built a model holds hundreds of thousands of container objects
(torch, transformers, Triton, the model's modules). CPython's full (generation 2)
collection walks all of them with the GIL held, and it starts by itself whenever
enough new objects survive. In a run, one such collection stalls one step:
256-280 ms in a 2,000-request tiny-llama ``rose-run`` on this project's 2-core
CPU VM (``benchmarks/gc_pauses.py``). In a server it stalls every stream and ``/health`` (0.3-1.0 s,
set off by a burst of allocations such as decoding a large body). A lone 397 ms
graphed decode step in an H200 run was of that size; its cause was not confirmed.

Freezing (``gc.freeze``, CPython 3.7+) moves the objects alive now into a
permanent generation that collections skip; vLLM freezes its heap after start-up
for the same reason. :func:`frozen_heap` does so before the clock starts, so a
full collection during the run walks only the run's own objects, and
:class:`GcWatch` counts the collections and their pauses while it is open, for
the result file. :func:`collector_paused` (defined with the trace parser, which
uses it too) keeps the collector out of CUDA graph captures.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from roseinfer.workloads.traces import collector_paused

__all__ = ["GcPauses", "GcWatch", "collector_paused", "frozen_heap"]


@contextmanager
def frozen_heap() -> Iterator[None]:
    """For the ``with`` body: collect the young generations, then move every object
    alive now to the collector's permanent generation (``gc.freeze``), which later
    collections do not walk; afterwards unfreeze, unless the heap was frozen before
    (a caller that froze first keeps its freeze).

    Frozen objects are still freed when their reference count drops to zero; only
    cycles among them wait for the unfreeze. The oldest generation is not collected
    first: with a model, torch and transformers loaded, a full collection walks about
    420,000 objects (136-140 ms in a process holding GPT-2 alone on the 2-core VM,
    2026-11-28), which every ``Engine.run`` paid before its first step: with it,
    ``benchmarks/executor_vs_hf.py --w2-32`` against 9ded1cb gave 0.92-0.94x, without
    it 0.97-1.01x (README, Benchmarks). The garbage it would find is frozen with the
    rest and collected after the unfreeze."""
    was_frozen = gc.get_freeze_count() > 0
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()


@dataclass(frozen=True, slots=True)
class GcPauses:
    """The collections made while a :class:`GcWatch` was open.

    Attributes:
        collections: collections of any generation.
        full_collections: generation-2 collections (the ones that walk the whole
            unfrozen heap).
        total_s: seconds spent collecting, all generations.
        max_s: the longest single collection (s); 0.0 without any.
    """

    collections: int = 0
    full_collections: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def facts(self) -> dict[str, float | int]:
        """The result-file fields: ``gc_collections``, ``gc_full_collections``,
        ``gc_pause_s`` (total) and ``gc_pause_max_s``."""
        return {
            "gc_collections": self.collections,
            "gc_full_collections": self.full_collections,
            "gc_pause_s": self.total_s,
            "gc_pause_max_s": self.max_s,
        }


class GcWatch:
    """Times every garbage collection while open (a ``gc.callbacks`` hook).

    Use as ``with GcWatch() as watch: ...``, then read :meth:`pauses`. The hook
    costs two clock reads per collection.
    """

    def __init__(self) -> None:
        self._started = 0.0
        self._collections = 0
        self._full = 0
        self._total_s = 0.0
        self._max_s = 0.0

    def _hook(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self._collections += 1
        self._full += info.get("generation") == 2
        self._total_s += pause
        self._max_s = max(self._max_s, pause)

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._hook)

    def pauses(self) -> GcPauses:
        """What was counted so far."""
        return GcPauses(self._collections, self._full, self._total_s, self._max_s)
