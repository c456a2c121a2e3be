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
probe). Records are written as requests end (``--save-records``), so memory
stays flat however long the server runs. If the engine fails (a policy raises),
every open stream gets the error and the process exits with status 1 and one
``rose-serve: error:`` line, for a supervisor to restart it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see roseinfer.executor.cli

import torch  # noqa: E402

from roseinfer.calibration.steplog import StepRecorder  # noqa: E402
from roseinfer.cli import (  # noqa: E402
    POSITIVE,
    ArgumentParser,
    CliError,
    add_engine_args,
    add_flag,
    config_facts,
    float_in,
    int_in,
    policy_options,
    run_main,
    warn_to,
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
from roseinfer.interface import PolicyOptions  # noqa: E402
from roseinfer.prediction import LENGTH_PREDICTOR_OPTION  # noqa: E402
from roseinfer.records import RecordFileWriter  # noqa: E402
from roseinfer.registry import Registry  # noqa: E402
from roseinfer.serve.protocol import DEFAULT_TIMEOUT_REQUEST_BODY_S  # noqa: E402

DEFAULT_MAX_WAITING = 1024  # requests queued before 503s (bounded, unlike an open queue)
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5  # uvicorn's default; a request head takes milliseconds
CONCURRENCY_SLACK = 64  # connections beyond queued + running requests: /health, /metrics, refusals
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def build_parser(registry: Registry | None = None) -> argparse.ArgumentParser:
    """The ``rose-serve`` argument parser (one flag per option ``registry``'s plugins
    declare; None: the installed plugins)."""
    parser = ArgumentParser(
        prog="rose-serve",
        description="Serve a model with an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) over the shared scheduler.",
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int_in(1, 65535), default=8000, help="port (default 8000)")
    g.add_argument("--served-model-name", help="model name in the API (default: --model)")
    g.add_argument(
        "--max-waiting",
        metavar="N",
        type=POSITIVE,
        default=DEFAULT_MAX_WAITING,
        help=f"requests waiting for admission before new ones get 503 (default {DEFAULT_MAX_WAITING})",
    )
    g.add_argument(
        "--tokenizer",
        help="a local tokenizer directory, or 'synthetic' (default: the model directory's "
        "tokenizer, else synthetic: token i is the word t<i>)",
    )
    add_flag(
        g,
        "--save-records",
        help="append per-request records to this file as requests end (.csv; .parquet: one "
        "row group per batch, readable after shutdown)",
    )
    add_flag(
        g,
        "--save-steps",
        help="write every executed step as a step log while serving (JSON lines; "
        "`rose-sim --cost-model FILE.jsonl` calibrates from it)",
    )
    g.add_argument(
        "--log-level",
        default="warning",
        choices=LOG_LEVELS,
        help="uvicorn log level (default warning)",
    )
    g.add_argument(
        "--docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json (off by default: their pages load "
        "Swagger UI and ReDoc from a CDN)",
    )
    _add_limit_args(parser.add_argument_group("limits (a public endpoint)"))
    add_engine_args(parser, registry)
    _add_executor_args(parser.add_argument_group("executor"))
    parser.set_defaults(prefix_caching_hash_algo="sha256")  # clients' prompts: collision-resistant
    return parser


def _add_limit_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-request-bytes",
        metavar="BYTES",
        type=int_in(1024),
        help="largest request body (bytes; larger gets 413 as it arrives). Default: room for "
        "a prompt of max_model_len x 32 characters, each JSON-escaped (6 bytes), plus 1 MiB",
    )
    g.add_argument(
        "--timeout-keep-alive",
        metavar="S",
        type=int_in(1, 3600),
        default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
        help="close a connection with no request in progress after this many seconds (of "
        "opening, or of its last response), even if it trickles bytes (default "
        f"{DEFAULT_TIMEOUT_KEEP_ALIVE_S}, uvicorn's)",
    )
    g.add_argument(
        "--timeout-request-body",
        metavar="S",
        type=float_in(0, 3600, lo_open=True),
        default=DEFAULT_TIMEOUT_REQUEST_BODY_S,
        help="seconds a request body may take to arrive (408 after; default "
        f"{DEFAULT_TIMEOUT_REQUEST_BODY_S:g})",
    )
    g.add_argument(
        "--limit-concurrency",
        metavar="N",
        type=POSITIVE,
        help="most connections and requests at once; more get 503 (default: --max-waiting + "
        f"--max-num-seqs + {CONCURRENCY_SLACK})",
    )


def _add_executor_args(g: argparse._ArgumentGroup) -> None:
    add_model_args(g)
    add_flag(g, "--seed")


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
    records = RecordFileWriter(args.save_records) if args.save_records is not None else None
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
    se = StreamingEngine(
        engine, tokenizer, max_waiting=args.max_waiting, keep_records=False, record_sink=records
    )
    return se, config


