"""The FastAPI app: OpenAI routes over a :class:`StreamingEngine`.

Each request is added to the engine (503 when ``max_waiting`` requests wait,
400 naming a bad field) and its tokens are read with ``astream`` on the event
loop, so hundreds of streams need no thread each. A streamed answer sends one
SSE chunk per token (clients such as ``vllm bench serve`` time each chunk as a
token), then a usage chunk if asked (``stream_options.include_usage``) and
``data: [DONE]``. A task per request waits for the client's ``http.disconnect``
and aborts the request, which frees its KV blocks at the next step boundary.

As a public endpoint: a body over ``max_request_bytes`` is refused (413) before
or while it arrives, a body must arrive within ``timeout_request_body_s`` (408), and
JSON decoding, checking and tokenizing run on one parser thread, never on the
event loop, with the garbage collector paused (:func:`roseinfer.serve.protocol.parse_body`)
and the heap built before serving frozen (:func:`roseinfer.executor.gc_watch.frozen_heap`),
so one large request cannot stall ``/health`` or other streams. Every error is OpenAI's
JSON error object; none carries a traceback. Every answer to a completion route
is counted once in ``/metrics`` (``roseinfer_requests_total`` by outcome).
If the engine fails, bodies still arriving are answered 503 at once, so the
server exits without waiting for slow uploads.

:func:`server_config` adds what uvicorn lacks: a connection that has not sent a
complete request head within ``timeout_keep_alive`` seconds (of opening, or of
its previous response) is closed, even if it trickles bytes (slowloris); and
``limit_concurrency`` bounds the requests in flight (idle connections do not
count), answering more with a JSON 503 that ``/metrics`` counts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from roseinfer.executor.gc_watch import frozen_heap
from roseinfer.executor.streaming import (
    EngineClosedError,
    QueueFullError,
    RequestFailedError,
    RequestRejectedError,
    StreamingEngine,
)
from roseinfer.executor.validation import InvalidRequestError
from roseinfer.serve import protocol
from roseinfer.serve.metrics import ServerMetrics
from roseinfer.serve.protocol import (
    DEFAULT_TIMEOUT_REQUEST_BODY_S,
    ApiError,
    Generation,
    ModelContext,
)


@dataclass
class ServerState:
    """What the routes share: the engine, the served model, the metrics, and the
    thread that parses and tokenizes request bodies (one, as vLLM's tokenizer
    executor: a tokenizer is not safe to share between threads)."""

    engine: StreamingEngine
    model: ModelContext
    metrics: ServerMetrics
    parser: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rose-serve-parser")
    )
    engine_ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (from the lifespan's startup on) once the engine's worker has ended."""

    def count(self, outcome: str) -> None:
        """Count one answered request as ``outcome`` (``roseinfer_requests_total``)."""
        self.metrics.requests.labels(outcome).inc()


class _Run:
    """One request's output as the client sees it: text pieces (stop strings are
    applied by the engine), token count, finish reason, and the server's latency
    observations."""

    def __init__(self, state: ServerState, rid: str, gen: Generation, added_s: float) -> None:
        self.state, self.rid, self.gen = state, rid, gen
        self.stream = state.engine.astream(rid)
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.last_s = added_s
        self.added_s = added_s
        self.disconnected = False

    async def next(self) -> str | None:
        """The next token's text piece ("" while held back), or None at the end."""
        if self.finish_reason is not None:
            return None
        try:
            out = await anext(self.stream)
        except StopAsyncIteration:  # aborted: the client left
            return None
        metrics = self.state.metrics
        (metrics.itl if self.num_tokens else metrics.ttft).observe(out.time_s - self.last_s)
        self.num_tokens += 1
        self.last_s = out.time_s
        if out.finished:
            self.finish_reason = out.stop_reason or "length"
            metrics.e2el.observe(out.time_s - self.added_s)
        return out.text

    async def close(self, watcher: asyncio.Task[None]) -> None:
        """Stop watching, abort (no-op if it ended), count the outcome."""
        watcher.cancel()
        self.state.engine.abort(self.rid, discard=True)
        with suppress(Exception):
            await self.stream.aclose()
        self.state.count(self.finish_reason or ("aborted" if self.disconnected else "failed"))


