"""The runner's read of a step's block tables: Python lists against ``array('i')``.

``ModelRunner.forward`` reads every sequence's block ids once per step
(:func:`roseinfer.executor.input_batch.used_block_ids`). The engine hands it the
block manager's own ``array('i')`` tables (``BlockManager.block_ids``), whose bytes
are joined and read in one numpy call; a list table costs one numpy conversion per
sequence. Until 2026-11-27 the step table of ``gpu_throughput.py``, the profile
grid of ``rose-run profile`` and the warm-up's timed passes built their inputs
with list tables (``executor.warmup.scratch_inputs``), so they timed that slower
read, which ``rose-run`` itself no longer does. This prints both reads, best of
``--repeats`` rounds of ``--number`` calls, for decode batches of B sequences of
``--blocks`` blocks each::

    python benchmarks/block_table_read.py
"""

from __future__ import annotations

import argparse
import sys
import timeit
from array import array
from collections.abc import Sequence


def read_ms(batch: int, blocks: int, number: int, repeats: int) -> tuple[float, float]:
    """Milliseconds per read of ``batch`` tables of ``blocks`` ids: (lists, arrays)."""
    import numpy as np

    from roseinfer.executor.input_batch import used_block_ids
    from roseinfer.executor.model_runner import SeqInput

    counts = np.full(batch, blocks, np.int64)
    context = blocks * 16 - 1

    def ids(i: int) -> range:
        return range(i * blocks, (i + 1) * blocks)

    lists = [SeqInput([1], context, list(ids(i))) for i in range(batch)]
    arrays = [SeqInput([1], context, array("i", ids(i))) for i in range(batch)]
    out = []
    for seqs in (lists, arrays):
        best = min(timeit.repeat(lambda s=seqs: used_block_ids(s, counts), number=number,
                                 repeat=repeats))  # fmt: skip
        out.append(best / number * 1e3)
    return out[0], out[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, time each batch size, print one row per size."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,32,256")
    p.add_argument("--blocks", type=int, default=64, help="blocks per sequence (64: 1,024 tokens)")
    p.add_argument("--number", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    if args.blocks < 1 or args.number < 1 or args.repeats < 1:
        p.error("--blocks, --number and --repeats must be >= 1")
    print(f"block-table read per step (ms; best of {args.repeats} x {args.number} calls)")
    print(f"{'B':>4} {'list':>8} {'array':>8} {'ratio':>7}")
    for batch in (int(b) for b in args.batch_sizes.split(",") if b):
        lists, arrays = read_ms(batch, args.blocks, args.number, args.repeats)
        print(f"{batch:>4} {lists:8.3f} {arrays:8.3f} {lists / arrays:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
