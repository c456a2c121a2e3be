"""The ``triton`` attention backend: one paged-attention kernel per layer (CUDA).

Host side of :mod:`roseinfer.executor.triton_kernels` (imported when the
backend is built, so ``TRITON_INTERPRET`` set before that applies). Per pass it
chooses the launch shape from host integers only (no device read):

* query blocks: each sequence's query tokens cut into runs of ``block_q``
  (:func:`query_blocks`); ``block_q`` gives 16 rows per program for a decode
  batch (``block_q`` x query heads per KV head; ``tl.dot`` needs >= 16), 64 for
  short prefills and 128 once a pass holds a query run of
  :data:`LONG_QUERY_TOKENS`, so a prefill's K/V tiles are reused across many
  queries;
* key tiles, warps and pipeline stages: per launch kind (decode rows and split
  count, or prefill rows), the fastest of a few candidates timed by
  :meth:`TritonBackend.tune` in the warm-up on passes of the run's own limits
  (decodes at 1,024 tokens of context, prefills of up to 8,192 tokens), else
  32-token tiles for decodes and 64 otherwise with 4 warps and 3 stages;
* split-KV: a decode batch whose ``sequences x KV heads`` programs would not
  give every SM :data:`SPLIT_TARGET_WAVES` of them is split into ``ceil(waves x
  SMs / programs)`` key ranges (at most :data:`MAX_SPLITS`): with fewer, each
  program streams a long key range alone and the memory system idles (on one
  H200, 32 sequences x 8 KV heads = 256 programs for 132 SMs read their
  contexts at 53% of the copy bandwidth, 256 sequences at 86%). The split count
  depends on the batch size rounded up to the CUDA-graph capture grid, so a
  graph replay and an eager step of the same batch run the same kernels.
* balanced splits: a decode batch large enough not to split has one program
  per sequence and KV head, so its longest context streams its keys alone on one
  SM after the others are done (on one H100, 256 decodes at 1,024 tokens took
  22.6 ms, and 28.2 ms with one context of 4,096: 1.8 us per token of the one
  long context, 2026-11-27, ``benchmarks/gpu/results/h100-2026-11-27d-full/
  steps.txt``). Balanced splits cut only the contexts longer than
  :data:`BALANCE_SLACK` runs into equal runs, a run being about the batch's
  mean context (at least :data:`BALANCE_MIN_KEYS` keys), list them first so
  they start first, and merge their partials in a reduce over the split
  sequences only (:func:`balanced_work`). The list has room for a quarter more
  runs than rows (runs grow when a batch would need more), so a padded batch
  has one launch and graphs hold. The warm-up times such a batch with uniform
  contexts and with one context :data:`SKEW_FACTOR` times longer, plain and
  balanced, and keeps the balanced launch only if it wins over both passes
  together by :data:`TUNE_MARGIN`.

* decodes of a large mixed pass: the pass's query blocks have the prefill's
  ``block_q`` (128 rows for a long prefill), so a decode row in it (one query,
  4 rows with 4 query heads per KV head) would multiply 128-row tiles of which
  124 are padding: with 256 decodes of 1,024 tokens beside a long chunk, 2,048
  programs x 16 tiles of 64 keys x two 128 x 128 x 64 products = 137 GFLOP a
  layer, 124/128 of it padding (arithmetic, not a measurement). An eager
  pass of at least :data:`SEPARATE_DECODES_MIN_TOKENS` prefill tokens and
  :data:`SEPARATE_DECODES_MIN_ROWS` decodes therefore launches its decode rows
  apart, at the decode shape (one more launch a layer, on a pass whose GPU time
  is far longer than its launches). ``separate_decodes = False`` turns it off
  (an A/B).

Every launch parameter is a function of the pass's shape, so a padded decode
batch has one fixed launch: the backend supports CUDA graphs.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .attn_base import LARGE_MIXED_DECODES, LARGE_MIXED_TOKENS, AttentionBackend, pow2_at_least
from .graph_runner import DEFAULT_CAPTURE_LIMIT, MIXED_QUERY_LEN, capture_sizes, padded_size
from .input_batch import StepBatch

if TYPE_CHECKING:
    from .triton_kernels import WorkList

DECODE_ROWS, PREFILL_ROWS, LONG_PREFILL_ROWS = 16, 64, 128  # query rows per program
LONG_QUERY_TOKENS = 512
DECODE_TILE, PREFILL_TILE = 32, 64  # keys per tile before (or without) tuning
# Launch candidates (keys per tile, warps, stages) the warm-up times per kind:
# decodes stream keys for 16 query rows (memory-bound), prefills multiply
# 64-128 query rows by each key tile (matrix-bound, more warps).
DECODE_CANDIDATES = ((32, 4, 3), (64, 4, 3), (128, 4, 3), (64, 2, 3))
PREFILL_CANDIDATES = ((64, 4, 3), (64, 8, 3), (128, 8, 3), (32, 8, 3))
TUNE_CONTEXT, TUNE_PREFILL_LEN, TUNE_SHORT_PREFILL_LEN = 1024, 2048, 256
MAX_SPLITS = 16
SPLIT_TARGET_WAVES = 4
BALANCE_MIN_KEYS = 512  # keys per run of a balanced split, at least
MAX_PARTS = 16  # runs of one context at most (longer runs past that)
BALANCE_SLACK = 1.5  # a context is split when longer than this many runs
BALANCE_ROWS_PER_EXTRA = 4  # the work list has room for one extra run per this many rows
SKEW_FACTOR = 4  # the tuning's skewed decode: one context this many times the others
SEPARATE_DECODES_MIN_TOKENS = LARGE_MIXED_TOKENS  # prefill tokens: decodes launch apart
SEPARATE_DECODES_MIN_ROWS = LARGE_MIXED_DECODES  # from this many decodes on
INTERPRETER_NUM_SMS = 4  # what the CPU interpreter pretends to have (exercises split-KV)
_SPLIT_GRID = capture_sizes(DEFAULT_CAPTURE_LIMIT)


@dataclass(slots=True)
class TritonMetadata:
    """Launch shape of one pass (host ints) and the query-block map (device).

    Attributes:
        q_block_seq, q_block_start: ``[num_q_blocks]`` int64 (see :func:`query_blocks`).
        block_q, tile_n, num_splits, num_warps, num_stages: see the module doc.
        work: the balanced splits of a decode pass (None: none).
        decode_blocks: a mixed pass's decode rows launched apart: their sequences
            and query starts (zeros), with ``decode_launch`` = ``(block_q, tile_n,
            num_warps, num_stages)`` (None: one launch for the pass).
    """

    q_block_seq: torch.Tensor
    q_block_start: torch.Tensor
    block_q: int
    tile_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 3
    work: WorkList | None = None
    decode_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
    decode_launch: tuple[int, int, int, int] = (1, DECODE_TILE, 4, 3)


class TritonBackend(AttentionBackend):
    """Paged attention and the KV store in Triton (see the module doc).

    Args:
        num_heads, num_kv_heads: the model's query and KV heads.
        device: CUDA, or CPU under Triton's interpreter.

    Raises:
        ValueError: if the kernels were imported for the wrong place (the
            interpreter on CUDA, or compiled kernels on CPU).
    """

    name = "triton"
    supports_cuda_graphs = True
    mixed_graph_max_tokens = (
        LONG_QUERY_TOKENS - 1
    )  # one query-block shape below it (MIXED_GRAPH_MAX_TOKENS)

    def __init__(self, num_heads: int, num_kv_heads: int, device: torch.device) -> None:
        from . import triton_kernels

        if triton_kernels.interpreted() != (device.type != "cuda"):
            raise ValueError(
                f"the Triton kernels were loaded {'for' if triton_kernels.interpreted() else 'without'}"
                f" Triton's interpreter but run on {device.type}; set TRITON_INTERPRET=1 only to "
                "run them on CPU, before they are first imported"
            )
        self.kernels = triton_kernels
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        # (block_q, num_splits) -> (tile_n, num_warps, num_stages), filled by tune()
        self.launch: dict[tuple[int, int], tuple[int, int, int]] = {}
        # the decode keys where tune() kept balanced splits
        self.balanced: set[tuple[int, int]] = set()
        # ms of one call of a launch; None: triton.testing.do_bench (tests time the
        # interpreter's launches with a script of their own)
        self.timer: Any = None
        self.balanced_splits = True  # False: tune() never keeps them (an A/B)
        self.separate_decodes = True  # False: a mixed pass is always one launch (an A/B)
        self.groups_p = pow2_at_least(num_heads // num_kv_heads)
        self.cuda = device.type == "cuda"
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if self.cuda
            else INTERPRETER_NUM_SMS
        )
        self.decode_split_programs = SPLIT_TARGET_WAVES * self.num_sms

    def block_q(self, max_query_len: int) -> int:
        """Queries per program: rows (16 decode, 64 prefill, 128 long prefill) / query
        heads per KV head."""
        if max_query_len == 1:
            rows = DECODE_ROWS
        else:
            rows = LONG_PREFILL_ROWS if max_query_len >= LONG_QUERY_TOKENS else PREFILL_ROWS
        return max(1, rows // self.groups_p)

    def num_splits(self, num_seqs: int, max_query_len: int) -> int:
        """Key-range splits: > 1 only for a decode batch too small to give every SM
        :data:`SPLIT_TARGET_WAVES` programs (sequences rounded up to the capture
        grid; see the module doc)."""
        if max_query_len != 1:
            return 1
        programs = (padded_size(num_seqs, _SPLIT_GRID) or num_seqs) * self.num_kv_heads
        return max(1, min(MAX_SPLITS, -(-SPLIT_TARGET_WAVES * self.num_sms // programs)))

    def host_fields(
        self, query_lens: np.ndarray, max_query_len: int, seq_lens: np.ndarray
    ) -> dict[str, np.ndarray]:
        block_q = self.block_q(max_query_len)
        if max_query_len > 1:
            return self._prefill_fields(query_lens, block_q)
        num_seqs = len(query_lens)  # a decode: one block per sequence, from its query
        fields = {"q_block_seq": np.arange(num_seqs, dtype=np.int64),
                  "q_block_start": np.zeros(num_seqs, np.int64)}  # fmt: skip
        key = (block_q, self.num_splits(num_seqs, 1))
        if key[1] == 1 and key in self.balanced:
            tile_n = self.launch.get(key, (DECODE_TILE,))[0]
            items, reduce = balanced_work(seq_lens, tile_n)
            fields["work_items"], fields["work_reduce"] = items.ravel(), reduce.ravel()
        return fields

    def _prefill_fields(self, query_lens: np.ndarray, block_q: int) -> dict[str, np.ndarray]:
        """The query blocks of a prefill or mixed pass (eager): with the rows of one
        query (decodes, or a one-token prompt chunk: the same attention) apart when
        the pass is large enough (see the module doc)."""
        decodes = np.flatnonzero(query_lens == 1)
        if not (
            self.separate_decodes
            and len(decodes) >= SEPARATE_DECODES_MIN_ROWS
            and int(query_lens.sum()) - len(decodes) >= SEPARATE_DECODES_MIN_TOKENS
        ):
            seq, start = query_blocks(query_lens, block_q)
            return {"q_block_seq": seq, "q_block_start": start}
        prefills = np.flatnonzero(query_lens > 1)
        seq, start = query_blocks(query_lens[prefills], block_q)
        return {
            "q_block_seq": prefills[seq],
            "q_block_start": start,
            "decode_block_seq": decodes,
            "decode_block_start": np.zeros(len(decodes), np.int64),
        }

    def graph_host_fields(
        self, query_lens: np.ndarray, num_tokens: int, num_seqs: int
    ) -> dict[str, np.ndarray]:
        """The query blocks of a padded mixed pass at the short-prefill shape,
        padded to ``ceil(num_tokens / block_q) + num_seqs`` (a bound on any pass
        of that many tokens and rows) with blocks of the last (padding) sequence
        that start past its queries and so compute nothing."""
        block_q = self.block_q(MIXED_QUERY_LEN)  # the static batch's: one launch shape
        seq, start = query_blocks(query_lens, block_q)
        capacity = -(-num_tokens // block_q) + num_seqs
        pad = capacity - len(seq)
        if pad < 0 or len(query_lens) > num_seqs:
            raise ValueError(f"{len(query_lens)} sequences in {num_tokens} tokens do not fit "
                             f"{num_seqs} rows")  # fmt: skip
        return {
            "q_block_seq": np.concatenate([seq, np.full(pad, len(query_lens) - 1, np.int64)]),
            "q_block_start": np.concatenate([start, np.full(pad, num_tokens, np.int64)]),
        }

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        block_q = self.block_q(batch.max_query_len)
        splits = self.num_splits(batch.num_seqs, batch.max_query_len)
        default = (DECODE_TILE if batch.max_query_len == 1 else PREFILL_TILE, 4, 3)
        tile_n, warps, stages = self.launch.get((block_q, splits), default)
        items = batch.extra.get("work_items")
        work = None
        if items is not None:
            work = self.kernels.WorkList(
                items.view(-1, 4), batch.extra["work_reduce"].view(-1, 3), MAX_PARTS
            )
        meta = TritonMetadata(
            q_block_seq=batch.extra["q_block_seq"],
            q_block_start=batch.extra["q_block_start"],
            block_q=block_q, tile_n=tile_n, num_splits=splits, num_warps=warps,
            num_stages=stages, work=work,
        )  # fmt: skip
        decodes = batch.extra.get("decode_block_seq")
        if decodes is not None:
            decode_q = self.block_q(1)
            launch = self.launch.get((decode_q, 1), (DECODE_TILE, 4, 3))
            meta.decode_blocks = (decodes, batch.extra["decode_block_start"])
            meta.decode_launch = (decode_q, *launch)
        return meta

    def tune(self, k_cache, v_cache, *, max_num_seqs, max_model_len, max_pass_tokens) -> float:
        if not self.cuda:
            return 0.0  # the interpreter has no speed to tune
        start = time.perf_counter()
        for num_seqs, query_len, context in tune_shapes(
            max_num_seqs, max_model_len, max_pass_tokens
        ):
            key = (self.block_q(query_len), self.num_splits(num_seqs, query_len))
            if key not in self.launch:
                self.launch[key] = self._fastest(k_cache, v_cache, num_seqs, query_len, context)
                if query_len == 1 and key[1] == 1:
                    self._choose_balanced(k_cache, v_cache, key, num_seqs, context, max_model_len)
        return time.perf_counter() - start

    def tune_facts(self) -> dict[str, Any]:
        return {"backend": self.name, "num_sms": self.num_sms,
                "balanced_splits": self.balanced_splits}  # fmt: skip

    def tuned_launches(self) -> dict[str, Any]:
        """``launch``: ``[block_q, num_splits, tile_n, num_warps, num_stages]`` per
        launch kind; ``balanced``: ``[block_q, num_splits]`` of the decode launches
        that kept balanced splits."""
        if not self.launch:
            return {}
        return {
            "launch": [[*key, *value] for key, value in sorted(self.launch.items())],
            "balanced": [list(key) for key in sorted(self.balanced)],
        }

    def adopt_launches(self, launches: Mapping[str, Any]) -> bool:
        launch = _int_rows(launches.get("launch"), 5)
        balanced = _int_rows(launches.get("balanced"), 2)
        if not launch or balanced is None:
            return False
        self.launch = {(r[0], r[1]): (r[2], r[3], r[4]) for r in launch}
        self.balanced = {(r[0], r[1]) for r in balanced}
        return True

    def _fastest(self, k_cache, v_cache, num_seqs: int, query_len: int, context: int):
        """The fastest candidate on ``num_seqs`` sequences of ``query_len`` new
        tokens over ``context`` tokens each, on consecutive pool blocks (wrapping)."""
        run = self._pass(k_cache, v_cache, query_len, np.full(num_seqs, context))
        timed = []
        for launch in DECODE_CANDIDATES if query_len == 1 else PREFILL_CANDIDATES:
            try:
                timed.append((run(launch, self.num_splits(num_seqs, query_len), False), launch))
            except Exception:  # noqa: BLE001 - a candidate that does not compile here is skipped
                continue
        default = (DECODE_TILE if query_len == 1 else PREFILL_TILE, 4, 3)
        return steady_pick(timed) or default

    def _choose_balanced(
        self, k_cache, v_cache, key: tuple[int, int], num_seqs: int, context: int,
        max_model_len: int,
    ) -> None:  # fmt: skip
        """Keep balanced splits for the decode launch ``key`` (unsplit by the SM
        rule) if they are faster over a uniform pass and a skewed one together
        (see the module doc)."""
        longest = min(max_model_len, SKEW_FACTOR * context)
        if num_seqs < 2 or longest <= max(context, BALANCE_MIN_KEYS) or not self.balanced_splits:
            return  # no context the balanced launch would cut
        launch = self.launch[key]
        skewed = np.full(num_seqs, context)
        skewed[0] = longest
        plain = balanced = 0.0
        for contexts in (np.full(num_seqs, context), skewed):
            run = self._pass(k_cache, v_cache, 1, contexts)
            try:
                plain += run(launch, 1, False)
                balanced += run(launch, 1, True)
            except Exception:  # noqa: BLE001 - the variant does not compile here: keep the plain one
                return
        if balanced < plain * (1 - TUNE_MARGIN):
            self.balanced.add(key)

    def _pass(self, k_cache, v_cache, query_len: int, contexts: np.ndarray):
        """A timer of one attention pass of ``len(contexts)`` sequences of
        ``query_len`` new tokens over these contexts, on consecutive pool blocks
        (wrapping): ``run((tile_n, warps, stages), num_splits, balanced)`` -> ms
        (``triton.testing.do_bench``)."""
        device, block_size = k_cache.device, k_cache.shape[1]
        num_seqs = len(contexts)
        per_seq = -(-contexts // block_size)
        width = int(per_seq.max())
        starts = np.concatenate(([0], np.cumsum(per_seq)[:-1]))
        tables = (starts[:, None] + np.arange(width)[None, :]) % k_cache.shape[0]
        block_q = self.block_q(query_len)
        seq, first = query_blocks(np.full(num_seqs, query_len, np.int64), block_q)
        q = torch.randn((num_seqs * query_len, self.num_heads, k_cache.shape[3]),
                        device=device, dtype=k_cache.dtype)  # fmt: skip
        out = torch.empty_like(q)
        fixed = dict(
            block_tables=torch.from_numpy(tables).to(device),
            seq_lens=torch.from_numpy(np.asarray(contexts, np.int64)).to(device),
            query_start_loc=torch.arange(0, (num_seqs + 1) * query_len, query_len, device=device),
            q_block_seq=torch.from_numpy(seq).to(device),
            q_block_start=torch.from_numpy(first).to(device), num_q_blocks=len(seq),
            block_q=block_q, scale=1 / math.sqrt(k_cache.shape[3]),
        )  # fmt: skip

        def run(launch: tuple[int, int, int], num_splits: int, balanced: bool) -> float:
            tile_n, warps, stages = launch
            work = None
            if balanced:
                items, reduce = balanced_work(np.asarray(contexts, np.int64), tile_n)
                work = self.kernels.WorkList(torch.from_numpy(items).to(device),
                                             torch.from_numpy(reduce).to(device), MAX_PARTS)  # fmt: skip
            return self._time(
                lambda: self.kernels.paged_attention(
                    out, q, k_cache, v_cache, tile_n=tile_n, num_warps=warps, num_stages=stages,
                    num_splits=num_splits, work=work, **fixed,
                )
            )  # fmt: skip

        return run

    def _time(self, launch: Any) -> float:
        """ms of one ``launch()``: :attr:`timer`, else ``triton.testing.do_bench``."""
        if self.timer is not None:
            return float(self.timer(launch))
        import triton.testing

        return float(triton.testing.do_bench(launch, warmup=2, rep=10))

    def write_kv(self, k, v, k_cache, v_cache, batch: StepBatch) -> None:
        self.kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)

    def forward(self, q, k, v, k_cache, v_cache, meta: Any, batch: StepBatch, scale: float):
        out = torch.empty_like(q)
        paged = functools.partial(
            self.kernels.paged_attention, out, q, k_cache, v_cache,
            block_tables=batch.block_tables, seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc, scale=scale,
        )  # fmt: skip
        paged(
            q_block_seq=meta.q_block_seq, q_block_start=meta.q_block_start,
            num_q_blocks=meta.q_block_seq.shape[0], block_q=meta.block_q, tile_n=meta.tile_n,
            num_splits=meta.num_splits, num_warps=meta.num_warps, num_stages=meta.num_stages,
            work=meta.work,
        )  # fmt: skip
        if meta.decode_blocks is not None:  # a mixed pass's decodes, at the decode shape
            seqs, starts = meta.decode_blocks
            block_q, tile_n, warps, stages = meta.decode_launch
            paged(
                q_block_seq=seqs, q_block_start=starts, num_q_blocks=seqs.shape[0],
                block_q=block_q, tile_n=tile_n, num_splits=1, num_warps=warps,
                num_stages=stages,
            )  # fmt: skip
        return out


TUNE_MARGIN = 0.03
"""A launch candidate counts as fastest within this share of the fastest time:
decode kernels take ~10 us, and their timings differ by more than a few percent
from run to run, so a bare minimum flipped the choice between runs."""


def steady_pick(timed: list[tuple[float, tuple[int, int, int]]]) -> tuple[int, int, int] | None:
    """The launch to keep from ``(time_ms, (tile_n, warps, stages))`` pairs in
    candidate order: the first one within :data:`TUNE_MARGIN` of the fastest,
    so timing noise smaller than the margin never changes the choice; None when
    no candidate ran."""
    if not timed:
        return None
    bar = min(t for t, _ in timed) * (1 + TUNE_MARGIN)
    return next(launch for t, launch in timed if t <= bar)


def _int_rows(value: Any, width: int) -> list[tuple[int, ...]] | None:
    """``value`` as rows of ``width`` positive ints, or None if it is not one."""
    if not isinstance(value, list):
        return None
    rows = []
    for row in value:
        if not (isinstance(row, list) and len(row) == width):
            return None
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in row):
            return None
        rows.append(tuple(row))
    return rows


def balanced_work(seq_lens: np.ndarray, tile_n: int) -> tuple[np.ndarray, np.ndarray]:
    """The work list of a decode pass's balanced splits (see the module doc).

    With ``run = max(mean tiles, BALANCE_MIN_KEYS / tile_n, longest /
    MAX_PARTS)``, each context of more than :data:`BALANCE_SLACK` runs is cut
    into ``ceil(tiles / run)`` equal runs; the others stay whole (splitting a
    context a little over the mean costs a partial and a reduce for a short
    tail). A split context adds fewer than ``tiles / run`` runs beyond its
    first; if they come to more than :func:`extra_room` (a quarter of the rows),
    the run grows to ``total tiles / room``, which brings them within it. So the
    list has a fixed length for a given number of rows whatever the contexts,
    and a padded batch keeps one launch shape.

    Args:
        seq_lens: ``[num_seqs]`` context tokens per sequence (0: padding).
        tile_n: keys per tile of the launch.

    Returns:
        ``items`` ``[num_seqs + extra_room(num_seqs), 4]`` int64 (query block =
        sequence, first tile, end tile, partial row; -1: whole context, -2:
        padding), the split contexts' runs first, then the whole ones, then
        padding (without a split: :func:`_unsplit_items`'s order); ``reduce``
        ``[extra_room(num_seqs), 3]`` int64 (token, first partial row, rows) per
        split sequence, then zeros.
    """
    n = len(seq_lens)
    room = extra_room(n)
    tiles = (seq_lens + (tile_n - 1)) // tile_n
    reduce = np.zeros((room, 3), np.int64)
    if n == 0:
        return np.zeros((0, 4), np.int64), reduce
    total, longest = int(tiles.sum()), int(tiles.max())
    run = max(-(-total // n), -(-BALANCE_MIN_KEYS // tile_n), -(-longest // MAX_PARTS), 1)
    split = parts = np.zeros(0, np.int64)
    if longest > BALANCE_SLACK * run:
        split = np.flatnonzero(tiles > BALANCE_SLACK * run)
        parts = (tiles[split] + (run - 1)) // run
        if int(parts.sum()) - len(split) > room:  # longer runs: fewer extra ones
            run = max(run, -(-total // room))
            split = np.flatnonzero(tiles > BALANCE_SLACK * run)
            parts = (tiles[split] + (run - 1)) // run
    if not len(split):
        template, rows = _unsplit_items(n)
        items = template.copy()
        items[rows, 2] = tiles
        return items, reduce
    items = np.zeros((n + room, 4), np.int64)
    items[:, 3] = -2
    whole = np.flatnonzero(tiles <= BALANCE_SLACK * run)
    piece = np.repeat((tiles[split] + parts - 1) // parts, parts)  # equal runs per context
    first = np.cumsum(parts) - parts
    k = int(first[-1] + parts[-1])
    within = np.arange(k)
    lo = (within - np.repeat(first, parts)) * piece
    items[:k, 0], items[:k, 1], items[:k, 2], items[:k, 3] = (
        np.repeat(split, parts),
        lo,
        lo + piece,
        within,
    )
    rest = slice(k, k + len(whole))
    items[rest, 0], items[rest, 2], items[rest, 3] = whole, tiles[whole], -1
    reduce[: len(split), 0], reduce[: len(split), 1], reduce[: len(split), 2] = split, first, parts
    return items, reduce


def extra_room(num_seqs: int) -> int:
    """Runs a decode batch's work list holds beyond one per row (and split
    sequences its reduce holds): a quarter of the rows, rounded up."""
    return -(-num_seqs // BALANCE_ROWS_PER_EXTRA)


@functools.lru_cache(maxsize=64)
def _unsplit_items(num_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """The work list of ``num_seqs`` rows none of which is split (end tiles 0)
    and the rows' positions in it: a padding item (-2) before every group of
    :data:`BALANCE_ROWS_PER_EXTRA` rows (-1), so any prefix of ``b +
    extra_room(b)`` items is the list of the first ``b`` rows (the graph runner
    slices its all-padding static list per capture size). Read-only."""
    size = num_seqs + extra_room(num_seqs)
    position = np.arange(size)
    group, offset = np.divmod(position, BALANCE_ROWS_PER_EXTRA + 1)
    items = np.zeros((size, 4), np.int64)
    rows = offset > 0
    items[rows, 0] = group[rows] * BALANCE_ROWS_PER_EXTRA + offset[rows] - 1
    items[:, 3] = np.where(rows, -1, -2)
    positions = np.flatnonzero(rows)
    items.flags.writeable = positions.flags.writeable = False
    return items, positions


def query_blocks(query_lens: np.ndarray, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut each sequence's queries into blocks of ``block_q``.

    Returns:
        per block, its sequence and the index of its first query in that
        sequence (int64 arrays of ``sum(ceil(query_lens / block_q))``).
    """
    counts = -(-query_lens // block_q)
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int64), counts)
    first_block = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(len(seq), dtype=np.int64) - first_block) * block_q
    return seq, start


def tune_shapes(
    max_num_seqs: int, max_model_len: int, max_pass_tokens: int
) -> list[tuple[int, int, int]]:
    """Passes :meth:`TritonBackend.tune` times, as ``(num_seqs, query_len,
    context)``: a decode at every capture size (each split count's largest is
    the one kept), at :data:`TUNE_CONTEXT` tokens of context (or
    ``max_model_len``); prompts of :data:`TUNE_PREFILL_LEN` and
    :data:`TUNE_SHORT_PREFILL_LEN` tokens filling one pass of
    ``max_pass_tokens`` (at most 8,192; 0 = no limit)."""
    context = max(1, min(TUNE_CONTEXT, max_model_len))
    sizes = capture_sizes(max_num_seqs)
    shapes = [(n, 1, context) for n in reversed(sizes)]  # largest of each split class first
    pass_tokens = min(max_pass_tokens or 8192, 8192)
    for length in (TUNE_PREFILL_LEN, TUNE_SHORT_PREFILL_LEN):
        length = min(length, max_model_len, pass_tokens)
        if length > 1:
            shapes.append((max(1, pass_tokens // length), length, length))
    return shapes