def _serve(args: argparse.Namespace, registry: Registry) -> None:
    import uvicorn

    from roseinfer.serve.app import ServerState, build_app
    from roseinfer.serve.metrics import ServerMetrics
    from roseinfer.serve.protocol import ModelContext

    se, config = build_engine(args, registry)
    sched_config = se.engine.scheduler.config
    ctx = ModelContext(
        name=args.served_model_name or args.model,
        tokenizer=se.tokenizer,
        vocab_size=int(config.vocab_size),  # type: ignore[attr-defined]
        max_model_len=sched_config.max_model_len,
    )
    app = build_app(
        ServerState(se, ctx, ServerMetrics(se)),
        lambda: _save_outputs(args, se),
        max_request_bytes=args.max_request_bytes,
        timeout_request_body_s=args.timeout_request_body,
        docs=args.docs,
    )
    server = uvicorn.Server(uvicorn_config(args, app, sched_config.max_num_seqs))
    print(
        f"rose-serve: {ctx.name} on {se.engine.runner.device}, policy {se.engine.policy.label}, "
        f"{sched_config.num_kv_blocks} KV blocks, http://{args.host}:{args.port}",
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


def run_server(server: Any, se: StreamingEngine) -> int:
    """Serve until shutdown; returns the exit status: 0, or 1 when the engine failed
    (after one ``rose-serve: error:`` line).

    Args:
        server: a ``uvicorn.Server`` over the app serving ``se``.
    """

    # NOTE(engine faults): a policy that raises inside the scheduler may leave its
    # queues, KV accounting or its own state half-updated, so the engine does not go
    # on. The worker already ended every open stream with the error (clients see a
    # 503 or an error event) and aborted every request; the process then exits
    # non-zero so a supervisor restarts a clean server, instead of living on with
    # /health at 503 and every request refused.
    def stop(err: BaseException) -> None:
        server.should_exit = True

    se.on_fatal = stop
    server.run()
    err = se.error
    if err is None:
        return 0
    message = " ".join(f"{type(err).__name__}: {err}".splitlines())
    print(
        f"rose-serve: error: the engine failed ({message}); exiting with status 1 for a "
        "supervisor to restart the server",
        file=sys.stderr,
        flush=True,
    )
    return 1


def check_serve_args(args: argparse.Namespace, registry: Registry) -> None:
    """Every check that needs no model (before torch work): the address (bound
    once as a probe), the KV pool flags, policy knobs, the device, the tokenizer
    directory, the output paths.

    Raises:
        CliError: naming the flag and the fix.
    """
    if args.num_kv_blocks is not None and args.kv_cache_memory_gb is not None:
        raise CliError("give either --num-kv-blocks or --kv-cache-memory-gb, not both")
    if (
        registry.policy(args.policy).uses_length_predictor
        and getattr(args, "length_predictor", None) is None
    ):
        # NOTE: a server has no workload to fit rose-sim's default (bucket) on; a
        # request's max_tokens is what it declares, so oracle is the default here
        args.length_predictor = "oracle"
        warn_to("rose-serve")(
            f"--policy {args.policy} ranks by the oracle length predictor, the default in a "
            "server: each request's max_tokens (give --length-predictor to change it)"
        )
    options = policy_options(args, registry)
    _warn_unfitted_predictor(args.policy, options, registry)
    resolve_device(args.device)
    if args.tokenizer not in (None, "synthetic") and not Path(args.tokenizer).is_dir():
        raise CliError(
            f"--tokenizer {args.tokenizer!r} is not a directory; give a local directory saved "
            "with transformers (save_pretrained), or 'synthetic' (downloads are not possible)"
        )
    _check_output_paths(args)
    check_listen(args.host, args.port)


def _warn_unfitted_predictor(policy: str, options: PolicyOptions, registry: Registry) -> None:
    """A length-aware policy on the ``bucket`` predictor in a server: ``bucket`` is
    fitted on a workload's first requests, which a server does not have up front,
    so it predicts one constant and the policy runs as FIFO. Say so once."""
    if not registry.policy(policy).uses_length_predictor:
        return
    predictor = str(options.get("length_predictor", LENGTH_PREDICTOR_OPTION.default))
    if predictor == "bucket":
        warn_to("rose-serve")(
            f"--policy {policy} ranks by the bucket length predictor, which a server cannot "
            "fit (no workload up front): every request gets one prediction and the policy "
            "runs as FIFO; give --length-predictor oracle to rank by each request's "
            "max_tokens, or a predictor plugin"
        )


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so an address that cannot be served
    fails before the model loads.

    Raises:
        CliError: naming ``--host`` or ``--port`` and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise CliError(
            f"--host {host[:60]!r} is not an address: {err}; give an IP address of this "
            "machine (127.0.0.1: local clients only, 0.0.0.0: every interface) or its name"
        ) from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as err:
        raise CliError(
            f"cannot listen on --host {host} --port {port}: {err.strerror or err}; "
            "pick a free port, or an address of this machine"
        ) from None


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
    """At shutdown (after the engine closed): close the step log and the records
    file (the engine wrote the records as requests ended)."""
    recorder = se.engine.on_step
    if isinstance(recorder, StepRecorder) and recorder.writer is not None:
        recorder.writer.close()
        print(f"rose-serve: wrote {recorder.writer.num_steps} steps to {args.save_steps}",
              file=sys.stderr)  # fmt: skip
    records = se.record_sink
    if isinstance(records, RecordFileWriter):
        records.close()
        print(f"rose-serve: wrote {records.num_rows} records to {records.path}", file=sys.stderr)


def main() -> int:
    """Entry point of ``rose-serve``."""
    torch.set_grad_enabled(False)
    return run_main("rose-serve", build_parser(), _serve, check_serve_args)


if __name__ == "__main__":
    raise SystemExit(main())