async def _watch_disconnect(request: Request, run: _Run) -> None:
    """Abort the request when its client disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    run.disconnected = True
    run.state.engine.abort(run.rid, discard=True)


def _add(state: ServerState, gen: Generation) -> tuple[str, float]:
    """Add ``gen`` to the engine; returns its id and the engine time (s) it was added."""
    try:
        added_s = state.engine.engine.now()
        rid = state.engine.add_request(
            list(gen.prompt_ids), max_tokens=gen.max_tokens, sampling=gen.sampling, stop=gen.stop
        )
    except QueueFullError as err:
        raise ApiError(503, f"server busy: {err}") from None
    except EngineClosedError as err:
        raise ApiError(503, f"the engine is not running: {err}") from None
    except InvalidRequestError as err:
        raise protocol.bad(err.field, str(err).removeprefix(f"{err.field} ")) from None
    return rid, added_s


async def _completion(
    request: Request,
    parse: Callable[[Any, ModelContext], Generation],
    chat: bool,
    limits: tuple[int, float],
) -> Response:
    """Read, parse and add a request, then answer it. Counted once: by its
    status (``refused_<status>``, ``error_500``; ``aborted`` if the client left
    mid-body) when it never reaches the engine, else by how it ended (:class:`_Run`)."""
    state: ServerState = request.app.state.rose
    try:
        raw = await _read_body(request, *limits, state.engine_ended)
        gen = await _parse(state, parse, raw)
        rid, added_s = _add(state, gen)
    except ApiError as err:
        state.count(f"refused_{err.status}")
        raise
    except ClientDisconnect:
        state.count("aborted")
        raise
    except Exception:
        state.count("error_500")
        raise
    return await _generate(request, state, gen, chat, rid, added_s)


async def _generate(
    request: Request, state: ServerState, gen: Generation, chat: bool, rid: str, added_s: float
) -> Response:
    run = _Run(state, rid, gen, added_s)
    watcher = asyncio.create_task(_watch_disconnect(request, run))
    try:
        first = await run.next()
    except _ENGINE_ERRORS as err:
        await run.close(watcher)
        raise _api_error(err) from None
    except BaseException:
        await run.close(watcher)
        raise
    if gen.stream:
        events = _sse(run, watcher, first, protocol.new_id("chatcmpl" if chat else "cmpl"), chat)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        pieces = [first or ""]
        while (piece := await run.next()) is not None:
            pieces.append(piece)
    except _ENGINE_ERRORS as err:
        raise _api_error(err) from None
    finally:
        await run.close(watcher)
    body = protocol.completion_body(
        protocol.new_id("chatcmpl" if chat else "cmpl"),
        state.model.name,
        [protocol.choice("".join(pieces), run.finish_reason, chat, chunk=False)],
        chat,
        chunk=False,
    )
    body["usage"] = protocol.usage(len(gen.prompt_ids), run.num_tokens)
    return JSONResponse(body)


_ENGINE_ERRORS = (RequestRejectedError, RequestFailedError, EngineClosedError)


def _api_error(err: Exception) -> ApiError:
    """The HTTP answer to an error a request's stream raised."""
    if isinstance(err, RequestRejectedError):
        return protocol.bad("prompt", str(err))
    if isinstance(err, RequestFailedError):
        return ApiError(500, str(err))
    return ApiError(503, f"the engine stopped: {err}")


