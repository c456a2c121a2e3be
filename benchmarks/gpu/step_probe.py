"""Where an executor step's wall time goes: a served ``rose-run`` with every step probed.

The H100 runs of the GPU fidelity check showed eager prefills under 512 tokens (about 13 ms,
launch-bound) taking 1.5-5x that in a quarter to half of the cases, with the scheduler's host
time unchanged (``benchmarks/gpu/step_classes.py``). This runs ``rose-run`` with the given flags
and wraps the engine's step (:meth:`Engine.execute`) and the runner's forward (the host's launch
loop, no device wait) to record, per step:

* ``wall_s``: inputs, forward, sampling and the device synchronize (the step log's ``forward_s``);
* ``launch_s`` / ``launch_cpu_s``: wall and thread CPU seconds of the forward call: a launch
  loop whose CPU time falls short of its wall was off the CPU (preempted, stolen by the
  hypervisor, blocked in a call);
* ``cpu_s``: the thread's CPU seconds over the whole step (a spinning device wait counts), of
  which ``sys_s`` in the kernel (page faults, allocations), and ``minflt`` its minor page faults;
* ``proc_cpu_s``: the whole process's CPU seconds over the step: far above ``cpu_s``, other
  threads (torch's OpenMP pool spinning after a parallel region, say) were busy, and on a
  machine whose CPUs are hyperthreads they slow the launching thread down;
* ``runq_s``: seconds the thread waited runnable on a run queue (``/proc/thread-self/schedstat``);
* ``gc_s``: seconds in Python's garbage collector during the step (``gc.callbacks``);
* ``nivcsw`` / ``nvcsw``: involuntary / voluntary context switches of the thread;
* ``steal_ticks``: the machine's stolen CPU ticks during the step (``/proc/stat``, USER_HZ);
* ``reserved_delta``: change in the caching allocator's reserved bytes (``cudaMalloc``/free).

Then it prints, for eager prefills under 512 tokens, the medians of these for the stretched
steps (over 1.5x the median of their 64-token bin) and the normal ones: which column grows
with the wall time names the cause.

    python benchmarks/gpu/step_probe.py --probe-out probe.jsonl -- --device cuda \\
        --model llama-3.1-8b --policy budget --prefill-max-tokens 2048 --num-requests 500 \\
        --max-model-len 4096 --request-rate 10 --seed 0 --quiet
    python benchmarks/gpu/step_probe.py --summary probe.jsonl      # the table again (or .jsonl.gz)
    python benchmarks/gpu/step_probe.py --probe-out p.jsonl -- --device cpu --model tiny-llama \\
        --num-requests 20 --quiet                                    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

STRETCHED = 1.5  # a step over this many times its bin's median counts as stretched
SMALL = 512  # eager prefills under this many tokens are launch-bound on an H100 (8B)
BIN = 64  # tokens per bin of the stretch's median
SECONDS_KEYS = ("wall_s", "launch_s", "launch_cpu_s", "cpu_s", "sys_s", "proc_cpu_s", "runq_s",
                "gc_s")  # fmt: skip
COUNT_KEYS = ("minflt", "nivcsw", "steal_ticks", "reserved_delta")


class GcClock:
    """Seconds spent in Python's garbage collector since installation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._start


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def runq_wait_s() -> float:
    """Seconds this thread has waited on a run queue (0.0 where schedstat is missing)."""
    fields = _read("/proc/thread-self/schedstat").split()
    return int(fields[1]) / 1e9 if len(fields) > 1 else 0.0


def steal_ticks() -> int:
    """The machine's stolen CPU time in USER_HZ ticks (``/proc/stat``; 0 where missing)."""
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu "):
            fields = line.split()
            return int(fields[8]) if len(fields) > 8 else 0
    return 0


def reserved_bytes() -> int:
    """Bytes the CUDA caching allocator holds (0 without CUDA)."""
    import torch

    return int(torch.cuda.memory_reserved()) if torch.cuda.is_available() else 0


class Counters:
    """One reading of every counter; :meth:`since` gives the deltas as a record."""

    def __init__(self, gc_clock: GcClock) -> None:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.sys, self.minflt = usage.ru_stime, usage.ru_minflt
        self.proc_cpu = time.process_time()
        self.runq, self.gc = runq_wait_s(), gc_clock.total_s
        self.nivcsw, self.nvcsw = usage.ru_nivcsw, usage.ru_nvcsw
        self.steal, self.reserved = steal_ticks(), reserved_bytes()

    def since(self, start: Counters) -> dict[str, float]:
        return {
            "wall_s": self.wall - start.wall,
            "cpu_s": self.cpu - start.cpu,
            "sys_s": self.sys - start.sys,
            "minflt": self.minflt - start.minflt,
            "proc_cpu_s": self.proc_cpu - start.proc_cpu,
            "runq_s": self.runq - start.runq,
            "gc_s": self.gc - start.gc,
            "nivcsw": self.nivcsw - start.nivcsw,
            "nvcsw": self.nvcsw - start.nvcsw,
            "steal_ticks": self.steal - start.steal,
            "reserved_delta": self.reserved - start.reserved,
        }


