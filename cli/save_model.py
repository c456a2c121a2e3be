"""``rose-run save-model --model NAME --output DIR``: a built-in model's random weights and
its synthetic tokenizer as a transformers model directory.

No weights can be downloaded on the machines this project is tested on, so a peer engine
(vLLM's ``vllm serve DIR``, transformers' ``from_pretrained(DIR)``) gets the same random
model ``rose-run --model NAME --seed N`` runs, from a directory: ``save_pretrained`` of the
model and of the synthetic word tokenizer (:mod:`roseinfer.serve.tokenizer`: token ``i`` is
the word ``t<i>``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from roseinfer.argtypes import int_in
from roseinfer.cli.executor_flags import require_extra
from roseinfer.cli.flags import MAX_SEED, ArgumentParser, CliError, friendly_errors

PROG = "rose-run save-model"
DTYPES = ("float32", "bfloat16", "float16")


def save_model_parser() -> argparse.ArgumentParser:
    """The flags of ``rose-run save-model``."""
    parser = ArgumentParser(
        prog=PROG,
        description="Write a built-in model (random weights) and its synthetic tokenizer to a "
        "directory that transformers and vLLM load (`vllm serve DIR`).",
    )
    parser.add_argument("--model", default="gpt2", help="a built-in model name (default gpt2)")
    parser.add_argument(
        "--output", type=Path, required=True, help="the directory to write (new or empty)"
    )
    parser.add_argument(
        "--seed", type=int_in(0, MAX_SEED), default=0, help="seed of the random weights (0)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype")
    return parser


def check_output_dir(path: Path) -> None:
    """Refuse an output that is a file, a non-empty directory, or under a missing folder.

    Raises:
        CliError: one line naming ``--output`` and the fix.
    """
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise CliError(f"--output {path} exists and is not an empty directory; name a new one")
    if not path.parent.is_dir():
        raise CliError(f"--output {path}: folder {path.parent} does not exist; create it first")


def save_model_main(argv: list[str]) -> int:
    """``rose-run save-model``: returns the exit code (2 with one error line)."""
    args = save_model_parser().parse_args(argv)
    with friendly_errors(PROG):
        check_output_dir(args.output)
        require_extra(PROG, "executor", ("torch", "transformers"))
        _save(args)
    return 0


def _save(args: argparse.Namespace) -> None:
    import torch

    from roseinfer.executor.models import BUILTIN_MODELS, build_model
    from roseinfer.serve.tokenizer import save_synthetic_tokenizer

    if args.model not in BUILTIN_MODELS:
        raise CliError(
            f"--model {args.model[:60]!r} is not a built-in model; use one of "
            f"{', '.join(BUILTIN_MODELS)} (a directory is already a model)"
        )
    dtype = getattr(torch, args.dtype)
    model, config, _ = build_model(args.model, seed=args.seed, dtype=dtype, device="cpu")
    model.save_pretrained(args.output)
    eos = getattr(config, "eos_token_id", None)
    save_synthetic_tokenizer(args.output, int(config.vocab_size), eos)
    print(f"{PROG}: wrote {args.model} (seed {args.seed}, {args.dtype}) to {args.output}",
          file=sys.stderr)  # fmt: skip