async def _sse(
    run: _Run, watcher: asyncio.Task[None], first: str | None, cid: str, chat: bool
) -> AsyncIterator[str]:
    model = run.state.model.name
    try:
        piece, is_first = first, True
        while piece is not None:
            choice = protocol.choice(piece, run.finish_reason, chat, chunk=True, first=is_first)
            yield _event(protocol.completion_body(cid, model, [choice], chat, chunk=True))
            piece, is_first = await run.next(), False
        if run.gen.include_usage:
            body = protocol.completion_body(cid, model, [], chat, chunk=True)
            body["usage"] = protocol.usage(len(run.gen.prompt_ids), run.num_tokens)
            yield _event(body)
    except (RequestFailedError, EngineClosedError) as err:
        yield _event(_api_error(err).body())
    finally:
        await run.close(watcher)
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


class _ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message quoting a client's lone surrogate
    still encodes (Starlette's JSONResponse writes raw UTF-8)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error_response(err: ApiError) -> Response:
    return _ErrorResponse(err.body(), status_code=err.status)


async def _read_body(
    request: Request, max_bytes: int, timeout_s: float, engine_ended: asyncio.Event
) -> bytes:
    """The request's body: at most ``max_bytes``, within ``timeout_s``, unless the
    engine ends first.

    A declared ``Content-Length`` over the limit is refused before any byte is
    read, a chunked body as soon as it passes the limit.

    Raises:
        ApiError: 413 when it is too large, 408 when it does not arrive in time,
            503 as soon as ``engine_ended`` is set (the server then exits without
            waiting for the rest of the body).
        ClientDisconnect: when the client leaves first.
    """
    # NOTE: not FastAPI's max_body_size: its 413 is plain text, and it replaces the
    # app's JSON answer whenever the declared length is over the limit.
    too_large = ApiError(
        413, f"the request body exceeds {max_bytes} bytes (--max-request-bytes)", "body"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large

    async def read() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise too_large
        return bytes(body)

    reading = asyncio.ensure_future(read())
    ended = asyncio.ensure_future(engine_ended.wait())
    try:
        await asyncio.wait((reading, ended), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reading, ended):
            task.cancel()
        await asyncio.gather(reading, ended, return_exceptions=True)
    if reading.done() and not reading.cancelled():
        return reading.result()  # the body, or its 413 / ClientDisconnect
    if ended.done() and not ended.cancelled():
        raise ApiError(503, "the engine stopped; the server is shutting down")
    raise ApiError(
        408, f"the request body did not arrive within {timeout_s:g} s (--timeout-request-body)"
    )


def build_app(
    state: ServerState,
    on_shutdown: Callable[[], None] | None = None,
    *,
    max_request_bytes: int | None = None,
    timeout_request_body_s: float = DEFAULT_TIMEOUT_REQUEST_BODY_S,
    docs: bool = False,
) -> FastAPI:
    """The app serving ``state``; closing it (server shutdown) closes the engine
    and then calls ``on_shutdown`` (e.g. to write the records).

    Args:
        max_request_bytes: largest body (bytes); None: derived from the model's
            ``max_model_len`` (:func:`roseinfer.serve.protocol.default_max_request_bytes`).
        timeout_request_body_s: seconds a body may take to arrive.
        docs: serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off: their pages
            load Swagger UI and ReDoc from a CDN).
    """
    if max_request_bytes is None:
        max_request_bytes = protocol.default_max_request_bytes(state.model.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # NOTE: thawed when serving ends, else the frozen objects outlive the interpreter's
        # last collection and native extensions (Triton's) report them as leaks at exit
        with frozen_heap():  # the model, torch and transformers: ~450,000 objects
            _notify_engine_end(state)
            yield
        await asyncio.to_thread(state.engine.close)
        state.parser.shutdown(wait=False, cancel_futures=True)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(
        title="rose-serve",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.rose = state
    _error_handlers(app)
    _routes(app, state, max_request_bytes, timeout_request_body_s)
    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        return _error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return _error_response(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, err: ClientDisconnect) -> Response:
        return Response(status_code=400)  # nobody reads it; nothing to log

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> Response:
        # NOTE: the body says nothing of the server; Starlette re-raises, so the log keeps it
        return _error_response(ApiError(500, "internal server error"))


def _notify_engine_end(state: ServerState) -> None:
    """Set ``state.engine_ended`` on this event loop once the engine's worker ends."""
    loop = asyncio.get_running_loop()

    def ended(error: BaseException | None) -> None:
        with suppress(RuntimeError):  # the loop closed first: nobody waits
            loop.call_soon_threadsafe(state.engine_ended.set)

    state.engine.add_done_callback(ended)


def _routes(app: FastAPI, state: ServerState, max_bytes: int, timeout_s: float) -> None:
    limits = (max_bytes, timeout_s)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completion(request, protocol.parse_completion, False, limits)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _completion(request, protocol.parse_chat, True, limits)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model.name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "roseinfer",
            "max_model_len": state.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        # NOTE: alive takes no lock and the route awaits nothing: never waits for a step
        if not state.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


async def _parse(
    state: ServerState, parse: Callable[[Any, ModelContext], Generation], raw: bytes
) -> Generation:
    """Decode, check and tokenize a body on the parser thread (off the event loop)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.parser, protocol.parse_body, raw, parse, state.model)


# ------------------------------------------------------------------ uvicorn
class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads, and a limit on
    requests in flight rather than on connections.

    uvicorn arms ``timeout_keep_alive`` only after a response and disarms it on
    any byte, so a connection that sends half a head, or one byte every few
    seconds, stays open for good (slowloris). Here a connection with no request
    in progress is closed ``timeout_keep_alive`` seconds after it opened or after
    its previous response, whatever it sends meanwhile.

    uvicorn's ``limit_concurrency`` refuses every request while the open
    connections reach it, idle keep-alive ones included (a client pool of 156
    connections with 6 requests in flight got 503s under a limit of 70), with a
    plain-text body. Here it bounds the requests in flight (streams included):
    one more gets OpenAI's JSON error (503), counted in ``/metrics`` as
    ``refused_503``. Idle connections are bounded by the head deadline.
    """

    _head_timer: asyncio.TimerHandle | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit, self.limit_concurrency = self.limit_concurrency, None  # uvicorn's check: off
        if limit is not None:
            self.app = _RequestLimit(self.app, limit, self.server_state.tasks, self.config.app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        self._arm_head_timer()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:  # no request in progress
            self.timeout_keep_alive_handler()


class _RequestLimit:
    """ASGI: a JSON 503 for a request while ``limit`` others are in flight.

    Args:
        app: the ASGI app behind it.
        limit: most requests in flight.
        tasks: uvicorn's set of request tasks (``server_state.tasks``); a request's
            task is in it before the request reaches the app.
        served: the app given to uvicorn; refusals are counted in its
            ``state.rose`` (a :class:`ServerState`) when it has one.
    """

    def __init__(self, app: Any, limit: int, tasks: set[Any], served: Any) -> None:
        self.app, self.limit, self.tasks = app, limit, tasks
        self.state: ServerState | None = getattr(getattr(served, "state", None), "rose", None)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or len(self.tasks) <= self.limit:
            await self.app(scope, receive, send)
            return
        if self.state is not None:
            self.state.count("refused_503")
        err = ApiError(
            503,
            f"server busy: {self.limit} requests in flight (--limit-concurrency {self.limit}); "
            "retry later",
        )
        response = _error_response(err)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def server_config(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "warning",
    timeout_keep_alive_s: int = 5,
    limit_concurrency: int | None = None,
) -> uvicorn.Config:
    """uvicorn's config for ``app``: h11 with :class:`HeadTimeoutH11Protocol`,
    ``timeout_keep_alive_s`` (idle connections and request heads) and
    ``limit_concurrency`` (requests in flight at once, streams included; one more
    gets a JSON 503; idle connections do not count)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=HeadTimeoutH11Protocol,
        timeout_keep_alive=timeout_keep_alive_s,
        limit_concurrency=limit_concurrency,
    )
