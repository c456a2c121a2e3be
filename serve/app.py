"""The FastAPI app: OpenAI routes over a :class:`StreamingEngine`.

Each request is added to the engine (503 when ``max_waiting`` requests wait,
400 naming a bad field) and its tokens are read with ``astream`` on the event
loop, so hundreds of streams need no thread each. A streamed answer sends one
SSE chunk per token (clients such as ``vllm bench serve`` time each chunk as a
token), then a usage chunk if asked (``stream_options.include_usage``) and
``data: [DONE]``. A task per request waits for the client's ``http.disconnect``
and aborts the request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
from roseinfer.serve.protocol import ApiError, Generation, ModelContext


@dataclass
class ServerState:
    """What the routes share: the engine, the served model, the metrics."""

    engine: StreamingEngine
    model: ModelContext
    metrics: ServerMetrics


class _Run:
    """One request's output as the client sees it: text pieces with stop strings
    applied (text that may begin a stop string is held back), token count,
    finish reason, and the server's latency observations."""

    def __init__(self, state: ServerState, rid: str, gen: Generation, added_s: float) -> None:
        self.state, self.rid, self.gen = state, rid, gen
        self.stream = state.engine.astream(rid)
        self.held = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.last_s = added_s
        self.added_s = added_s
        self.disconnected = False
        self.hold = max((len(s) for s in gen.stop), default=1) - 1

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
        text = self._cut(out.text, out.finished)
        if out.finished and self.finish_reason is None:
            self.finish_reason = out.stop_reason
        if self.finish_reason is not None:
            metrics.e2el.observe(out.time_s - self.added_s)
        return text

    def _cut(self, piece: str, finished: bool) -> str:
        self.held += piece
        hits = [i for i in (self.held.find(s) for s in self.gen.stop) if i >= 0]
        if hits:
            text, self.held = self.held[: min(hits)], ""
            self.finish_reason = "stop"
            self.state.engine.abort(self.rid, discard=True)
            return text
        keep = 0 if finished else self.hold
        cut = len(self.held) - keep
        text, self.held = self.held[:cut], self.held[cut:]
        return text

    async def close(self, watcher: asyncio.Task[None]) -> None:
        """Stop watching, abort (no-op if it ended), count the outcome."""
        watcher.cancel()
        self.state.engine.abort(self.rid, discard=True)
        with suppress(Exception):
            await self.stream.aclose()
        outcome = self.finish_reason or ("aborted" if self.disconnected else "failed")
        self.state.metrics.requests.labels(outcome).inc()


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
            list(gen.prompt_ids), max_tokens=gen.max_tokens, sampling=gen.sampling
        )
    except QueueFullError as err:
        state.metrics.requests.labels("refused_503").inc()
        raise ApiError(503, f"server busy: {err}") from None
    except EngineClosedError as err:
        raise ApiError(503, f"the engine is not running: {err}") from None
    except InvalidRequestError as err:
        state.metrics.requests.labels("refused_400").inc()
        raise protocol.bad(err.field, str(err).removeprefix(f"{err.field} ")) from None
    return rid, added_s


async def _generate(request: Request, gen: Generation, chat: bool) -> Response:
    state: ServerState = request.app.state.rose
    rid, added_s = _add(state, gen)
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


async def _json_body(request: Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None


def build_app(state: ServerState, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """The app serving ``state``; closing it (server shutdown) closes the engine
    and then calls ``on_shutdown`` (e.g. to write the records)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(state.engine.close)
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="rose-serve", lifespan=lifespan)
    app.state.rose = state
    _routes(app, state)
    return app


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gen = _parse(state, protocol.parse_completion, await _json_body(request))
        return await _generate(request, gen, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        gen = _parse(state, protocol.parse_chat, await _json_body(request))
        return await _generate(request, gen, chat=True)

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
        if not state.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


def _parse(
    state: ServerState, parse: Callable[[Any, ModelContext], Generation], body: Any
) -> Generation:
    try:
        return parse(body, state.model)
    except ApiError:
        state.metrics.requests.labels("refused_400").inc()
        raise
