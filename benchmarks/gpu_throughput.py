"""GPU throughput: roseinfer per attention backend vs transformers vs the roofline.

One process, one model object (Llama-3.1-8B shapes, random bf16 weights by
default), one table. Systems:

* ``roseinfer-<backend>``: :class:`~roseinfer.executor.engine.Engine` over a
  runner whose pool the memory planner sized (``--gpu-memory-utilization``),
  warmed up (CUDA graphs captured for ``triton``), vLLM v1's scheduler preset
  (chunked prefill, running requests first) at ``--max-num-batched-tokens``
  8192 and ``--max-num-seqs`` 256, fifo, greedy, every request at t=0;
* ``hf-cb``: transformers' continuous batching (``init_continuous_batching``,
  the manager behind ``generate_batch``) in its automatic GPU configuration:
  KV blocks and batch tokens sized from free memory, CUDA graphs and async
  batching as it decides, paged attention (``sdpa_paged``, or flash attention
  when installed); each request's own ``max_new_tokens``, EOS off;
* ``floor``: the roofline bound of roseinfer's own steps: per step ``max(bytes
  / bandwidth, FLOPs / peak)`` with ``--hardware``'s datasheet peaks
  (``calibration/specs.py``; weights + KV read and written; FLOPs of the linear
  layers, the LM head and attention), summed.

Workloads: (a) ``--num-requests`` requests of 215 prompt / 198 output tokens
(the mean lengths of vLLM's ShareGPT anchor, PR #14431); (a-sub) its first
``--subset`` requests, for every system (the slow ones run only this); (b) the
first ``--num-requests`` Azure conv 2023 requests (the embedded sample),
clipped to ``--max-model-len``; (c) single steps, ``ModelRunner.forward`` and a
synchronize, median of 5: decodes of 1/32/64/128/256 sequences at context 1024,
the 256 again with one context of 4,096 (the longest context's tail), a
200-token prompt alone and beside 64 decodes (launch-bound when run eagerly;
``triton:full`` replays them from graphs), and a prefill of 4 x 2048 tokens, with
each step's floor.

Host time: for the decode steps of (c) the runner's host seconds per forward
(``ModelRunner.host_times_s``: inputs and launches, no wait), and for (a) the
scheduler's planning seconds per step (``StepTiming.host_s + prepare_s``), as a
share of the step: the check for async scheduling (worth it above 20%).

Run it on one GPU (about 6 minutes on one H100 80GB with the defaults; never
measured here: this machine has no GPU)::

    python benchmarks/gpu_throughput.py
    python benchmarks/gpu_throughput.py --model tiny-llama --device cpu --small   # smoke, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from _common import table
from executor_vs_hf import Result, hf_cb, hf_cb_config
from gpu.device_line import device_facts

from roseinfer import workloads
from roseinfer.calibration.cost_model import BatchShape, RooflineCostModel
from roseinfer.calibration.specs import DATASHEET_DEVICES, get_device_spec
from roseinfer.calibration.steplog import StepLogWriter, StepRecorder, make_header
from roseinfer.config import SCHEDULER_PRESETS, SchedulerConfig
from roseinfer.executor import builder
from roseinfer.executor.engine import Engine, synchronize
from roseinfer.executor.facts import environment_facts, executor_facts, model_spec_of
from roseinfer.executor.model_runner import ModelRunner
from roseinfer.executor.warmup import scratch_inputs
from roseinfer.request import Request
from roseinfer.workloads.fit import fit_lengths, with_token_ids

BLOCK_SIZE = 16
ANCHOR_PROMPT, ANCHOR_OUTPUT = 215, 198
DECODE_BATCHES, DECODE_CONTEXT, PREFILL_SHAPE = (1, 32, 64, 128, 256), 1024, (4, 2048)
SKEW_FACTOR = 4  # the skewed decode step: its longest context, times the others'
SMALL = {"prompt": 21, "output": 19, "decodes": (1, 2, 4), "context": 64, "prefill": (2, 64),
         "short_prefill": 24}  # fmt: skip
SHORT_PREFILL = 200  # tokens: a short prompt, launch-bound on an H100 when run eagerly
REPEATS = 5


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    p.add_argument(
        "--backends",
        help="comma-separated; NAME:eager runs NAME with --enforce-eager, triton:nosplit "
        "without balanced key splits, triton:unified with a mixed pass's decodes in its one "
        "launch, triton:full with --cudagraph-mode FULL (small "
        "prefill and mixed passes replayed too) (default: triton,triton:eager,sdpa on CUDA; "
        "sdpa on CPU)",
    )
    p.add_argument(
        "--hardware",
        help="roofline spec of the floor (default: the GPU's own, h100-sxm or h200; cpu on CPU)",
    )
    p.add_argument(
        "--floor-peaks",
        choices=("measured", "datasheet"),
        help="the floor's bandwidth and matrix rate: measured in this run (a device-to-device "
        "copy, a bf16 8192^3 matmul; default on CUDA) or --hardware's datasheet (default on CPU)",
    )
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--subset", type=int, default=128, help="requests of (a-sub)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    p.add_argument(
        "--workloads",
        default="a,a-sub,b",
        help="comma-separated workloads to serve (default: a,a-sub,b; '' serves none: the "
        "step table (c) only, a quick A/B)",
    )
    p.add_argument(
        "--kernel-table",
        action="store_true",
        help="print the torch profiler's kernel table of each step of (c) (graph replays "
        "included: their kernels are traced)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="print cProfile's functions by own time over the forwards of each decode step of "
        "(c) and of the short prompt alone: where the runner's host seconds go",
    )
    p.add_argument(
        "--save-steps",
        metavar="DIR",
        help="write each served workload's step log to DIR/steps-WORKLOAD-SYSTEM.jsonl (the "
        "schema of rose-run --save-steps: benchmarks/gpu/decode_skew.py, rose-sim --cost-model)",
    )
    p.add_argument("--small", action="store_true", help="tiny workloads and steps (smoke test)")
    args = p.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.backends = (args.backends or ("triton,triton:eager,sdpa" if cuda else "sdpa")).split(",")
    args.hardware = args.hardware or (gpu_kind(torch.device(args.device)) if cuda else "cpu")
    args.floor_peaks = args.floor_peaks or ("measured" if cuda else "datasheet")
    if args.small:
        args.num_requests, args.subset = min(args.num_requests, 6), min(args.subset, 3)
        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len = 4, 128, 64
    return args


def device_line(device: torch.device) -> str:
    """GPU (or CPU), driver, CUDA, torch and triton versions (``gpu/device_line.py``)."""
    facts = device_facts()
    versions = f"torch {facts['torch']} | triton {facts['triton']}"
    if device.type != "cuda":
        return f"device: cpu (not a GPU measurement) | {versions}"
    props = torch.cuda.get_device_properties(device)
    return (
        f"device: {facts['gpu']} ({props.total_memory / 2**30:.0f} GiB, "
        f"{props.multi_processor_count} SMs) | driver {facts['driver']} | CUDA {facts['cuda']} | "
        f"{versions}"
    )


# ------------------------------------------------------------------ workloads
def anchor_workload(num: int, prompt: int, output: int, vocab: int) -> list[Request]:
    """(a): ``num`` requests of ``prompt`` / ``output`` tokens at t=0, random ids."""
    reqs = [Request(f"a{i}", 0.0, prompt, output) for i in range(num)]
    return with_token_ids(reqs, vocab_size=vocab, seed=0)


def azure_workload(num: int, max_model_len: int, vocab: int) -> list[Request]:
    """(b): the first ``num`` Azure conv requests clipped to ``max_model_len``, t=0."""
    reqs = workloads.select(workloads.load_default_trace(), num_requests=num)
    reqs, _ = fit_lengths(reqs, max_model_len, mode="clip")
    reqs = [dataclasses.replace(r, arrival_time_s=0.0) for r in reqs]
    return with_token_ids(reqs, vocab_size=vocab, seed=0)


def gpu_kind(device: torch.device) -> str:
    """The built-in spec of this GPU: ``h200`` for an H200, else ``h100-sxm``."""
    return "h200" if "H200" in torch.cuda.get_device_name(device) else "h100-sxm"


def measured_peaks(device: torch.device) -> tuple[float, float]:
    """This device's copy bandwidth (bytes/s, bytes read plus written by a 2 GiB
    device-to-device copy) and bf16 matrix rate (FLOP/s, 8192^3), best of 10
    after 3 warm-ups: the ceilings the issue's floors use."""
    src = torch.empty(2**30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    a = torch.randn((8192, 8192), dtype=torch.bfloat16, device=device)
    b = torch.randn_like(a)

    def best(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return min(times)

    bandwidth = 2 * src.numel() * 2 / best(lambda: dst.copy_(src))
    flops = 2 * 8192**3 / best(lambda: a @ b)
    return bandwidth, flops


def floor_model(model_name: str, hf_config, dtype, args) -> RooflineCostModel:
    """The roofline at the device's peaks (measured in this run, or the datasheet's;
    no efficiency factor, no overhead). A measured spec's fitted terms (KV
    bandwidth, per-sequence overhead, eager launches, decode imbalance) price
    this executor, not a bound, so the floor starts from the datasheet's form."""
    spec = DATASHEET_DEVICES.get(args.hardware) or get_device_spec(args.hardware)
    if args.floor_peaks == "measured":
        bandwidth, flops = measured_peaks(torch.device(args.device))
        spec = dataclasses.replace(
            spec, name=f"{spec.name} (measured here)", mem_bandwidth=bandwidth, peak_flops=flops
        )
    peaks = dataclasses.replace(spec, mfu=1.0, bandwidth_efficiency=1.0, overhead_s=0.0)
    return RooflineCostModel(model_spec_of(model_name, hf_config, dtype), peaks)


# ------------------------------------------------------------------ roseinfer
def scheduler_config(args, num_kv_blocks: int, max_model_len: int) -> SchedulerConfig:
    preset = {**SCHEDULER_PRESETS["vllm-v1"], "max_num_seqs": args.max_num_seqs}
    preset["max_num_batched_tokens"] = args.max_num_batched_tokens
    return SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE,
                           max_model_len=max_model_len, **preset)  # fmt: skip


def make_runner(
    loaded: builder.LoadedModel, backend: str, args, max_model_len: int
) -> tuple[ModelRunner, str]:
    """A runner built as rose-run builds one (``executor/builder.py``): its pool
    sized by the memory planner on CUDA, ``max_num_seqs`` full sequences on CPU;
    warmed up (CUDA graphs, then the largest shapes); returns it and a line on its
    set-up."""
    start = time.perf_counter()
    blocks = builder.max_useful_blocks(args.max_num_seqs, max_model_len, BLOCK_SIZE)
    cpu = loaded.device.type == "cpu"
    pool = builder.KVPoolChoice(
        BLOCK_SIZE, num_kv_blocks=blocks if cpu else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    size = builder.size_kv_pool(pool, loaded, blocks)
    config = scheduler_config(args, size.num_blocks, max_model_len)
    name, _, mode = backend.partition(":")
    graphs = "FULL" if mode == "full" else "FULL_DECODE_ONLY"
    choice = builder.RunnerChoice(name, enforce_eager=mode == "eager", cudagraph_mode=graphs)
    built = builder.build_runner(loaded, config, size, choice)
    runner = built.runner
    if mode == "nosplit":  # the warm-up never keeps balanced splits (an A/B of them)
        runner.backend.balanced_splits = False
    if mode == "unified":  # a mixed pass's decodes never launch apart (an A/B of that)
        runner.backend.separate_decodes = False
    builder.warm_up(runner, built.config)
    plan = built.pool.plan
    note = (
        plan.describe() if plan else f"KV pool {blocks} blocks (CPU: max_num_seqs full sequences)"
    )
    setup_s = time.perf_counter() - start
    return runner, (
        f"{system_name(runner)}: {note}; CUDA graphs "
        f"{runner.cuda_graph_capture_s:.1f} s; attention tuned in {runner.attention_tune_s:.1f} s"
        f" {getattr(runner.backend, 'launch', {})}, balanced splits "
        f"{sorted(getattr(runner.backend, 'balanced', ())) or 'none'}; set-up {setup_s:.1f} s"
    )


def system_name(runner: ModelRunner) -> str:
    """``roseinfer-<backend>``, with ``-eager`` when it captures no CUDA graph,
    ``-nosplit`` when balanced key splits were ruled out, ``-unified`` when a mixed
    pass's decodes never launch apart, and ``-full`` when
    prefill and mixed passes replay graphs too."""
    eager = "-eager" if runner.enforce_eager and runner.device.type == "cuda" else ""
    nosplit = "" if getattr(runner.backend, "balanced_splits", True) else "-nosplit"
    unified = "" if getattr(runner.backend, "separate_decodes", True) else "-unified"
    full = "-full" if runner.mixed_graph_max_tokens else ""
    return f"roseinfer-{runner.attention_backend}{eager}{nosplit}{unified}{full}"


def run_engine(runner: ModelRunner, args, reqs: list[Request], max_model_len: int):
    """Replay ``reqs``; returns the result, its step records and step timings."""
    recorder = StepRecorder(keep=True)
    config = scheduler_config(args, runner.num_kv_blocks, max_model_len)
    engine = Engine(runner, config, record_timings=True, on_step=recorder)
    result = engine.run(reqs)
    return result, recorder.records or [], result.timings


def save_steps(args, runner: ModelRunner, served: tuple[str, str], records,
               floor: RooflineCostModel, max_model_len: int) -> None:  # fmt: skip
    """The steps of workload ``served = (name, system)`` as
    ``args.save_steps/steps-NAME-SYSTEM.jsonl``, with the model's shape and the runner's
    facts (its attention launches among them) in the header."""
    name, system = served
    config = scheduler_config(args, runner.num_kv_blocks, max_model_len)
    fitted = "clip" if name == "b" else "off"
    header = make_header(
        "rose-run",
        model={"name": args.model, "spec": dataclasses.asdict(floor.model)},
        executor=executor_facts(runner, config, args.max_num_batched_tokens, None, fitted),
        environment=environment_facts(runner.device),
    )
    path = Path(args.save_steps) / f"steps-{name}-{system}.jsonl"
    with StepLogWriter(path, header) as writer:
        for record in records:
            writer.write(record)


def throughput_row(workload: str, system: str, reqs: Sequence[Request], wall_s: float,
                   floor_s: float | None) -> list[object]:  # fmt: skip
    out = sum(r.max_output_tokens for r in reqs)
    total = out + sum(r.num_prompt_tokens for r in reqs)
    floor = f"{floor_s / wall_s:.2f}" if floor_s else ""
    return [workload, system, len(reqs), f"{out / wall_s:.0f}", f"{total / wall_s:.0f}",
            f"{wall_s:.1f}", floor]  # fmt: skip


def planning_share(timings) -> str:
    """Median scheduler host time of the largest decode steps, as a share of the step."""
    decodes = [t for t in timings if t.phase == "decode"]
    if not decodes:
        return "no decode step"
    largest = max(t.num_seqs for t in decodes)
    top = [t for t in decodes if t.num_seqs == largest]
    host = statistics.median(t.host_s + t.prepare_s for t in top)
    step = statistics.median(t.host_s + t.prepare_s + t.forward_s for t in top)
    return (
        f"planning {host * 1e3:.2f} ms of {step * 1e3:.2f} ms ({host / step:.0%}) at {largest} seqs"
    )


def timed_forward(runner: ModelRunner, inputs) -> tuple[float, float]:
    """Median wall and host seconds of ``REPEATS`` forwards (after one untimed)."""
    runner.forward(inputs)
    walls, runner.host_times_s = [], []
    for _ in range(REPEATS):
        synchronize(runner.device)
        start = time.perf_counter()
        runner.forward(inputs)
        synchronize(runner.device)
        walls.append(time.perf_counter() - start)
    host = statistics.median(runner.host_times_s)
    runner.host_times_s = None
    return statistics.median(walls), host


def step_shapes(args) -> list[tuple[str, list[tuple[int, int]]]]:
    """(c): name and ``(new_tokens, context)`` per sequence."""
    decodes, context = (SMALL["decodes"], SMALL["context"]) if args.small else (
        DECODE_BATCHES, DECODE_CONTEXT)  # fmt: skip
    count, length = SMALL["prefill"] if args.small else PREFILL_SHAPE
    short = SMALL["short_prefill"] if args.small else SHORT_PREFILL
    shapes = [(f"decode {n} x ctx {context}", [(1, context)] * n) for n in decodes]
    # the largest batch again with one context 4x the others': the longest context's tail
    n, long = max(decodes), SKEW_FACTOR * context
    shapes.append(
        (f"decode {n} x ctx {context}, one {long}", [(1, long)] + [(1, context)] * (n - 1))
    )
    # a short prompt alone and beside decodes: launch-bound unless replayed (--cudagraph-mode FULL)
    d = decodes[len(decodes) // 2]
    shapes.append((f"prefill 1 x {short}", [(short, short)]))
    shapes.append(
        (f"mixed {d} x ctx {context} + 1 x {short}", [(1, context)] * d + [(short, short)])
    )
    return [*shapes, (f"prefill {count} x {length}", [(length, length)] * count)]


def step_rows(runner: ModelRunner, args, floor: RooflineCostModel) -> list[list[object]]:
    rows = []
    for name, seqs in step_shapes(args):
        if len(seqs) > args.max_num_seqs and name.startswith("decode"):
            continue
        inputs = scratch_inputs(seqs, BLOCK_SIZE, runner.num_kv_blocks, runner.vocab_size)
        wall_s, host_s = timed_forward(runner, inputs)
        floor_s = floor.step_time_s(step_shape(seqs))
        rows.append([name, system_name(runner), f"{wall_s * 1e3:.2f}",
                     f"{floor_s * 1e3:.2f}", f"{wall_s / floor_s:.2f}",
                     f"{host_s * 1e3:.2f} ({host_s / wall_s:.0%})"])  # fmt: skip
    return rows


def kernel_tables(runner: ModelRunner, args) -> None:
    """The profiler's top kernels by device time for each step of (c), to stderr."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for name, seqs in step_shapes(args):
        if len(seqs) > args.max_num_seqs:
            continue
        inputs = scratch_inputs(seqs, BLOCK_SIZE, runner.num_kv_blocks, runner.vocab_size)
        runner.forward(inputs)
        synchronize(runner.device)
        with profile(activities=activities) as prof:
            runner.forward(inputs)
            synchronize(runner.device)
        sort = "self_device_time_total" if runner.device.type == "cuda" else "self_cpu_time_total"
        print(f"== kernels of {name} ({system_name(runner)})", file=sys.stderr)
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60),
              file=sys.stderr, flush=True)  # fmt: skip


def host_profiles(runner: ModelRunner, args) -> None:
    """cProfile over ``REPEATS`` forwards of each decode step of (c) and of the short
    prompt alone (an eager pass unless replayed: its launches, layer by layer), top
    functions by own time, to stderr: what the ``host ms`` column is made of (the
    device is waited for outside the profiled calls)."""
    import cProfile
    import pstats

    for name, seqs in step_shapes(args):
        wanted = name.startswith("decode") or name.startswith("prefill 1 x")
        if not wanted or len(seqs) > args.max_num_seqs:
            continue
        inputs = scratch_inputs(seqs, BLOCK_SIZE, runner.num_kv_blocks, runner.vocab_size)
        runner.forward(inputs)
        prof = cProfile.Profile()
        for _ in range(REPEATS):
            synchronize(runner.device)
            prof.enable()
            runner.forward(inputs)
            prof.disable()
        synchronize(runner.device)
        print(f"== host functions of {name} ({system_name(runner)}), {REPEATS} forwards",
              file=sys.stderr)  # fmt: skip
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(14)


def step_shape(seqs: list[tuple[int, int]]) -> BatchShape:
    prefills = [(n, c) for n, c in seqs if n > 1]
    return BatchShape(
        prefill_new_tokens=[n for n, _ in prefills],
        prefill_context_tokens=[c for _, c in prefills],
        decode_context_tokens=[c for n, c in seqs if n == 1],
    )


# ------------------------------------------------------------------ driver
def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_backend(loaded, backend, args, loads, floor, max_model_len):
    """Every workload on one backend: throughput rows, step rows, notes."""
    runner, note = make_runner(loaded, backend, args, max_model_len)
    print(f"  {note}", file=sys.stderr, flush=True)
    notes, rows = [note], []
    for name, reqs in loads.items():
        if name != "a-sub" and backend != args.backends[0]:
            continue  # the slower backends run the subset and the steps only
        result, records, timings = run_engine(runner, args, reqs, max_model_len)
        floor_s = sum(floor.step_time_s(r.shape) for r in records)
        system = system_name(runner)
        if args.save_steps:
            save_steps(args, runner, (name, system), records, floor, max_model_len)
        rows.append(throughput_row(name, system, reqs, result.duration_s, floor_s))
        if backend == args.backends[0]:
            rows.append(throughput_row(name, f"floor of its steps ({args.hardware})", reqs,
                                       floor_s, floor_s))  # fmt: skip
        if name == "a":
            notes.append(f"{system} on (a): {planning_share(timings)}")
        gc, slowest = result.gc, max((t.host_s + t.prepare_s + t.forward_s for t in timings),
                                     default=0.0)  # fmt: skip
        print(f"  {name} {system}: {result.duration_s:.1f} s; slowest step {slowest * 1e3:.0f} ms; "
              f"{gc.full_collections} full collections, longest pause {gc.max_s * 1e3:.0f} ms",
              file=sys.stderr, flush=True)  # fmt: skip
    steps = step_rows(runner, args, floor)
    for row in steps:  # as they come: a run cut short still shows them
        print("  " + " | ".join(map(str, row)), file=sys.stderr, flush=True)
    for wanted, tables in ((args.kernel_table, kernel_tables), (args.host_profile, host_profiles)):
        if not wanted:
            continue
        try:  # diagnostics: a profiler that fails here must not lose the tables
            tables(runner, args)
        except Exception as err:  # noqa: BLE001 - reported in one line, the run goes on
            print(f"  {tables.__name__} failed: {type(err).__name__}: {err}", file=sys.stderr)
    return rows, steps, notes


def bench_hf(model, reqs: list[Request], device: torch.device) -> tuple[Result, str]:
    from transformers import ContinuousBatchingConfig

    config = (
        ContinuousBatchingConfig(seed=0) if device.type == "cuda" else hf_cb_config(reqs, 16, None)
    )
    result = hf_cb(model, reqs, config)
    impl = getattr(model.config, "_attn_implementation", "?")
    return result, f"hf-cb: attention {impl}, cuda graphs {getattr(config, 'use_cuda_graph', None)}"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    print(device_line(device))
    dtype = str(args.dtype).removeprefix("torch.")
    loaded = builder.load_model(builder.ModelChoice(args.model, args.device, dtype, seed=0))
    model, hf_config = loaded.model, loaded.hf_config
    max_model_len = min(args.max_model_len, loaded.max_context)
    vocab = loaded.vocab_size
    prompt, output = (SMALL["prompt"], SMALL["output"]) if args.small else (ANCHOR_PROMPT,
                                                                           ANCHOR_OUTPUT)  # fmt: skip
    anchor = anchor_workload(args.num_requests, prompt, output, vocab)
    loads = {"a": anchor, "a-sub": anchor[: args.subset],
             "b": azure_workload(args.num_requests, max_model_len, vocab)}  # fmt: skip
    wanted = {w for w in args.workloads.split(",") if w}
    if not wanted <= set(loads):
        raise SystemExit(f"--workloads: unknown {sorted(wanted - set(loads))}; pick from a,a-sub,b")
    loads = {k: v for k, v in loads.items() if k in wanted}
    floor = floor_model(args.model, hf_config, args.dtype, args)
    rows, steps, notes = [], [], []
    for backend in args.backends:
        # Here, not at the end of bench_backend: a run's result keeps its scheduler, and
        # with it the runner's KV pool, until bench_backend's frame is gone (on one H100
        # the second backend after a served workload found 0.05 GiB for its pool).
        free_memory()
        try:
            r, s, n = bench_backend(loaded, backend, args, loads, floor, max_model_len)
        except Exception as e:  # noqa: BLE001 - one system's failure must not lose the table
            notes.append(f"{backend}: failed: {type(e).__name__}: {e}")
            print(f"  {backend} failed: {e!r}", file=sys.stderr, flush=True)
            continue
        rows, steps, notes = rows + r, steps + s, notes + n
    free_memory()
    print_report(args, rows, steps, notes, floor)
    if not args.no_hf and "a-sub" in loads and rows:  # last: its table survives a failure here
        try:
            result, note = bench_hf(model, loads["a-sub"], device)
        except Exception as e:  # noqa: BLE001 - transformers' failure is a finding, not a crash
            print(f"  hf-cb failed: {type(e).__name__}: {e}")
            return
        row = throughput_row("a-sub", "hf-cb", loads["a-sub"], result.wall_s, None)
        first = next(r for r in rows if r[0] == "a-sub")
        print(table(["workload", "system", "requests", "out tok/s", "total tok/s", "s",
                     "floor/measured"], [first, row]))  # fmt: skip
        print(f"  {note}")
        print(f"  {first[1]} / hf-cb on a-sub: {float(first[3]) / float(row[3]):.1f}x out tok/s")


def print_report(args, rows, steps, notes, floor: RooflineCostModel) -> None:
    print(
        f"model {args.model} ({str(args.dtype).removeprefix('torch.')}), floor: {floor.describe()}"
    )
    print(table(["workload", "system", "requests", "out tok/s", "total tok/s", "s",
                 "floor/measured"], rows))  # fmt: skip
    print()
    print(table(["step", "system", "ms", "floor ms", "x floor", "host ms (share)"], steps))
    for note in notes:
        print(f"  {note}")


if __name__ == "__main__":
    main()
