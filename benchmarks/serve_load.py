"""Bounded load on ``rose-serve``: hundreds of concurrent streaming clients.

Starts ``rose-serve`` (tiny GPT-2, random weights, CPU) with a bounded waiting
queue, then runs ``--clients`` concurrent clients for ``--duration-s`` seconds;
each sends streaming completions one after another, and a share of them
(``--disconnect-share``) leaves mid-stream after a few chunks. At the end it
prints how many requests were answered (200, streamed to [DONE]), refused (503,
queue full), cut by the client, or failed otherwise, then asserts that every
request ended with a status, that the server holds 0 KV blocks and no request,
and that it still answers. Exit code 1 if an assertion fails.

    python benchmarks/serve_load.py --clients 300 --duration-s 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve_common import ServeProcess  # noqa: E402

MODEL = "tiny-gpt2"


async def client(
    http: httpx.AsyncClient, url: str, rng: random.Random, until: float, share: float, counts
) -> None:
    """Send streaming requests until ``until`` (monotonic s); tally each outcome."""
    while time.monotonic() < until:
        body = {
            "model": MODEL,
            "prompt": [rng.randrange(999) for _ in range(rng.randint(4, 64))],
            "max_tokens": rng.randint(8, 96),
            "temperature": rng.choice([0.0, 0.8]),
            "stream": True,
            "ignore_eos": True,
        }
        leave_after = rng.randint(1, 6) if rng.random() < share else None
        try:
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    counts[f"refused_{r.status_code}"] += 1
                    await r.aread()
                    await asyncio.sleep(0.05)  # a refused client backs off a little
                    continue
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")
                    done = done or line == "data: [DONE]"
                    if leave_after is not None and chunks >= leave_after:
                        break
                counts["answered" if done else "disconnected"] += 1
        except httpx.HTTPError as err:
            counts[f"error_{type(err).__name__}"] += 1


async def load(url: str, args: argparse.Namespace) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    # NOTE: a fresh connection per request: a pooled keep-alive connection that uvicorn
    # closes after 5 s idle can be picked up at that moment (a client-side ReadError).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.duration_s + 120)
    until = time.monotonic() + args.duration_s
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        await asyncio.gather(
            *(
                client(http, url, random.Random(i), until, args.disconnect_share, counts)
                for i in range(args.clients)
            )
        )
    return counts


def wait_drained(server: ServeProcess, timeout_s: float = 30.0) -> dict[str, float]:
    """Metrics once nothing runs or waits and no KV block is used (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        idle = m["roseinfer_num_requests_running"] == 0 and m["roseinfer_num_requests_waiting"] == 0
        if (idle and m["roseinfer_num_kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--disconnect-share", type=float, default=0.2)
    parser.add_argument("--max-waiting", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    if not 0 < args.duration_s <= 60:
        parser.error("--duration-s must be in (0, 60]: the load test is bounded")
    log = Path(tempfile.mkdtemp(prefix="serve_load_")) / "rose-serve.log"
    server = ServeProcess(
        ["--model", MODEL, "--device", "cpu", "--num-threads", "1", "--no-warmup",
         "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting)],
        log,
    )  # fmt: skip
    try:
        start = time.perf_counter()
        counts = asyncio.run(load(server.url, args))
        wall_s = time.perf_counter() - start
        m = wait_drained(server)
        still = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4},
            timeout=60,
        )
    finally:
        server.stop()
    total = sum(counts.values())
    print(f"serve_load: {args.clients} streaming clients for {args.duration_s:.0f} s "
          f"(wall {wall_s:.1f} s), {args.disconnect_share:.0%} leave mid-stream; "
          f"--max-num-seqs {args.max_num_seqs} --max-waiting {args.max_waiting}")  # fmt: skip
    print(f"requests: {total} = " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"server: kv blocks used {m['roseinfer_num_kv_blocks_used']:.0f}, running "
          f"{m['roseinfer_num_requests_running']:.0f}, waiting "
          f"{m['roseinfer_num_requests_waiting']:.0f}, preemptions "
          f"{m['roseinfer_num_preemptions_total']:.0f}; after: HTTP {still.status_code}")  # fmt: skip
    failures = [
        k
        for k in counts
        if k.startswith("error_") or k.startswith("refused_5") and k != "refused_503"
    ]
    ok = (
        not failures
        and m["roseinfer_num_kv_blocks_used"] == 0
        and m["roseinfer_num_requests_running"] == 0
        and still.status_code == 200
    )
    print("PASS" if ok else f"FAIL (unexpected outcomes: {failures})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
