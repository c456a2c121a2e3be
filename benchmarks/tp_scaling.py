"""How latency moves with tensor-parallel size: rose-sim next to a published measurement.

Published: NVIDIA NeMo Framework inference performance, Llama-2 "chatbot" case
(TensorRT-LLM, H100 80GB HBM3, batch size 1, 128 input and 20 output tokens,
average end-to-end latency in ms; docs.nvidia.com/nemo-framework/user-guide/latest/
performance/llama.html): Llama-2-7B at TP 1/2/4/8 = 153.8 / 128.6 / 107.4 / 97.6 ms.

rose-sim: the same request (one at a time, so batch size 1) on the Llama-2-7B
shape (its Hugging Face config.json numbers, bf16) on h100-sxm with
``--tensor-parallel-size`` 1/2/4/8 over NVLink 4, the roofline cost model. Also
Llama-3.1-70B on H200 (the README's example; it needs TP >= 2) for 2,000 Azure
conv requests at Poisson 2 req/s: p50 TTFT and TPOT by TP size.

    python benchmarks/tp_scaling.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from roseinfer import workloads

LLAMA2_7B = {  # huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}  # fmt: skip
PUBLISHED_7B_MS = {1: 153.8, 2: 128.6, 4: 107.4, 8: 97.6}
TRACE = "azure-conv-2023"  # a public trace, fetched and cached on first use


def rose_sim(*args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        subprocess.run(
            ["rose-sim", *args, "--quiet", "--no-summary", "--save-result", str(out)], check=True
        )
        return json.loads(out.read_text())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "llama-2-7b.json"
        config.write_text(json.dumps(LLAMA2_7B))
        trace = Path(tmp) / "one.csv"
        trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,128,20\n")
        print("Llama-2-7B, H100, batch 1, 128 in / 20 out: end-to-end latency (ms)")
        print(f"{'TP':>3} {'rose-sim':>9} {'published':>10} {'sim/pub':>8}")
        for tp, published in PUBLISHED_7B_MS.items():
            r = rose_sim("--trace", str(trace), "--model", str(config), "--hardware", "h100-sxm",
                         "--tensor-parallel-size", str(tp))  # fmt: skip
            sim = r["mean_e2el_ms"]
            print(f"{tp:>3} {sim:>9.1f} {published:>10.1f} {sim / published:>8.2f}")
    try:
        trace = workloads.resolve_trace(TRACE)
    except workloads.WorkloadError as err:
        print(f"\nskipped the Llama-3.1-70B table: {err}", file=sys.stderr)
        return
    print("\nLlama-3.1-70B, H200, 2,000 Azure conv requests at Poisson 2 req/s, budget 2048")
    print(f"{'TP':>3} {'p50 TTFT ms':>12} {'p50 TPOT ms':>12} {'KV blocks':>10}")
    for tp in (2, 4, 8):
        r = rose_sim("--trace", str(trace), "--num-requests", "2000", "--request-rate", "2",
                     "--policy", "budget", "--prefill-max-tokens", "2048", "--model",
                     "llama-3.1-70b", "--hardware", "h200", "--tensor-parallel-size", str(tp))  # fmt: skip
        print(f"{tp:>3} {r['median_ttft_ms']:>12.1f} {r['median_tpot_ms']:>12.2f} "
              f"{r['num_kv_blocks']:>10}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
