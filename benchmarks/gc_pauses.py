"""The garbage collector's pauses in a timed ``rose-run``: heap frozen (as shipped) vs not.

Each round runs the same ``rose-run`` twice in fresh processes, alternating the
order: once as shipped (the start-up heap frozen for the run,
:func:`roseinfer.executor.gc_watch.frozen_heap`) and once with the freeze
replaced by a no-op (the code before it). The table shows, per mode, the full
collections the run made, the longest pause, all collection time and the run's
duration, min-max over the rounds, from the result file's ``gc_*`` fields.

    python benchmarks/gc_pauses.py                   # 2,000 Azure conv requests, tiny-llama, CPU
                                                     # (clipped to its 512-token context)
    python benchmarks/gc_pauses.py --num-requests 500 --rounds 1

Extra arguments after ``--`` go to ``rose-run``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = ("frozen", "unfrozen")
FIELDS = ("gc_full_collections", "gc_pause_max_s", "gc_pause_s", "duration")


def child(mode: str, rose_args: list[str]) -> int:
    """Run ``rose-run`` in this process, with the freeze off for ``unfrozen``.

    Both modes apply rose-run's settings that must precede torch's import first:
    the ``unfrozen`` patch imports the engine, and with it torch, before rose-run's
    ``main`` could set ``OMP_WAIT_POLICY=PASSIVE``, so until 2026-11-28 that mode
    ran with libgomp's active policy, 10% faster on the idle 2-core VM (a run of
    this benchmark's default: 45.9-48.0 s active against 50.8-53.2 s passive,
    QUIET): a difference this table put on the freeze."""
    from roseinfer.cli.executor_flags import prepare_torch

    prepare_torch()
    if mode == "unfrozen":
        import roseinfer.executor.engine as engine

        engine.frozen_heap = contextlib.nullcontext  # type: ignore[assignment]
    from roseinfer.cli.run import main

    sys.argv = ["rose-run", *rose_args]
    return main()


def one_run(mode: str, rose_args: list[str], out: Path) -> dict[str, float]:
    """One ``rose-run`` in a fresh process; its result file's :data:`FIELDS`."""
    cmd = [sys.executable, __file__, "--child", mode, "--", *rose_args, "--quiet", "--no-summary",
           "--save-result", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True)
    result = json.loads(out.read_text())
    return {f: float(result[f]) for f in FIELDS}


def span(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    lo, hi = min(values) * scale, max(values) * scale
    return f"{lo:.{digits}f}" if lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"


def main() -> int:
    """Parse the flags, alternate the modes for ``--rounds`` rounds, print the table."""
    if sys.argv[1:2] == ["--child"]:  # one_run's process: MODE -- ROSE-RUN ARGS
        return child(sys.argv[2], sys.argv[4:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="runs per mode (default 2)")
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--model", default="tiny-llama")
    args, rest = p.parse_known_args()
    rest = [a for a in rest if a != "--"]
    # clipped to the model's context (512 tokens for tiny-llama): with rose-run's default
    # (--fit-lengths off) 73% of the sample's requests are rejected on arrival
    rose_args = ["--device", "cpu", "--model", args.model, "--workload", "azure-conv-sample",
                 "--num-requests", str(args.num_requests), "--request-rate", "inf",
                 "--fit-lengths", "clip", *rest]  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                runs[mode].append(one_run(mode, rose_args, Path(tmp) / f"{mode}-{i}.json"))
    print(f"rose-run {' '.join(rose_args)}; {args.rounds} runs per mode; "
          f"{platform.machine()}, Python {platform.python_version()}")  # fmt: skip
    print("| heap | full collections | longest pause (ms) | all collections (ms) | duration (s) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        col = {f: [r[f] for r in runs[mode]] for f in FIELDS}
        print(f"| {mode} | {span(col['gc_full_collections'])} | "
              f"{span(col['gc_pause_max_s'], 1e3)} | {span(col['gc_pause_s'], 1e3)} | "
              f"{span(col['duration'], digits=1)} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
