"""``rose-serve``: serve a model over HTTP with an OpenAI-compatible API.

Takes ``rose-run``'s policy, scheduler and executor flags. Examples::

    rose-serve --model tiny-gpt2 --device cpu --port 8000
    rose-serve --model gpt2 --device cpu --policy pack --prefill-max-tokens 512 \\
        --max-waiting 256 --save-records serve_records.csv
    curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8}'

Built-in models have random weights and no tokenizer: their text is the
synthetic word vocabulary of :mod:`roseinfer.serve.tokenizer` (token ``i`` is
the word ``t<i>``), or use ``--tokenizer DIR`` with a tokenizer saved locally.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see roseinfer.executor.cli

import torch  # noqa: E402

from roseinfer.calibration.steplog import StepRecorder  # noqa: E402
from roseinfer.cli import (  # noqa: E402
    MAX_SEED,
    ArgumentParser,
    CliError,
    add_engine_args,
    config_facts,
    int_in,
    policy_options,
    run_main,
)
from roseinfer.executor.cli import (  # noqa: E402
    DTYPES,
    _warm_up,
    add_model_args,
    build_runner,
    resolve_device,
    set_num_threads,
)
from roseinfer.executor.engine import Engine  # noqa: E402
from roseinfer.executor.facts import model_spec_of, step_log_recorder  # noqa: E402
from roseinfer.executor.models import build_model  # noqa: E402
from roseinfer.executor.streaming import StreamingEngine  # noqa: E402
from roseinfer.registry import Registry  # noqa: E402

DEFAULT_MAX_WAITING = 1024  # requests queued before 503s (bounded, unlike an open queue)


def build_parser() -> argparse.ArgumentParser:
    """The ``rose-serve`` argument parser."""
    parser = ArgumentParser(
        prog="rose-serve",
        description="Serve a model with an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) over the shared scheduler.",
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("--served-model-name", help="model name in the API (default: --model)")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help=f"requests waiting for admission before new ones get 503 (default {DEFAULT_MAX_WAITING})",
    )
    g.add_argument(
        "--tokenizer",
        help="a local tokenizer directory, or 'synthetic' (default: the model directory's "
        "tokenizer, else synthetic: token i is the word t<i>)",
    )
    g.add_argument("--save-records", help="write per-request records at shutdown (.csv/.parquet)")
    g.add_argument(
        "--save-steps",
        type=Path,
        metavar="FILE.jsonl",
        help="write every executed step as a step log while serving (JSON lines; "
        "`rose-sim --cost-model FILE.jsonl` calibrates from it)",
    )
    g.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    add_engine_args(parser)
    _add_executor_args(parser.add_argument_group("executor"))
    parser.set_defaults(prefix_caching_hash_algo="sha256")  # clients' prompts: collision-resistant
    return parser


def _add_executor_args(g: argparse._ArgumentGroup) -> None:
    add_model_args(g)
    g.add_argument(
        "--seed",
        type=int_in(0, MAX_SEED),
        default=0,
        help="weights of built-ins, sampling (default 0)",
    )


def build_engine(args: argparse.Namespace, registry: Registry) -> tuple[StreamingEngine, object]:
    """The streaming engine the flags describe, and the model's config.

    Raises:
        CliError: on a bad flag.
    """
    from roseinfer.serve.tokenizer import load_tokenizer

    device = resolve_device(args.device)
    set_num_threads(args.num_threads)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    policy_options(args, registry)
    model, config, model_tokenizer = build_model(
        args.model, seed=args.seed, dtype=dtype, device=device
    )
    tokenizer = load_tokenizer(args.tokenizer, model_tokenizer, config)
    sched_config, runner = build_runner(args, registry, model, config, device, dtype)
    if not args.no_warmup:
        _warm_up(runner, sched_config)
    recorder = None
    if args.save_steps is not None:
        recorder = step_log_recorder(
            args.save_steps, backend="rose-serve", model_name=args.model,
            model_spec=model_spec_of(args.model, config, dtype), runner=runner,
            config=sched_config, max_num_batched_tokens=sched_config.max_num_batched_tokens,
            fit_lengths="off", scheduler_facts=config_facts(sched_config),
        )  # fmt: skip
    engine = Engine(runner, sched_config, registry, seed=args.seed, on_step=recorder)
    return StreamingEngine(engine, tokenizer, max_waiting=args.max_waiting), config


def _serve(args: argparse.Namespace, registry: Registry) -> None:
    import uvicorn

    from roseinfer.serve.app import ServerState, build_app
    from roseinfer.serve.metrics import ServerMetrics
    from roseinfer.serve.protocol import ModelContext

    se, config = build_engine(args, registry)
    ctx = ModelContext(
        name=args.served_model_name or args.model,
        tokenizer=se.tokenizer,
        vocab_size=int(config.vocab_size),  # type: ignore[attr-defined]
        max_model_len=se.engine.scheduler.config.max_model_len,
    )
    app = build_app(ServerState(se, ctx, ServerMetrics(se)), lambda: _save_outputs(args, se))
    print(
        f"rose-serve: {ctx.name} on {se.engine.runner.device}, policy {se.engine.policy.label}, "
        f"{se.engine.scheduler.config.num_kv_blocks} KV blocks, http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def check_serve_args(args: argparse.Namespace, registry: Registry) -> None:
    """Every check that needs no model (before torch work): ``--max-waiting``,
    the KV pool flags, policy knobs, the device, the records path.

    Raises:
        CliError: naming the flag and the fix.
    """
    if args.max_waiting < 1:
        raise CliError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")
    policy_options(args, registry)
    resolve_device(args.device)
    _check_output_paths(args)


def _check_output_paths(args: argparse.Namespace) -> None:
    from roseinfer.metrics.io import RECORD_SUFFIXES, check_output_path

    try:
        if args.save_records is not None:
            check_output_path(Path(args.save_records), "--save-records", RECORD_SUFFIXES)
        if args.save_steps is not None:
            check_output_path(args.save_steps, "--save-steps", (".jsonl",))
    except ValueError as err:
        raise CliError(str(err)) from None


def _save_outputs(args: argparse.Namespace, se: StreamingEngine) -> None:
    """At shutdown: close the step log, write the records."""
    recorder = se.engine.on_step
    if isinstance(recorder, StepRecorder) and recorder.writer is not None:
        recorder.writer.close()
        print(f"rose-serve: wrote {recorder.writer.num_steps} steps to {args.save_steps}",
              file=sys.stderr)  # fmt: skip
    if args.save_records is None:
        return
    from roseinfer.metrics import write_records

    records = se.engine.records.frame().drop(columns=["prompt_token_ids", "output_token_ids"])
    write_records(records, Path(args.save_records))
    print(f"rose-serve: wrote {len(records)} records to {args.save_records}", file=sys.stderr)


def main() -> int:
    """Entry point of ``rose-serve``."""
    torch.set_grad_enabled(False)
    return run_main("rose-serve", build_parser(), _serve, check_serve_args)


if __name__ == "__main__":
    raise SystemExit(main())
