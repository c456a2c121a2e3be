"""Another checkout's roseinfer as a worker for ``executor_vs_hf.py --baseline-python``.

Not a benchmark by itself. The parent starts it with the python of a venv where
another checkout of roseinfer is installed (a release to compare with) as
``BASE_PYTHON _rose_worker.py THREADS BACKEND``, and talks over stdin/stdout, one
JSON object per line, as with ``_vllm_worker.py``:

* parent -> worker: ``{"requests": [[request_id, prompt_token_ids, output_tokens],
  ...]}`` runs them all at t=0 through that checkout's own ``Rose`` system (the
  ``Rose`` class of *its* ``benchmarks/executor_vs_hf.py``: its runner and
  scheduler limits as that checkout set them, run by its own ``Engine``), built
  once per distinct workload and kept, as the parent keeps its own;
  ``{"quit": true}`` ends the worker.
* worker -> parent: ``@@RESULT {"wall_s": ..., "outputs": [[ids], ...],
  "startup_s": ...}`` (``startup_s``: building that workload's runner, not
  counted in ``wall_s``). The first line, ``{"ready": true, "checkout": ...,
  "startup_s": ...}``, comes once the model is built and warmed up as the
  parent's warm-up does (four short requests through roseinfer, then through
  transformers' ``generate()``), so both processes start the rounds alike.

The model is the checkout's own ``build_model("gpt2", seed=0)`` in float32 on the
CPU: the same random weights as the parent's when both checkouts build them the
same way, which the parent checks by comparing greedy outputs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path


def load_bench(checkout: Path):
    """That checkout's ``benchmarks/executor_vs_hf.py`` as a module (its
    ``_common`` import resolves in its own ``benchmarks/``)."""
    bench_dir = checkout / "benchmarks"
    sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location(
        "base_executor_vs_hf", bench_dir / "executor_vs_hf.py"
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"_rose_worker: no benchmarks/executor_vs_hf.py in {checkout}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    threads, backend = int(sys.argv[1]), sys.argv[2]
    t0 = time.perf_counter()
    import roseinfer

    checkout = Path(roseinfer.__file__).resolve().parent.parent
    bench = load_bench(checkout)
    import torch

    from roseinfer.executor.models import build_model
    from roseinfer.request import Request

    bench.set_threads(threads)
    device, dtype = torch.device("cpu"), torch.float32
    model, _cfg, _tok = build_model("gpt2", seed=0, dtype=dtype, device=device)
    warm = [Request(f"warm-{i}", 0.0, 16, 4, tuple(range(100 + i, 116 + i))) for i in range(4)]
    run(bench.Rose(model, warm, device, dtype, backend), warm)
    bench.hf_static(model, warm, 4, device)  # as the parent's warm-up does
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    reply(
        {
            "ready": True,
            "checkout": f"{checkout} @ {commit or '?'}",
            "startup_s": time.perf_counter() - t0,
        }
    )
    systems: dict[tuple, object] = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        reqs = [Request(rid, 0.0, len(ids), n, tuple(ids)) for rid, ids, n in msg["requests"]]
        key = tuple((r.request_id, r.num_prompt_tokens, r.max_output_tokens) for r in reqs)
        startup = 0.0
        if key not in systems:
            t = time.perf_counter()
            systems[key] = bench.Rose(model, reqs, device, dtype, backend)
            startup = time.perf_counter() - t
        wall_s, outs = run(systems[key], reqs)
        reply({"wall_s": wall_s, "outputs": outs, "startup_s": startup})


def run(rose, reqs) -> tuple[float, list[list[int]]]:
    """One run of ``reqs`` on that checkout's engine over the system's runner:
    wall seconds and each request's output ids (read from the run's records,
    whose columns every checkout since the executor has; 9ded1cb's own
    ``Rose.run`` reads ``res.scheduler.seqs``, which its scheduler no longer had)."""
    from roseinfer.executor.engine import Engine

    engine = Engine(rose.runner, rose.config, seed=0)
    t0 = time.perf_counter()
    res = engine.run(reqs)
    wall_s = time.perf_counter() - t0
    records = res.records
    by_id = {rid: list(ids) for rid, ids in zip(records["request_id"], records["output_token_ids"])}
    return wall_s, [by_id.get(r.request_id, []) for r in reqs]


def reply(obj: dict) -> None:
    print("@@RESULT " + json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
