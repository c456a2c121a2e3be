"""``rose-run profile``: time the executor's real steps over a grid of batch shapes.

The grid spans what a workload can make the scheduler produce under the given
limits (``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len`` and the
KV pool): single prefill chunks of 2 ... ``max_num_batched_tokens`` tokens
(geometric) on cached contexts of 0 ... ``max_model_len``; batches of several
prompts; decode batches of 1 ... ``max_num_seqs`` (geometric) times context
lengths (geometric), with equal and with spread contexts; and mixed steps (a
prefill chunk beside decodes). The shape of the grid follows Vidur's profiling
(token counts geometric then linear, decode batch x KV length; Agrawal et al.,
MLSys 2024).

Each step is timed as the engine pays for it: building the runner inputs from
token lists, ``ModelRunner.forward`` (which prepares the batch tensors), greedy
sampling and a device synchronize. The scheduler's own bookkeeping per step
(planning, applying results, records) is measured separately, without a model
(:func:`measure_host_overhead`), and added per step as a function of its
sequences and tokens. The grid is warmed up first (the largest shapes, then
one untimed pass over every shape); the timed repetitions visit the shapes in
a fresh random order each, so a burst of load from other processes lands on
different shapes, and each shape keeps the median.

The fit and the file format are in :mod:`roseinfer.calibration` (``profile.py``, ``step_model.py``, ``roofline_fit.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from roseinfer.calibration import OverheadSample, Profile, ProfileSample
from roseinfer.calibration.cost_model import BatchShape
from roseinfer.calibration.specs import ModelSpec
from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepResult, VirtualClock, drive
from roseinfer.executor.engine import synchronize
from roseinfer.executor.facts import (
    builtin_device_spec,
    environment_facts,
    executor_facts,
    model_spec_of,
)
from roseinfer.executor.model_runner import ModelRunner, SeqInput
from roseinfer.executor.warmup import scratch_inputs, warm_up
from roseinfer.records import RecordBuilder
from roseinfer.registry import load_registry
from roseinfer.request import Request
from roseinfer.scheduler import Scheduler, SchedulerOutput, StepTotals

DEFAULT_REPETITIONS = 3
MIN_PREFILL_TOKENS = 2  # a 1-token chunk runs as a decode in the runner
MULTI_PREFILL_TOKENS = (16, 64, 256)  # prompt lengths of multi-prompt prefill steps
MIXED_DECODES = (4, 16, 64)  # decode batch sizes beside a prefill chunk
# Default per-step token limit of the grid: vLLM's max_num_batched_tokens for
# chunked prefill (or the model's context if longer).
DEFAULT_PROFILE_TOKENS = 2048
RETRY_SPREAD = 1.3  # repetitions further apart than this are timed again


@dataclass(frozen=True, slots=True)
class GridLimits:
    """What the profiled scheduler can put in one step.

    Attributes:
        max_num_batched_tokens: most tokens one step computes.
        max_num_seqs: most sequences in one step (the decode batch).
        max_model_len: longest context of one sequence.
        kv_capacity_tokens: tokens the KV pool holds (steps fit in it).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    kv_capacity_tokens: int


def _geometric(low: int, high: int, factor: float = 2.0) -> list[int]:
    """``low, low * factor, ...`` up to ``high``, and ``high`` itself (sorted, unique)."""
    values, x = set(), float(low)
    while x < high:
        values.add(int(round(x)))
        x *= factor
    values.add(high)
    return sorted(v for v in values if low <= v <= high)


