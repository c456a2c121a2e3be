"""Write a transformers checkpoint with random weights for a published config.

``rose-run --model DIR`` loads it; the shape is all a timing needs. The configs
are the published ``config.json`` values (source beside each).

    python benchmarks/gpu/random_checkpoint.py llama-3.2-3b OUT_DIR --device cuda
"""

from __future__ import annotations

import argparse

# huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json (rope scaling left out:
# it does not change a step's cost).
CONFIGS = {
    "llama-3.2-3b": {
        "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "bos_token_id": None, "eos_token_id": None,
    },
}  # fmt: skip


def main() -> None:
    """Build the model from its config on ``--device`` in bf16 and save it."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(CONFIGS))
    p.add_argument("output")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, help="fewer layers (a quick check of this script)")
    args = p.parse_args()
    doc = {k: v for k, v in CONFIGS[args.name].items() if k != "model_type"}
    if args.layers:
        doc["num_hidden_layers"] = args.layers
    config = LlamaConfig(**doc)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.output)


if __name__ == "__main__":
    main()
