"""Time the executor's real steps over a grid of batch shapes (``rose-run profile``,
whose flags are :mod:`roseinfer.cli.profile`).

The grid (:func:`roseinfer.calibration.profile_grid.profile_grid`) spans what a
workload can make the scheduler produce under the given limits
(``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``, the block size
and the KV pool): prefill chunks up to the token budget with and without cached
prefixes, batches of prompts with and without a shared cached prefix, decode
batches (on CUDA at the captured graph sizes) times contexts up to
``max_model_len``, and mixed steps at the budget.

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

import dataclasses
import datetime
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from roseinfer.calibration import OverheadSample, Profile, ProfileSample
from roseinfer.calibration.cost_model import BatchShape
from roseinfer.calibration.graph_replay import cuda_graph_batch_sizes
from roseinfer.calibration.profile import step_samples
from roseinfer.calibration.profile_grid import GridLimits, grid_counts, profile_grid
from roseinfer.calibration.specs import ModelSpec
from roseinfer.config import SchedulerConfig
from roseinfer.driver import StepResult, VirtualClock, drive
from roseinfer.executor.engine import synchronize
from roseinfer.executor.facts import (
    builtin_device_spec,
    environment_facts,
    executor_facts,
)
from roseinfer.executor.gc_watch import frozen_heap
from roseinfer.executor.model_runner import ModelRunner, SeqInput
from roseinfer.executor.warmup import scratch_inputs, warm_up
from roseinfer.records import RecordBuilder
from roseinfer.registry import load_registry
from roseinfer.request import Request, SamplingParams
from roseinfer.scheduler import Scheduler, SchedulerOutput, StepTotals

DEFAULT_REPETITIONS = 3  # timed runs per shape (the median is kept)
SERVED_SIGMA = 1.0
"""Log-normal sigma of the served run's prompt and output lengths (a factor of
e ~ 2.7 each way within one sigma: prompts from tens of tokens to the limit)."""
RETRY_SPREAD = 1.3  # repetitions further apart than this are timed again
GREEDY = SamplingParams()  # what the engine samples a greedy request with (to its length)


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
    tables: list[array]  # array('i'), as the engine passes the block manager's own
    times_s: list[float]


def _make_point(kind: str, seqs: list[tuple[int, int]], runner: ModelRunner, offset: int) -> _Point:
    inputs = scratch_inputs(
        [(c, c) for _, c in seqs], runner.block_size, runner.num_kv_blocks, runner.vocab_size,
        first_block=offset, seed=offset,
    )  # fmt: skip
    tokens = [list(s.token_ids) for s in inputs]
    return _Point(kind, seqs, tokens, [array("i", s.block_table) for s in inputs], [])


def time_step(runner: ModelRunner, point: _Point) -> float:
    """Seconds of one step as the engine pays it: inputs, forward, the runner's
    sampler (greedy, as the engine calls it), sync."""
    start = time.perf_counter()
    inputs = [
        SeqInput(tokens[context - new : context], context - new, table)
        for (new, context), tokens, table in zip(point.seqs, point.tokens, point.tables)
    ]
    logits = runner.forward(inputs)
    runner.sample(logits, [GREEDY] * len(inputs), [None] * len(inputs))
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
    with frozen_heap():
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
    graph_batch_sizes: Sequence[int] | None = None,
    served_requests: int = 0,
) -> Profile:
    """Warm up, time the grid, serve a run, measure the host overhead, fit: a :class:`Profile`.

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
        graph_batch_sizes: decode batch sizes the runner captured as CUDA graphs
            (default: the runner's ``graph_batch_sizes``, else vLLM's capture list
            on CUDA and none on CPU); decode batches are timed at these sizes.
        served_requests: requests of a served run after the grid
            (:func:`served_samples`; 0: none), whose logged steps join the fit.
    """
    start, load_before = time.perf_counter(), environment_facts(runner.device)["load_average"]
    graphs = _graph_batch_sizes(runner, config) if graph_batch_sizes is None else graph_batch_sizes
    limits = GridLimits(
        max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
        config.num_kv_blocks * config.block_size, config.block_size, tuple(graphs),
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
    samples = [
        _with_host(s, host)
        for s in _timed_samples(runner, limits, repetitions, seed, show_progress)
    ]
    served_s = time.perf_counter()
    served = served_samples(runner, config, max_num_batched_tokens, served_requests, seed)
    served_s = time.perf_counter() - served_s
    extra = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile_wall_s": time.perf_counter() - start,
        "grid": {
            "repetitions": repetitions,
            "seed": seed,
            "num_samples": len(samples),
            "counts": grid_counts(profile_grid(limits, seed)),
            "graph_batch_sizes": list(limits.graph_batch_sizes),
        },
        "served": {
            "num_requests": served_requests,
            "num_steps": len(served),
            "wall_s": served_s,
            "prompt_median_tokens": _served_medians(config.max_model_len)[0],
            "output_median_tokens": _served_medians(config.max_model_len)[1],
            "sigma": SERVED_SIGMA,
        },
        "host": dataclasses.asdict(host),
        "warmup": [dataclasses.asdict(w) for w in warmup],
    }
    executor = executor_facts(runner, config, max_num_batched_tokens, kv_cache_budget_bytes)
    return Profile.create(
        model_name=model_name, model_spec=model_spec, executor=executor,
        environment={**environment_facts(runner.device), "load_average_before": load_before},
        samples=samples + served, overhead_samples=dispatch,
        base_device=builtin_device_spec(runner.device), seed=seed, extra=extra,
    )  # fmt: skip


SERVED_MEDIANS_CAP = (1024, 128)
"""Largest median prompt and output tokens of the served run: with a long context
(128k) a quarter of it would make a run of hours."""


def _served_medians(max_model_len: int) -> tuple[int, int]:
    """Median prompt and output tokens of the served run: a quarter and a 32nd of
    ``max_model_len``, at most :data:`SERVED_MEDIANS_CAP` (1,024 and 128 from 4,096
    on), so its log-normal lengths reach the limit; chosen to cover the shapes, not
    fitted to any trace."""
    prompt_cap, output_cap = SERVED_MEDIANS_CAP
    return max(1, min(max_model_len // 4, prompt_cap)), max(1, min(max_model_len // 32, output_cap))


def served_workload(
    num_requests: int, max_model_len: int, vocab_size: int, seed: int = 0
) -> list[Request]:
    """The served run's requests: all at t=0, log-normal prompt and output lengths
    (medians :func:`_served_medians`, sigma :data:`SERVED_SIGMA`) clipped so each
    fits ``max_model_len``, distinct random prompts (no prefix-cache hits)."""
    rng = np.random.default_rng([seed, 1])
    prompt_median, output_median = _served_medians(max_model_len)
    prompts = np.exp(rng.normal(np.log(prompt_median), SERVED_SIGMA, num_requests))
    outputs = np.exp(rng.normal(np.log(output_median), SERVED_SIGMA, num_requests))
    out = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        num_prompt = int(np.clip(round(p), 1, max_model_len - 1))
        num_output = int(np.clip(round(o), 1, max_model_len - num_prompt))
        ids = tuple(rng.integers(0, vocab_size, num_prompt).tolist())
        out.append(Request(f"served-{i}", 0.0, num_prompt, num_output, ids, sampling=GREEDY))
    return out


def served_samples(
    runner: ModelRunner,
    config: SchedulerConfig,
    max_num_batched_tokens: int,
    num_requests: int,
    seed: int = 0,
) -> list[ProfileSample]:
    """Serve :func:`served_workload` through the engine rose-run uses (fifo,
    prefill-first, ``max_num_batched_tokens`` per step, chunked only where a prompt
    can exceed it) and return its logged steps as samples (kind ``served-...``,
    one time each, host work included).

    A grid times chosen shapes back to back; a served run takes the shapes the
    scheduler makes (prompt lengths between the grid's, decode batches whose
    contexts skew as requests join and leave) on a device and host in their
    serving state. On one H100 the grid's profile priced the served steps of
    ``20-gpu-fidelity``'s runs 6-15% low (prefills of 700-1,400 tokens, decode
    batches of 128-256 with skewed contexts; ``benchmarks/gpu/sim_vs_check20.sh``).
    """
    if num_requests <= 0:
        return []
    from roseinfer.calibration.steplog import StepRecorder
    from roseinfer.executor.engine import Engine

    served = dataclasses.replace(
        config,
        policy="fifo",
        loop_order="prefill-first",
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=max_num_batched_tokens < config.max_model_len,
    )
    recorder = StepRecorder(keep=True)
    engine = Engine(runner, served, load_registry(), seed=seed, on_step=recorder)
    engine.run(served_workload(num_requests, config.max_model_len, runner.vocab_size, seed))
    return step_samples(recorder.records or [])


def _graph_batch_sizes(runner: ModelRunner, config: SchedulerConfig) -> tuple[int, ...]:
    """The decode batch sizes ``runner`` runs as CUDA graphs (its own list when it
    has one; vLLM's default list on CUDA; none on CPU)."""
    own = getattr(runner, "graph_batch_sizes", None)
    if own is not None:
        return tuple(own)
    return cuda_graph_batch_sizes(config.max_num_seqs) if runner.device.type == "cuda" else ()


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