def _prefill_shapes(limits: GridLimits) -> list[tuple[str, list[tuple[int, int]]]]:
    """Single prefill chunks: new tokens x cached context (0, half, all the room left)."""
    top = min(limits.max_num_batched_tokens, limits.max_model_len, limits.kv_capacity_tokens)
    shapes = []
    for new in _geometric(MIN_PREFILL_TOKENS, top):
        room = min(limits.max_model_len, limits.kv_capacity_tokens) - new
        for cached in sorted({0, room // 2, room}):
            shapes.append(("prefill", [(new, new + cached)]))
    return shapes


def _multi_prefill_shapes(
    limits: GridLimits, rng: np.random.Generator
) -> list[tuple[str, list[tuple[int, int]]]]:
    """Several prompts in one step (lengths spread +-50% around a mean)."""
    budget = min(limits.max_num_batched_tokens, limits.kv_capacity_tokens)
    shapes = []
    for mean in MULTI_PREFILL_TOKENS:
        mean = min(mean, limits.max_model_len)
        for count in _geometric(2, max(2, min(limits.max_num_seqs, budget // mean)), 4.0):
            lengths = rng.integers(max(1, mean // 2), mean + mean // 2 + 1, count)
            lengths = np.minimum(lengths, limits.max_model_len)
            if count <= limits.max_num_seqs and lengths.sum() <= budget:
                shapes.append(("prefill", [(int(n), int(n)) for n in lengths]))
    return shapes


def _decode_shapes(
    limits: GridLimits, rng: np.random.Generator
) -> list[tuple[str, list[tuple[int, int]]]]:
    """Decode batches x contexts: all equal, and spread uniformly over [1, 2 x context]."""
    max_ctx = min(limits.max_model_len, limits.kv_capacity_tokens)
    shapes = []
    for batch in _geometric(1, min(limits.max_num_seqs, limits.max_num_batched_tokens), 2.0):
        for context in _geometric(16, max_ctx, 4.0):
            if batch * context > limits.kv_capacity_tokens:
                continue
            shapes.append(("decode", [(1, context)] * batch))
            if batch > 1:
                spread = np.minimum(rng.integers(1, 2 * context + 1, batch), max_ctx)
                if spread.sum() <= limits.kv_capacity_tokens:
                    shapes.append(("decode", [(1, int(c)) for c in spread]))
    return shapes


def _mixed_shapes(limits: GridLimits) -> list[tuple[str, list[tuple[int, int]]]]:
    """One prefill chunk beside a decode batch (chunked prefill's mixed steps)."""
    max_ctx = min(limits.max_model_len, limits.kv_capacity_tokens)
    shapes = []
    for num_decodes in MIXED_DECODES:
        if num_decodes >= min(limits.max_num_seqs, limits.max_num_batched_tokens):
            continue
        for context in sorted({min(64, max_ctx), max_ctx // 2}):
            chunk_top = min(limits.max_num_batched_tokens - num_decodes, max_ctx)
            for chunk in sorted({min(64, chunk_top), chunk_top}):
                used = num_decodes * context + chunk
                if chunk >= MIN_PREFILL_TOKENS and used <= limits.kv_capacity_tokens:
                    decodes = [(1, context)] * num_decodes
                    shapes.append(("mixed", [(chunk, chunk), *decodes]))
    return shapes


def profile_grid(limits: GridLimits, seed: int = 0) -> list[tuple[str, list[tuple[int, int]]]]:
    """Every step shape to time: ``(kind, [(num_new_tokens, context_tokens), ...])``.

    Decodes are ``(1, context)``; a prefill chunk's context includes its new
    tokens. Every shape fits ``limits`` (tokens, sequences, context, KV pool).
    """
    rng = np.random.default_rng(seed)
    return [
        *_prefill_shapes(limits),
        *_multi_prefill_shapes(limits, rng),
        *_decode_shapes(limits, rng),
        *_mixed_shapes(limits),
    ]


def batch_shape_of(seqs: Sequence[tuple[int, int]]) -> BatchShape:
    """The cost model's view of a grid step (decodes are the 1-token entries)."""
    prefills = [(n, c) for n, c in seqs if n > 1]
    decodes = [c for n, c in seqs if n == 1]
    return BatchShape(
        np.array([n for n, _ in prefills], dtype=np.int64),
        np.array([c for _, c in prefills], dtype=np.int64),
        np.array(decodes, dtype=np.int64),
    )


# ------------------------------------------------------------------ timing


@dataclass(slots=True)
class _Point:
    """One grid step ready to run: its shape and per-sequence token lists."""

    kind: str
    seqs: list[tuple[int, int]]
    tokens: list[list[int]]  # each sequence's whole token list (context)
    tables: list[list[int]]
    times_s: list[float]


def _make_point(kind: str, seqs: list[tuple[int, int]], runner: ModelRunner, offset: int) -> _Point:
    inputs = scratch_inputs(
        [(c, c) for _, c in seqs], runner.block_size, runner.num_kv_blocks, runner.vocab_size,
        first_block=offset, seed=offset,
    )  # fmt: skip
    tokens = [list(s.token_ids) for s in inputs]
    return _Point(kind, seqs, tokens, [list(s.block_table) for s in inputs], [])


def time_step(runner: ModelRunner, point: _Point) -> float:
    """Seconds of one step as the engine pays it: inputs, forward, sampling, sync."""
    start = time.perf_counter()
    inputs = [
        SeqInput(tokens[context - new : context], context - new, table)
        for (new, context), tokens, table in zip(point.seqs, point.tokens, point.tables)
    ]
    logits = runner.forward(inputs)
    logits.argmax(dim=-1).tolist()
    synchronize(runner.device)
    return time.perf_counter() - start


def time_grid(
    runner: ModelRunner,
    shapes: Sequence[tuple[str, list[tuple[int, int]]]],
    repetitions: int = DEFAULT_REPETITIONS,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[str, list[tuple[int, int]], list[float]]]:
    """Time every shape ``repetitions`` times after one untimed pass.

    Each pass visits the shapes in a new random order (seeded). A shape whose
    repetitions disagree (slowest > :data:`RETRY_SPREAD` x fastest: another job
    took the CPU) is timed up to ``repetitions`` more times, so its median
    rests on clean runs. Sequences of a shape sit on consecutive pool blocks
    starting at a rotating offset.

    Args:
        progress: called with 1 after every timed or untimed step.

    Returns:
        ``(kind, seqs, times_s)`` per shape, in the order of ``shapes``.
    """
    rng = np.random.default_rng(seed)
    points, offset = [], 0
    for kind, seqs in shapes:
        points.append(_make_point(kind, seqs, runner, offset))
        offset = (offset + sum(-(-c // runner.block_size) for _, c in seqs)) % runner.num_kv_blocks
    _timed_passes(runner, points, repetitions + 1, rng, progress, keep_first=False)
    unsteady = [p for p in points if max(p.times_s) > RETRY_SPREAD * min(p.times_s)]
    if unsteady:
        _timed_passes(runner, unsteady, repetitions, rng, progress, keep_first=True)
    return [(p.kind, p.seqs, p.times_s) for p in points]


def _timed_passes(
    runner: ModelRunner,
    points: list[_Point],
    num_passes: int,
    rng: np.random.Generator,
    progress: Callable[[int], None] | None,
    *,
    keep_first: bool,
) -> None:
    """Time every point once per pass, in a new random order each pass."""
    for rep in range(num_passes):
        for idx in rng.permutation(len(points)):
            elapsed = time_step(runner, points[idx])
            if keep_first or rep > 0:  # pass 0 of the grid warms every shape up
                points[idx].times_s.append(elapsed)
            if progress is not None:
                progress(1)


# ------------------------------------------------------------- host overhead


class _ProbeBackend:
    """Prices every step at ``step_s`` and records the wall clock at each step.

    Driven by the shared drive loop one step at a time (no multi-step decode
    runs), so the wall time between two calls is one step of host work:
    releasing arrivals, planning, applying the result, ending requests.
    """

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.calls: list[tuple[float, StepTotals]] = []

    def decode_run_length(
        self, out: SchedulerOutput, now_s: float, next_arrival_s: float, max_steps: int
    ) -> int:
        return 1

    def execute(self, out: SchedulerOutput, now_s: float) -> StepResult:
        self.calls.append((time.perf_counter(), out.totals()))
        return StepResult([now_s + self.step_s])


def _probe_run(requests: list[Request], config: SchedulerConfig) -> _ProbeBackend:
    """Replay ``requests`` through the shared scheduler with a probe backend
    (what the executor's loop does besides the model), keeping records."""
    policy = load_registry().make(config.policy, config.loop_order, config.options)
    scheduler = Scheduler(config, policy, policy.label)
    records = RecordBuilder()
    probe = _ProbeBackend(1e-3)
    drive(
        scheduler, requests, probe, VirtualClock(), lambda s: records.extend(s, scheduler.step_log)
    )
    return probe


@dataclass(frozen=True, slots=True)
class HostOverhead:
    """Scheduler bookkeeping per step: ``per_step_s + per_seq_s * seqs + per_token_s * tokens``.

    Attributes:
        per_step_s, per_seq_s, per_token_s: fitted seconds (>= 0).
        num_steps: steps of the synthetic run (each timed ``repetitions`` times).
    """

    per_step_s: float
    per_seq_s: float
    per_token_s: float
    num_steps: int

    def seconds(self, shape: BatchShape) -> float:
        """Bookkeeping seconds of one step of this shape."""
        return (
            self.per_step_s + self.per_seq_s * shape.num_seqs + self.per_token_s * shape.num_tokens
        )


def _host_workload(
    max_num_seqs: int, max_model_len: int, vocab_size: int, seed: int
) -> list[Request]:
    """A burst of ``2 * max_num_seqs`` requests (prompts 16-256 tokens, outputs
    1-64): the running set fills to ``max_num_seqs`` and drains, so steps of
    every batch size appear."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(2 * max_num_seqs):
        prompt = min(int(rng.integers(16, 257)), max(1, max_model_len - 64))
        output = min(int(rng.integers(1, 65)), max_model_len - prompt)
        ids = tuple(int(t) for t in rng.integers(0, vocab_size, prompt))
        reqs.append(Request(f"host-{i}", 0.0, prompt, max(1, output), prompt_token_ids=ids))
    return reqs


def measure_host_overhead(
    config: SchedulerConfig, vocab_size: int, seed: int = 0, repetitions: int = 3
) -> HostOverhead:
    """Time the shared scheduler's per-step work on a synthetic burst, without a model.

    The simulation is deterministic, so its k-th step is the same in every
    repetition: each step keeps its median gap over the repetitions (a step
    preempted by another job in one of them does not count), and the medians
    are fitted by non-negative least squares on relative error.
    """
    from scipy.optimize import nnls

    num_blocks = max(config.num_kv_blocks, 2 * config.max_num_seqs * -(-320 // config.block_size))
    probe_config = dataclasses.replace(config, num_kv_blocks=num_blocks)
    reqs = _host_workload(config.max_num_seqs, config.max_model_len, vocab_size, seed)
    runs = []
    for _ in range(repetitions):
        probe = _probe_run(reqs, probe_config)
        runs.append(np.diff([t for t, _ in probe.calls]))
    gaps = np.median(np.vstack(runs), axis=0)
    shapes = [shape for _, shape in probe.calls[:-1]]
    design = np.array([[1.0, s.num_seqs, s.num_tokens] for s in shapes])
    scale = design.max(axis=0)
    coef, _ = nnls(design / scale / gaps[:, None], np.ones(len(gaps)))
    coef = coef / scale
    return HostOverhead(float(coef[0]), float(coef[1]), float(coef[2]), len(gaps))


# --------------------------------------------------------- dispatch overhead

SKELETON_WIDTH = 64  # hidden size of the skeleton models (heads of 16 channels)
SKELETON_VOCAB = 512


def skeleton_config(hf_config, num_layers: int):  # type: ignore[no-untyped-def]
    """The same architecture with ``num_layers`` layers and tiny widths: its steps
    cost the dispatch, preparation and sampling of a real step, almost no FLOPs."""
    d = hf_config.to_dict()
    if d.get("model_type") == "gpt2":
        d.update(n_layer=num_layers, n_embd=SKELETON_WIDTH, n_head=4, n_inner=None)
    else:
        heads, kv_heads = d["num_attention_heads"], d.get("num_key_value_heads") or 0
        kv = max(1, 4 * (kv_heads or heads) // heads)
        d.update(num_hidden_layers=num_layers, hidden_size=SKELETON_WIDTH, head_dim=16,
                 num_attention_heads=4, num_key_value_heads=kv, intermediate_size=128)  # fmt: skip
        if isinstance(d.get("layer_types"), list):
            d["layer_types"] = d["layer_types"][:1] * num_layers
    d.update(vocab_size=SKELETON_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return type(hf_config).from_dict(d)


def _skeleton_shapes(limits: GridLimits) -> list[tuple[str, list[tuple[int, int]]]]:
    """Decodes of 1/8/64 sequences and prefills of 1 and 4 prompts, 32-token contexts."""
    ctx = min(32, limits.max_model_len)
    shapes = [
        ("decode", [(1, ctx)] * b)
        for b in sorted({1, min(8, limits.max_num_seqs), min(64, limits.max_num_seqs)})
    ]
    for count in sorted({1, min(4, limits.max_num_seqs)}):
        if count * ctx <= limits.max_num_batched_tokens and ctx > 1:
            shapes.append(("prefill", [(ctx, ctx)] * count))
    return shapes


def _family_configs(hf_config) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The profiled model's config for its family, a built-in one for the other."""
    from roseinfer.executor.models import builtin_config

    own = "gpt2" if hf_config.model_type == "gpt2" else "llama"
    other = {"gpt2": ("llama", "tiny-llama"), "llama": ("gpt2", "tiny-gpt2")}[own]
    return {own: hf_config, other[0]: builtin_config(other[1])}


def measure_dispatch_overhead(
    runner: ModelRunner,
    hf_config,  # type: ignore[no-untyped-def]
    limits: GridLimits,
    repetitions: int = DEFAULT_REPETITIONS,
    seed: int = 0,
) -> list[OverheadSample]:
    """Time skeleton models of both architecture families (GPT-2, Llama) at 1 layer
    and at the profiled layer count, on a few shapes.

    The real model's step is its FLOPs and bytes plus this overhead; two depths
    separate a per-layer from a per-step cost, and both families let the
    calibrated roofline price a model of another depth or architecture.
    """
    from transformers import AutoModelForCausalLM

    num_layers = runner.shape.num_layers
    shapes = _skeleton_shapes(limits)
    blocks = sum(-(-c // runner.block_size) for _, seqs in shapes for _, c in seqs)
    samples = []
    for family, config in _family_configs(hf_config).items():
        for layers in sorted({1, num_layers}):
            with torch.random.fork_rng(devices=[]), torch.device(runner.device):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(
                    skeleton_config(config, layers), dtype=runner.dtype
                )
            skeleton = ModelRunner(
                model, num_kv_blocks=blocks, block_size=runner.block_size, device=runner.device,
                dtype=runner.dtype, attention_backend=runner.attention_backend,
            )  # fmt: skip
            for kind, seqs, times in time_grid(skeleton, shapes, repetitions, seed):
                sample = ProfileSample(kind, batch_shape_of(seqs), tuple(times))
                samples.append(OverheadSample(family, layers, sample))
    return samples


# ------------------------------------------------------------------ profile


def _advance(bar, n: int) -> None:  # type: ignore[no-untyped-def]
    """Advance a tqdm bar, growing its total when unsteady shapes are timed again."""
    if bar.total is not None and bar.n + n > bar.total:
        bar.total = bar.n + n
    bar.update(n)


def run_profile(
    runner: ModelRunner,
    config: SchedulerConfig,
    *,
    model_name: str,
    model_spec: ModelSpec,
    hf_config,  # type: ignore[no-untyped-def]
    max_num_batched_tokens: int,
    repetitions: int = DEFAULT_REPETITIONS,
    seed: int = 0,
    show_progress: bool = True,
    kv_cache_budget_bytes: int | None = None,
) -> Profile:
    """Warm up, time the grid, measure the host overhead, fit: a :class:`Profile`.

    Args:
        runner: the model runner (its KV pool is the one profiled).
        config: the scheduler limits the profile describes (pool, block size,
            ``max_num_seqs``, ``max_model_len``).
        model_name: what ``--model`` said; model_spec: its shape at the run dtype;
            hf_config: its transformers config (for the skeletons).
        max_num_batched_tokens: most tokens one profiled step computes.
        repetitions: timed runs per shape (the median is kept).
        seed: grid, visiting order and held-out split.
        show_progress: draw a progress bar on stderr.
        kv_cache_budget_bytes: memory the pool was sized from before any cap
            (default: the pool's bytes).
    """
    start, load_before = time.perf_counter(), environment_facts(runner.device)["load_average"]
    limits = GridLimits(
        max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
        config.num_kv_blocks * config.block_size,
    )  # fmt: skip
    warmup = warm_up(
        runner,
        dataclasses.replace(
            config, max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True
        ),
    )
    host = measure_host_overhead(config, runner.vocab_size, seed)
    dispatch = [
        OverheadSample(o.family, o.num_layers, _with_host(o.sample, host))
        for o in measure_dispatch_overhead(runner, hf_config, limits, repetitions, seed)
    ]
    samples = _timed_samples(runner, limits, repetitions, seed, show_progress)
    extra = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile_wall_s": time.perf_counter() - start,
        "grid": {"repetitions": repetitions, "seed": seed, "num_samples": len(samples)},
        "host": dataclasses.asdict(host),
        "warmup": [dataclasses.asdict(w) for w in warmup],
    }
    executor = executor_facts(runner, config, max_num_batched_tokens, kv_cache_budget_bytes)
    return Profile.create(
        model_name=model_name, model_spec=model_spec, executor=executor,
        environment={**environment_facts(runner.device), "load_average_before": load_before},
        samples=[_with_host(s, host) for s in samples], overhead_samples=dispatch,
        base_device=builtin_device_spec(runner.device), seed=seed, extra=extra,
    )  # fmt: skip


def _with_host(sample: ProfileSample, host: HostOverhead) -> ProfileSample:
    return dataclasses.replace(sample, host_s=host.seconds(sample.shape))


def _timed_samples(
    runner: ModelRunner, limits: GridLimits, repetitions: int, seed: int, show_progress: bool
) -> list[ProfileSample]:
    """Time the grid of ``limits`` with a progress bar."""
    from tqdm import tqdm

    shapes = profile_grid(limits, seed)
    total = len(shapes) * (repetitions + 1)  # grows if unsteady shapes are timed again
    with tqdm(
        total=total, desc="profile", unit="step", disable=not show_progress, file=sys.stderr
    ) as bar:
        timed = time_grid(runner, shapes, repetitions, seed, lambda n: _advance(bar, n))
    return [ProfileSample(kind, batch_shape_of(seqs), tuple(t)) for kind, seqs, t in timed]


# ---------------------------------------------------------------------- CLI


def build_profile_parser() -> argparse.ArgumentParser:
    """The ``rose-run profile`` argument parser."""
    from roseinfer.cli import POSITIVE, ArgumentParser, add_flag, add_quiet_args
    from roseinfer.config import DEFAULT_MAX_NUM_SEQS
    from roseinfer.executor.cli import add_model_args

    parser = ArgumentParser(
        prog="rose-run profile",
        description="Time the executor's real steps over a grid of batch shapes and fit a "
        "cost model for `rose-sim --cost-model PROFILE.json`.",
    )
    parser.add_argument("--output", type=Path, required=True, help="PROFILE.json to write")
    g = parser.add_argument_group("executor (as rose-run)")
    add_model_args(g, warmup=False)
    add_flag(g, "--seed")
    g.add_argument("--repetitions", type=POSITIVE, default=DEFAULT_REPETITIONS,
                   help=f"timed runs per shape; the median is kept (default {DEFAULT_REPETITIONS})")  # fmt: skip
    g = parser.add_argument_group("limits (as rose-run; they set the grid and the KV pool)")
    add_flag(
        g,
        "--max-num-batched-tokens",
        help="most tokens per step (default: max(--max-model-len, 2048))",
    )
    add_flag(g, "--max-num-seqs", default=DEFAULT_MAX_NUM_SEQS)
    add_flag(g, "--max-model-len")
    for flag in ("--block-size", "--num-kv-blocks", "--kv-cache-memory-gb"):
        add_flag(g, flag)
    add_quiet_args(parser, summary=False)
    return parser


def profile_main(argv: Sequence[str]) -> int:
    """Entry point of ``rose-run profile`` (flags after ``profile``)."""
    from roseinfer.cli import friendly_errors

    args = build_profile_parser().parse_args(list(argv))
    with friendly_errors("rose-run profile"):
        profile = _profile_from_args(args)
        profile.save(args.output)
        print(summary_lines(profile, args.output))
    return 0


def _profile_from_args(args: argparse.Namespace) -> Profile:
    from roseinfer.cli import CliError
    from roseinfer.executor import cli
    from roseinfer.executor.models import build_model

    if args.repetitions < 1:
        raise CliError(f"--repetitions must be >= 1, got {args.repetitions}")
    device = cli.resolve_device(args.device)
    cli.set_num_threads(args.num_threads)
    dtype = cli.DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model, hf_config, _ = build_model(args.model, seed=args.seed, dtype=dtype, device=device)
    max_model_len = cli._max_model_len(args, model)
    max_seqs_blocks = args.max_num_seqs * -(-max_model_len // args.block_size)
    kv_bytes = cli._kv_bytes_per_token(hf_config, dtype)
    num_blocks = args.num_kv_blocks or cli.default_num_kv_blocks(
        args, kv_bytes, device, max_seqs_blocks
    )
    # The memory the pool is sized from before rose-run's cap, so that rose-sim can
    # size another model's pool the same way.
    budget_blocks = args.num_kv_blocks or cli.default_num_kv_blocks(args, kv_bytes, device)
    kv_budget_bytes = budget_blocks * kv_bytes * args.block_size
    try:
        config = SchedulerConfig(
            num_kv_blocks=num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
        )  # fmt: skip
    except ValueError as err:
        raise CliError(str(err)) from None
    batched = args.max_num_batched_tokens or max(max_model_len, DEFAULT_PROFILE_TOKENS)
    if batched < 1:
        raise CliError(f"--max-num-batched-tokens must be >= 1, got {batched}")
    runner = ModelRunner(
        model, num_kv_blocks=num_blocks, block_size=args.block_size, device=device,
        dtype=dtype, attention_backend=args.attention_backend,
    )  # fmt: skip
    return run_profile(
        runner, config, model_name=args.model,
        model_spec=model_spec_of(args.model, hf_config, dtype), hf_config=hf_config,
        max_num_batched_tokens=batched, repetitions=args.repetitions, seed=args.seed,
        show_progress=not args.quiet, kv_cache_budget_bytes=kv_budget_bytes,
    )  # fmt: skip


def summary_lines(profile: Profile, path: Path) -> str:
    """What ``rose-run profile`` prints: samples, fit choice, held-out errors, roofline."""
    fit, roof = profile.step_fit, profile.roofline
    lines = [
        f"profiled {profile.label}: {len(profile.samples)} step shapes in "
        f"{profile.extra.get('profile_wall_s', float('nan')):.0f} s -> {path}",
        "held-out relative error (median / p90 / max):",
    ]
    for name, err in fit.held_out.items():
        mark = " <- chosen" if name == fit.model.name else ""
        lines.append(f"  {name:8s} {err.median:6.1%} / {err.p90:6.1%} / {err.max:6.1%}{mark}")
    if roof is None:  # a profile always has a model shape; a pooled calibration may not
        return "\n".join(lines)
    dev, err = roof.device, roof.held_out
    lines.append(
        f"  roofline {err.median:6.1%} / {err.p90:6.1%} / {err.max:6.1%}  "
        f"(calibrated: {roof.combine} of {dev.achievable_flops / 1e9:.3g} GFLOP/s and "
        f"{dev.achievable_bandwidth / 1e9:.3g} GB/s, overhead {dev.overhead_s * 1e3:.2f} ms)"
    )
    return "\n".join(lines)
