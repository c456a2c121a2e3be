"""vLLM offline worker for ``executor_vs_hf.py`` (runs in vLLM's own venv).

Not a benchmark by itself and imports nothing of roseinfer: the parent starts
it as ``VLLM_PYTHON _vllm_worker.py MODEL_DIR MAX_MODEL_LEN MAX_NUM_SEQS KV_BYTES`` and
talks over stdin/stdout, one JSON object per line:

* parent -> worker: ``{"requests": [[prompt_token_ids, output_tokens], ...]}``
  runs them all at once with ``LLM.generate`` (token-id prompts, greedy,
  ``ignore_eos``, ``min_tokens = max_tokens`` = the request's output length),
  after emptying vLLM's prefix cache (rounds repeat the same prompts; the other
  systems start each round with an empty cache too);
  ``{"quit": true}`` ends the worker.
* worker -> parent: a line ``@@RESULT {"wall_s": ..., "outputs": [[ids], ...]}``
  (vLLM's own logs go to stdout too; the parent reads only ``@@RESULT`` lines).
  The first such line, ``{"ready": true, "startup_s": ...}``, comes once the
  engine is built.

The model directory holds the same random GPT-2 weights as the parent's model
(``save_pretrained``); ``skip_tokenizer_init=True``, so no tokenizer is needed.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model_dir, max_model_len, max_num_seqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv_bytes = int(sys.argv[4])
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=0,
        kv_cache_memory_bytes=kv_bytes,
    )
    reply({"ready": True, "startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in msg["requests"]]
        params = [
            SamplingParams(
                max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False
            )
            for _, n in msg["requests"]
        ]
        llm.reset_prefix_cache()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        reply({"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs]})


def reply(obj: dict) -> None:
    print("@@RESULT " + json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