def install(records: list[dict[str, Any]]) -> None:
    """Wrap ``Engine.execute`` and ``ModelRunner.forward`` to append one record per step."""
    from roseinfer.executor.engine import Engine
    from roseinfer.executor.model_runner import ModelRunner

    gc_clock = GcClock()
    launches: list[tuple[float, float]] = []
    forward: Callable[..., Any] = ModelRunner.forward
    execute: Callable[..., Any] = Engine.execute

    def probed_forward(self: Any, seqs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = forward(self, seqs)
        launches.append((time.perf_counter() - wall, time.thread_time() - cpu))
        return out

    def probed_execute(self: Any, out: Any, now_s: float) -> Any:
        launches.clear()
        start = Counters(gc_clock)
        result = execute(self, out, now_s)
        record = Counters(gc_clock).since(start)
        record |= {
            "step": len(records),
            "tokens": int(out.num_batched_tokens),
            "num_seqs": len(out.decodes) + len(out.prefills),
            "phase": out.phase.value if out.phase is not None else "",
            "launch_s": sum(w for w, _ in launches),
            "launch_cpu_s": sum(c for _, c in launches),
        }
        records.append(record)
        return result

    ModelRunner.forward = probed_forward  # type: ignore[method-assign]
    Engine.execute = probed_execute  # type: ignore[method-assign]


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


CLASSES = (("decode", 0, 1 << 30), ("prefill", 0, 512), ("prefill", 512, 2049),
           ("prefill", 2049, 1 << 30))  # fmt: skip


def _launch_classes(records: list[dict[str, Any]]) -> list[str]:
    """The launch loop's median and p99 per step class (decodes; prefills by tokens)."""
    import numpy as np

    out = []
    for phase, lo, hi in CLASSES:
        got = [
            1e3 * r["launch_s"] for r in records if r["phase"] == phase and lo <= r["tokens"] < hi
        ]
        if got:
            name = (
                phase if phase == "decode" else f"prefill [{lo}, {hi if hi < 1 << 30 else 'inf'})"
            )
            out.append(f"{name} {np.median(got):.1f} / {np.quantile(got, 0.99):.1f}")
    return out


def summarize(records: list[dict[str, Any]]) -> str:
    """The stretched and normal small prefills side by side (medians), as a table."""
    keys, counts = SECONDS_KEYS, COUNT_KEYS
    records = [r | {k: r.get(k, float("nan")) for k in keys + counts} for r in records]
    small = [r for r in records if r["phase"] == "prefill" and r["tokens"] < SMALL]
    if not small:
        return "no prefill steps under 512 tokens"
    bins: dict[int, list[float]] = {}
    for r in small:
        bins.setdefault(r["tokens"] // BIN, []).append(r["wall_s"])
    medians = {b: statistics.median(v) for b, v in bins.items()}
    stretched = [r for r in small if r["wall_s"] > STRETCHED * medians[r["tokens"] // BIN]]
    normal = [r for r in small if r not in stretched]
    lines = [
        f"{len(small)} prefills under {SMALL} tokens, {len(stretched)} stretched "
        f"(> {STRETCHED}x their {BIN}-token bin's median); medians (ms) and means (counts):",
        f"{'':<10}" + "".join(f"{k:>15}" for k in keys + counts),
    ]
    for name, rows in (("stretched", stretched), ("normal", normal)):
        cells = [f"{1e3 * _median(rows, k):>15.2f}" for k in keys]
        cells += [
            f"{(sum(r[k] for r in rows) / len(rows) if rows else float('nan')):>15.2f}"
            for k in counts
        ]
        lines.append(f"{name:<10}" + "".join(cells))
    lines.append("launch loop by class, median / p99 ms: " + "; ".join(_launch_classes(records)))
    total_gc = sum(r["gc_s"] for r in records)
    total_steal = sum(r["steal_ticks"] for r in records)
    lines.append(
        f"all {len(records)} steps: {sum(r['wall_s'] for r in records):.1f} s of steps, "
        f"{total_gc:.2f} s in GC, {total_steal} stolen ticks, "
        f"{sum(r['nivcsw'] for r in records)} involuntary switches"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe-out", type=Path, help="write every step's record here (JSONL)")
    p.add_argument("--summary", type=Path, help="print the table of a probe file and stop")
    args = p.parse_args(own)
    if args.summary:
        opener = gzip.open if args.summary.suffix == ".gz" else open
        with opener(args.summary, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        print(summarize(rows))
        return 0
    if not run_args:
        p.error("give rose-run's flags after --, or --summary FILE")
    from roseinfer.cli import run as rose_run

    records: list[dict[str, Any]] = []
    install(records)
    sys.argv = ["rose-run", *run_args]
    rc = rose_run.main()
    if args.probe_out:
        args.probe_out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(summarize(records))
    return rc


if __name__ == "__main__":
    sys.exit(main())
