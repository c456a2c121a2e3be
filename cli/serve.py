"""``rose-serve``: serve a model over HTTP with an OpenAI-compatible API.

Takes ``rose-run``'s policy, scheduler and executor flags. Examples::

    rose-serve --model tiny-gpt2 --device cpu --port 8000
    rose-serve --model gpt2 --device cpu --policy pack --prefill-max-tokens 512 \\
        --max-waiting 256 --save-records serve_records.csv
    curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8}'

Built-in models have random weights and no tokenizer: their text is the
synthetic word vocabulary of :mod:`roseinfer.serve.tokenizer` (token ``i`` is
the word ``t<i>``), or use ``--tokenizer DIR`` with a tokenizer saved locally.

Every flag is checked before any model work (the address is bound once as a
probe; a KV pool that cannot hold one request of ``--max-model-len`` is
refused, as vLLM refuses to start). Records are written as requests end
(``--save-records``), so memory stays flat however long the server runs. If the
engine fails (a policy raises), every open stream gets the error and the
process exits with status 1 and one ``rose-serve: error:`` line, for a
supervisor to restart it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roseinfer.cli.config import check_engine_args, check_output_paths
from roseinfer.cli.executor_flags import (
    EXECUTOR_HELP,
    add_model_args,
    build,
    check_device_name,
    require_extra,
    step_recorder,
)
from roseinfer.cli.flags import (
    POSITIVE,
    ArgumentParser,
    CliError,
    add_flag,
    add_quiet_args,
    float_in,
    int_in,
    run_main,
    say_to,
    warn_to,
)
from roseinfer.cli.groups import add_engine_args
from roseinfer.interface import PolicyOptions
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION
from roseinfer.registry import Registry
from roseinfer.serve.protocol import DEFAULT_TIMEOUT_REQUEST_BODY_S
from roseinfer.serve.server import check_listen, run_server

if TYPE_CHECKING:
    from roseinfer.executor.streaming import StreamingEngine

PROG = "rose-serve"
DEFAULT_MAX_WAITING = 1024  # requests queued before 503s (bounded, unlike an open queue)
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5  # uvicorn's default; a request head takes milliseconds
CONCURRENCY_SLACK = 64  # connections beyond queued + running requests: /health, /metrics, refusals
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
SERVE_MODULES = ("torch", "transformers", "fastapi", "uvicorn", "prometheus_client")


def build_parser(registry: Registry | None = None) -> argparse.ArgumentParser:
    """The ``rose-serve`` argument parser (one flag per option ``registry``'s plugins
    declare; None: the installed plugins)."""
    parser = ArgumentParser(
        prog=PROG,
        description="Serve a model with an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) over the shared scheduler.",
    )
    _add_server_args(parser.add_argument_group("server"))
    _add_limit_args(parser.add_argument_group("limits (a public endpoint)"))
    add_engine_args(parser, registry)
    g = parser.add_argument_group("executor", EXECUTOR_HELP)
    add_model_args(g)
    add_flag(g, "--seed")
    add_quiet_args(parser, summary=False)
    parser.set_defaults(prefix_caching_hash_algo="sha256")  # clients' prompts: collision-resistant
    return parser


def _add_server_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int_in(1, 65535), default=8000, help="port (default 8000)")
    g.add_argument("--served-model-name", help="model name in the API (default: --model)")
    g.add_argument("--max-waiting", metavar="N", type=POSITIVE, default=DEFAULT_MAX_WAITING,
                   help="requests waiting for admission before new ones get 503 (default "
                   f"{DEFAULT_MAX_WAITING})")  # fmt: skip
    g.add_argument(
        "--tokenizer",
        help="a local tokenizer directory, or 'synthetic' (default: the model directory's "
        "tokenizer, else synthetic: token i is the word t<i>)",
    )
    add_flag(g, "--save-records", help="append per-request records to this file as requests "
             "end (.csv; .parquet: one row group per batch, readable after shutdown)")  # fmt: skip
    add_flag(g, "--save-steps", help="write every executed step as a step log while serving "
             "(JSON lines; `rose-sim --cost-model FILE.jsonl` calibrates from it)")  # fmt: skip
    g.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                   help="uvicorn log level (default warning)")  # fmt: skip
    g.add_argument(
        "--docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (off by default: their pages load "
        "Swagger UI and ReDoc from a CDN)",
    )


def _add_limit_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-request-bytes", metavar="BYTES", type=int_in(1024), help="largest "
                   "request body (bytes; larger gets 413 as it arrives). Default: room for a "
                   "prompt of max_model_len x 32 characters, each JSON-escaped (6 bytes), plus "
                   "1 MiB")  # fmt: skip
    g.add_argument("--timeout-keep-alive", metavar="S", type=int_in(1, 3600),
                   default=DEFAULT_TIMEOUT_KEEP_ALIVE_S, help="close a connection with no "
                   "request in progress after this many seconds (of opening, or of its last "
                   "response), even if it trickles bytes (default "
                   f"{DEFAULT_TIMEOUT_KEEP_ALIVE_S}, uvicorn's)")  # fmt: skip
    g.add_argument("--timeout-request-body", metavar="S", type=float_in(0, 3600, lo_open=True),
                   default=DEFAULT_TIMEOUT_REQUEST_BODY_S, help="seconds a request body may "
                   f"take to arrive (408 after; default {DEFAULT_TIMEOUT_REQUEST_BODY_S:g})")  # fmt: skip
    g.add_argument("--limit-concurrency", metavar="N", type=POSITIVE, help="most requests in "
                   "flight at once (streams included); more get a JSON 503, counted as "
                   "refused_503; idle connections do not count (default: --max-waiting + "
                   f"--max-num-seqs + {CONCURRENCY_SLACK})")  # fmt: skip


def check_serve_args(args: argparse.Namespace, registry: Registry) -> PolicyOptions:
    """Every check that needs no model or torch: the extra installed, the policy and
    KV pool flags, the device's spelling, the tokenizer directory, the output paths
    (in folders that exist), and the address (bound once as a probe).

    Returns:
        The run's policy knobs.

    Raises:
        CliError: naming the flag and the fix.
    """
    require_extra(PROG, "serve", SERVE_MODULES)
    if (
        registry.policy(args.policy).uses_length_predictor
        and getattr(args, "length_predictor", None) is None
    ):
        # NOTE: a server has no workload to fit rose-sim's default (bucket) on; a
        # request's max_tokens is what it declares, so oracle is the default here
        args.length_predictor = "oracle"
        warn_to(PROG)(
            f"--policy {args.policy} ranks by the oracle length predictor, the default in a "
            "server: each request's max_tokens (give --length-predictor to change it)"
        )
    options = check_engine_args(args, registry)
    _warn_unfitted_predictor(args.policy, options, registry)
    check_device_name(args.device)
    if args.tokenizer not in (None, "synthetic") and not Path(args.tokenizer).is_dir():
        raise CliError(
            f"--tokenizer {args.tokenizer!r} is not a directory; give a local directory saved "
            "with transformers (save_pretrained), or 'synthetic' (downloads are not possible)"
        )
    check_output_paths(args, ("save_records", "save_steps"))
    check_listen(args.host, args.port)
    return options


def _warn_unfitted_predictor(policy: str, options: PolicyOptions, registry: Registry) -> None:
    """A length-aware policy on the ``bucket`` predictor in a server: ``bucket`` is
    fitted on a workload's first requests, which a server does not have up front,
    so it predicts one constant and the policy runs as FIFO. Say so once."""
    if not registry.policy(policy).uses_length_predictor:
        return
    predictor = str(options.get("length_predictor", LENGTH_PREDICTOR_OPTION.default))
    if predictor == "bucket":
        warn_to(PROG)(
            f"--policy {policy} ranks by the bucket length predictor, which a server cannot "
            "fit (no workload up front): every request gets one prediction and the policy "
            "runs as FIFO; give --length-predictor oracle to rank by each request's "
            "max_tokens, or a predictor plugin"
        )


def build_engine(
    args: argparse.Namespace, registry: Registry, options: PolicyOptions
) -> tuple[StreamingEngine, Any]:
    """The streaming engine the flags describe, and the model's config.

    Raises:
        CliError / BuildError: on a bad flag.
    """
    import torch

    from roseinfer.executor.engine import Engine
    from roseinfer.executor.streaming import StreamingEngine
    from roseinfer.records import RecordFileWriter
    from roseinfer.serve.tokenizer import load_tokenizer

    torch.set_grad_enabled(False)
    built = build(args, registry, options, say_to(PROG, args.quiet))
    loaded, config, runner = built.loaded, built.config, built.runner
    tokenizer = load_tokenizer(args.tokenizer, loaded.tokenizer, loaded.hf_config)
    recorder = step_recorder(args, built, PROG, "off")
    records = RecordFileWriter(args.save_records) if args.save_records is not None else None
    engine = Engine(runner, config, registry, seed=args.seed, on_step=recorder)
    se = StreamingEngine(
        engine, tokenizer, max_waiting=args.max_waiting, keep_records=False, record_sink=records
    )
    return se, loaded.hf_config


def _serve(args: argparse.Namespace, registry: Registry, options: PolicyOptions) -> None:
    se, hf_config = build_engine(args, registry, options)
    import uvicorn

    from roseinfer.serve.app import ServerState, build_app
    from roseinfer.serve.metrics import ServerMetrics
    from roseinfer.serve.protocol import ModelContext

    config = se.engine.scheduler.config
    ctx = ModelContext(
        name=args.served_model_name or args.model, tokenizer=se.tokenizer,
        vocab_size=int(hf_config.vocab_size), max_model_len=config.max_model_len,
    )  # fmt: skip
    app = build_app(
        ServerState(se, ctx, ServerMetrics(se)), lambda: _save_outputs(args, se),
        max_request_bytes=args.max_request_bytes,
        timeout_request_body_s=args.timeout_request_body, docs=args.docs,
    )  # fmt: skip
    server = uvicorn.Server(uvicorn_config(args, app, config.max_num_seqs))
    print(
        f"{PROG}: {ctx.name} on {se.engine.runner.device}, policy {se.engine.policy.label}, "
        f"{config.num_kv_blocks} KV blocks, http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    status = run_server(server, se)
    if status:
        raise SystemExit(status)


def uvicorn_config(args: argparse.Namespace, app: Any, max_num_seqs: int) -> Any:
    """The ``uvicorn.Config`` of ``app`` the flags describe (``--limit-concurrency``
    defaults to ``--max-waiting`` + ``max_num_seqs`` + :data:`CONCURRENCY_SLACK`)."""
    from roseinfer.serve.app import server_config

    limit = args.limit_concurrency or args.max_waiting + max_num_seqs + CONCURRENCY_SLACK
    return server_config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_keep_alive_s=args.timeout_keep_alive, limit_concurrency=limit,
    )  # fmt: skip


def _save_outputs(args: argparse.Namespace, se: StreamingEngine) -> None:
    """At shutdown (after the engine closed): close the step log and the records
    file (the engine wrote the records as requests ended)."""
    from roseinfer.calibration.steplog import StepRecorder
    from roseinfer.records import RecordFileWriter

    recorder = se.engine.on_step
    if isinstance(recorder, StepRecorder) and recorder.writer is not None:
        recorder.writer.close()
        print(f"{PROG}: wrote {recorder.writer.num_steps} steps to {args.save_steps}",
              file=sys.stderr)  # fmt: skip
    records = se.record_sink
    if isinstance(records, RecordFileWriter):
        records.close()
        print(f"{PROG}: wrote {records.num_rows} records to {records.path}", file=sys.stderr)


def main() -> int:
    """Entry point of ``rose-serve``."""
    return run_main(PROG, build_parser(), check_serve_args, _serve)


if __name__ == "__main__":
    raise SystemExit(main())
