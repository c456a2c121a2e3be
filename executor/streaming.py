"""Online front end: enqueue-only ``add_request``, a worker thread, token streams.

As in seed 027, ``add_request`` does only light work (tokenize, make a
queue, enqueue) and returns an id at once; a worker thread admits pending
requests into the scheduler and runs the steps; ``stream(id)`` yields each
token (and its text piece when a tokenizer is known) as the worker produces it.
A fault in the worker ends every open stream with that error instead of
hanging, frees every KV block and calls ``on_fatal``; a fault in one request's
sampling ends that request only. Every request ends exactly once. A stream has
one reader at a time (:meth:`StreamingEngine.stream`, or
:meth:`~StreamingEngine.astream` from asyncio); fields are checked at
``add_request`` (``roseinfer.executor.validation``). Stop strings are matched by
the worker as it detokenizes, so a request ends at the step that completed one
(finished, ``stop_reason`` "stop"), never a token later. With
``keep_records=False`` nothing per ended request stays in memory: records go to
``record_sink`` in batches (or are dropped), and an id is in use only while its
request is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from roseinfer.executor.detokenizer import IncrementalDetokenizer
from roseinfer.executor.engine import Engine
from roseinfer.executor.validation import (
    InvalidRequestError,
    StopTokenIds,
    check_max_tokens,
    check_request_id,
    check_sampling,
    check_stop,
    check_token_ids,
)
from roseinfer.interface import PolicyError
from roseinfer.records import RecordBuilder
from roseinfer.request import Request, SamplingParams
from roseinfer.scheduler import SchedulerOutput
from roseinfer.sequence import SeqStatus
from roseinfer.sequence import Sequence as Seq

if TYPE_CHECKING:
    import pandas as pd

RECORD_BATCH = 256  # rows handed to record_sink at once (and whenever the engine idles)


@dataclass(frozen=True, slots=True)
class StreamOutput:
    """One streamed token.

    Attributes:
        token_id: the sampled token.
        text: its text piece (incremental detokenization; "" without a tokenizer
            or while a multi-byte character is incomplete).
        time_s: engine time (s) of the step that produced it.
        finished: True on the request's last token.
        stop_reason: "length", "stop" or "" (not finished).
    """

    token_id: int
    text: str
    time_s: float
    finished: bool
    stop_reason: str


@dataclass(frozen=True, slots=True)
class _End:
    """End of a stream: normal (``error`` None, also after an abort), or the
    exception class the consumer raises, with its message and cause."""

    error: type[Exception] | None = None
    reason: str = ""
    cause: BaseException | None = None


@dataclass(frozen=True, slots=True)
class _Abort:
    """A client's abort, queued behind the requests it may refer to."""

    request_id: str
    discard: bool = False


class EngineClosedError(RuntimeError):
    """The streaming engine was closed (or failed) before the request ended.

    After a worker fault, ``__cause__`` is the worker's exception.
    """


class RequestRejectedError(ValueError):
    """The scheduler refused the request (e.g. longer than ``max_model_len``)."""


class RequestFailedError(RuntimeError):
    """The request ended because sampling its next token failed; ``__cause__`` is
    the error. Other requests go on."""


class QueueFullError(RuntimeError):
    """``max_waiting`` requests already wait for admission; retry later."""


class StreamBusyError(RuntimeError):
    """The request's stream already has a reader (one reader per stream: two
    would split its tokens between them)."""


class StreamingEngine:
    """Thread-safe online API over an :class:`Engine`.

    Args:
        engine: the engine to drive; only the worker thread touches it.
        tokenizer: optional transformers tokenizer for text prompts and text pieces.
        idle_wait_s: how long the idle worker sleeps before re-checking (s).
        max_waiting: most requests waiting for admission (queued or in the
            scheduler's waiting queue); ``add_request`` beyond it raises
            :class:`QueueFullError`. None: no limit.
        keep_records: keep every ended request's record in ``engine.records``
            (token ids included). False (a server): records are handed to
            ``record_sink`` in batches of :data:`RECORD_BATCH` rows, whenever the
            engine idles, and at the end (once, even if empty), then forgotten;
            without a sink they are dropped as they end.
        record_sink: called on the worker thread with each batch of records
            (a DataFrame, ``roseinfer.metrics.schema`` without token ids), e.g.
            :meth:`roseinfer.records.RecordFileWriter.write`. An exception in it
            is a worker fault.
        on_fatal: called on the worker thread with the worker's exception after a
            fault, once every stream has ended (e.g. to stop a server); also settable
            as the attribute ``on_fatal``.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any = None,
        idle_wait_s: float = 0.05,
        max_waiting: int | None = None,
        *,
        keep_records: bool = True,
        record_sink: Callable[[pd.DataFrame], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1 (or None), got {max_waiting}")
        if keep_records and record_sink is not None:
            raise ValueError("record_sink needs keep_records=False (rows go to one place)")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.keep_records = keep_records
        self.record_sink = record_sink
        self.on_fatal = on_fatal
        if not keep_records:  # token times only when a sink writes them
            engine.records = RecordBuilder(keep_token_times=record_sink is not None)
        self._idle_wait_s = idle_wait_s
        self._num_queued = 0  # added, not yet handed to the scheduler
        self._readers: set[str] = set()
        self._wakers: dict[str, Callable[[], None]] = {}
        # NOTE: one queue for requests and aborts keeps their order: an abort
        # sent right after add_request is never seen before its request.
        self._commands: queue.SimpleQueue[Request | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue[StreamOutput | _End]] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._stops: dict[str, _StopMatcher] = {}  # requests with stop strings (worker side)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._running = True
        self._error: BaseException | None = None
        self._done_callbacks: list[Callable[[BaseException | None], None]] | None = []
        self._ids = itertools.count()
        # NOTE: with every record kept, ids stay unique across them (a set beside the
        # records); without, only live ids are checked: nothing grows per request.
        self._used_ids: set[str] | None = set() if keep_records else None
        self._worker = threading.Thread(target=self._loop, name="roseinfer-worker", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ client side
    def add_request(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        stop: Sequence[str] = (),
    ) -> str:
        """Enqueue a request and return its id at once (no model work here).

        Its arrival time is now on the engine clock; the worker admits it.

        Args:
            prompt: text (needs a tokenizer) or token ids.
            max_tokens: most output tokens.
            sampling: defaults to greedy, stopping at the tokenizer's EOS if known.
            request_id: an id not in use (None: a fresh ``req-N``). With
                ``keep_records`` an id stays in use for good; without, while its
                request is queued, waiting or running, or its stream has not been
                read to its end (or discarded), and it may be reused after.
            stop: stop strings (needs a tokenizer): the text is cut before the
                first one and the request finishes there (``stop_reason`` "stop").

        Raises:
            EngineClosedError: after :meth:`close` or a worker fault (the fault is
                the cause).
            QueueFullError: if ``max_waiting`` requests wait already.
            InvalidRequestError: (a ValueError) naming the field: an empty prompt,
                token ids that are not integers in the vocabulary, ``max_tokens``
                not an integer >= 1, a non-string id, bad sampling parameters,
                bad stop strings (``roseinfer.executor.validation.check_stop``).
            ValueError: on a text prompt or stop strings without a tokenizer, or
                an id in use.
        """
        max_tokens = check_max_tokens(max_tokens)
        if request_id is not None:
            check_request_id(request_id)
        stops = check_stop(stop) if stop else ()
        if stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        ids = self._encode(prompt)
        sampling = sampling if sampling is not None else self._default_sampling()
        check_sampling(sampling)
        stop_ids = sampling.stop_token_ids
        if len(stop_ids) > 1 and not isinstance(stop_ids, StopTokenIds):  # O(1) stop checks
            sampling = replace(sampling, stop_token_ids=StopTokenIds(sampling.stop_token_ids))
        with self._lock:
            if not self._running:
                raise EngineClosedError("the streaming engine is closed") from self._error
            if self.max_waiting is not None and self._num_waiting() >= self.max_waiting:
                raise QueueFullError(
                    f"{self.max_waiting} requests wait for admission already (max_waiting); "
                    "retry later"
                )
            rid = request_id if request_id is not None else self._new_id()
            if self._in_use(rid):
                raise ValueError(f"request id {rid!r} is already in use")
            request = Request(
                rid, self.engine.now(), len(ids), max_tokens, tuple(ids), sampling=sampling
            )
            self.engine.check_request(request)
            if self._used_ids is not None:
                self._used_ids.add(rid)
            self._num_queued += 1
            self._streams[rid] = queue.SimpleQueue()
            if self.tokenizer is not None:
                self._detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids)
            if stops:
                self._stops[rid] = _StopMatcher(stops)
            self._commands.put(request)
        self._wakeup.set()
        return rid

    def stream(self, request_id: str, timeout_s: float | None = None) -> Iterator[StreamOutput]:
        """Yield the request's tokens until it ends (or is aborted).

        The stream is claimed at this call; it is free again once the iterator
        ends or is closed.

        Raises:
            KeyError: for an unknown id (or a stream already read to its end).
            StreamBusyError: if another reader holds the stream.
            RequestRejectedError: if the scheduler refused the request.
            RequestFailedError: if sampling for it failed (others go on).
            EngineClosedError: if the engine closed or the worker failed first
                (the worker's exception is the cause).
            queue.Empty: if ``timeout_s`` passes with no token.
        """
        q = self._claim(request_id)
        return self._read(request_id, q, timeout_s)

    def _read(
        self, request_id: str, q: queue.SimpleQueue[StreamOutput | _End], timeout_s: float | None
    ) -> Iterator[StreamOutput]:
        try:
            while True:
                item = q.get(timeout=timeout_s)
                if isinstance(item, _End):
                    self._finish_stream(request_id, item)
                    return
                yield item
        finally:
            self._release(request_id)

    async def astream(self, request_id: str) -> AsyncGenerator[StreamOutput, None]:
        """:meth:`stream` for asyncio: awaits tokens without holding a thread.

        The worker wakes the reader's event loop (``call_soon_threadsafe``) after
        each item, so hundreds of streams need no thread each.

        Raises:
            the errors of :meth:`stream`.
        """
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        q = self._claim(request_id, wake)
        try:
            while True:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                if isinstance(item, _End):
                    self._finish_stream(request_id, item)
                    return
                yield item
        finally:
            self._release(request_id)

    def _claim(
        self, request_id: str, waker: Callable[[], None] | None = None
    ) -> queue.SimpleQueue[StreamOutput | _End]:
        with self._lock:
            q = self._streams[request_id]
            if request_id in self._readers:
                raise StreamBusyError(f"the stream of request {request_id!r} has a reader already")
            self._readers.add(request_id)
            if waker is not None:
                self._wakers[request_id] = waker
        return q

    def _release(self, request_id: str) -> None:
        with self._lock:
            self._readers.discard(request_id)
            self._wakers.pop(request_id, None)

    def _finish_stream(self, request_id: str, end: _End) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if end.error is not None:
            raise end.error(end.reason) from end.cause

    def num_waiting(self) -> int:
        """Requests waiting for admission: queued here or in the scheduler's queue."""
        with self._lock:
            return self._num_waiting()

    def _num_waiting(self) -> int:
        # NOTE: len() of the worker's deque is one atomic read; a count off by one
        # for a step only moves the max_waiting limit by one.
        return self._num_queued + len(self.engine.scheduler.waiting)

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> list[StreamOutput]:
        """Add a request and collect its whole stream."""
        return list(self.stream(self.add_request(prompt, **kwargs)))

    def abort(self, request_id: str, *, discard: bool = False) -> None:
        """End a request early, admitted or not; its stream ends (no error) and its
        KV blocks are freed. Unknown or ended requests are ignored.

        Args:
            discard: the caller will not read the stream to its end (a client
                that left): drop the stream's queue too, even if the request ended
                already, so nothing of it stays behind.
        """
        self._commands.put(_Abort(request_id, discard))
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        """True while the worker runs (not closed, not failed). Never waits: it
        takes no lock (a health check must answer while the worker is busy)."""
        return self._running and self._worker.is_alive()  # one read of a bool: atomic

    def add_done_callback(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn`` once when the worker has ended: with None after :meth:`close`,
        with the worker's exception after a fault (before ``on_fatal``). It runs on
        the worker thread, after every stream has ended, or at once here if the
        worker has ended already."""
        with self._lock:
            pending = self._done_callbacks
            if pending is not None:
                pending.append(fn)
                return
            error = self._error
        fn(error)

    @property
    def error(self) -> BaseException | None:
        """The exception that ended the worker, or None."""
        with self._lock:
            return self._error

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker. Streams of requests not finished end with
        :class:`EngineClosedError`; those requests are aborted (blocks freed)."""
        with self._lock:
            self._running = False
        self._wakeup.set()
        self._worker.join(timeout=timeout_s)

    def __enter__(self) -> StreamingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_id(self) -> str:
        """The next free ``req-N`` id (call with the lock held)."""
        rid = f"req-{next(self._ids)}"
        while self._in_use(rid):
            rid = f"req-{next(self._ids)}"
        return rid

    def _in_use(self, rid: str) -> bool:
        """Whether ``rid`` is taken (call with the lock held). A stream outlives its
        request (it ends after it), so the ids with a stream are the live ones."""
        return rid in self._streams or (self._used_ids is not None and rid in self._used_ids)

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InvalidRequestError("prompt", "must not be empty")
            return list(ids)
        return list(check_token_ids(prompt, self.engine.runner.vocab_size))

    def _default_sampling(self) -> SamplingParams:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return SamplingParams(ignore_eos=True)
        return SamplingParams(ignore_eos=False, stop_token_ids=(int(eos),))

    # ------------------------------------------------------------ worker side
    def _loop(self) -> None:
        try:
            while self._is_running():
                self._apply_commands()
                if self.engine.scheduler.has_unfinished():
                    self._step()
                else:
                    self._save_records(idle=True)
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
            self._apply_commands()
            self._end_all(_End(EngineClosedError, "the streaming engine was closed"))
            self._last_records()
            self._call_done(None)
        except BaseException as err:  # noqa: BLE001 - every stream must learn of it
            with self._lock:
                self._running = False
                self._error = err
            self._end_all(_End(EngineClosedError, f"worker failed: {err!r}", err))
            with contextlib.suppress(Exception):  # the fault is reported; records may go with it
                self._last_records()
            self._call_done(err)
            if self.on_fatal is not None:
                self.on_fatal(err)

    def _call_done(self, error: BaseException | None) -> None:
        """Run the done callbacks, once (see :meth:`add_done_callback`)."""
        with self._lock:
            callbacks, self._done_callbacks = self._done_callbacks or [], None
        for fn in callbacks:
            fn(error)

    def _is_running(self) -> bool:
        with self._lock:
            return self._running

    def _apply_commands(self) -> None:
        engine = self.engine
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                if engine.abort(command.request_id):
                    self._send(command.request_id, _End())
                if command.discard:
                    with self._lock:
                        self._streams.pop(command.request_id, None)
                        self._detoks.pop(command.request_id, None)
                        self._stops.pop(command.request_id, None)
                continue
            seq = engine.scheduler.add_request(command, command.arrival_time_s)
            with self._lock:
                self._num_queued -= 1
            engine.flush_records()
            if seq.is_done:  # rejected at once
                self._send(seq.request_id, _End(RequestRejectedError, seq.reject_reason))

    def _step(self) -> None:
        """One :meth:`Engine.step`, with stop strings applied before the ended
        requests are recorded, then the outputs are sent."""
        engine = self.engine
        outputs: list[tuple[str, StreamOutput | _End]] = []

        def apply_stops(out: SchedulerOutput) -> None:
            outputs.extend(self._outputs([item.seq for item in out.sampling]))

        out, _ = engine.step(before_records=apply_stops)
        failed = engine.pop_failed()
        if out.is_empty and not failed:  # nothing runs, the policy admits nothing: never will
            raise PolicyError(engine.scheduler.stall_message())
        self._save_records(idle=False)
        engine.scheduler.release_steps()
        for rid, err in failed.items():
            self._send(rid, _End(RequestFailedError, f"sampling failed: {err!r}", err))
        for rid, item in outputs:
            self._send(rid, item)

    def _outputs(self, seqs: Sequence[Seq]) -> list[tuple[str, StreamOutput | _End]]:
        """What each request that sampled gets: its token and text piece, and the
        end of its stream if it ended (a stop string ends it here)."""
        outputs: list[tuple[str, StreamOutput | _End]] = []
        if not seqs:
            return outputs
        end_s = float(self.engine.scheduler.step_log.end_s[-1])
        for seq in seqs:
            rid, token = seq.request_id, seq.output_token_ids[-1]
            detok = self._detoks.get(rid)
            text = detok.add(token) if detok is not None else ""
            if seq.is_done and detok is not None:
                text += detok.flush()
            matcher = self._stops.get(rid)
            if matcher is not None:
                text, hit = matcher.feed(text, last=seq.is_done)
                if hit:
                    self._finish_on_stop(seq, end_s)
            done = seq.is_done
            outputs.append((rid, StreamOutput(token, text, end_s, done, seq.stop_reason)))
            if done:
                outputs.append((rid, _End()))
        return outputs

    def _finish_on_stop(self, seq: Seq, end_s: float) -> None:
        """End ``seq`` as finished by a stop string, at the step that produced it."""
        if not seq.is_done:
            self.engine.scheduler.abort(seq.request_id, end_s)  # frees its blocks
            # NOTE(stop strings): the scheduler ends a request by length, by a stop
            # token or by abort; a stop string ends it as a stop token would, so the
            # abort's labels are replaced before its record is built (flush_records).
            seq.status = SeqStatus.FINISHED
            seq.reject_reason = ""
        seq.stop_reason = "stop"

    def _save_records(self, idle: bool) -> None:
        """Keep nothing per ended request unless asked: hand full batches (or,
        when idle, any rows) to the sink; drop them without one."""
        if self.keep_records:
            return
        records = self.engine.records
        num_rows = len(records)
        if not num_rows:
            return
        if self.record_sink is None:
            records.clear()
        elif idle or num_rows >= RECORD_BATCH:
            self.record_sink(records.drain())

    def _last_records(self) -> None:
        """At the end: the remaining records to the sink (the first batch creates
        the file, so a server with no request still writes its header)."""
        if not self.keep_records and self.record_sink is not None:
            self.record_sink(self.engine.records.drain())

    def _send(self, rid: str, item: StreamOutput | _End) -> None:
        with self._lock:
            q = self._streams.get(rid)
            waker = self._wakers.get(rid)
            if isinstance(item, _End):
                self._detoks.pop(rid, None)
                self._stops.pop(rid, None)
        if q is not None:
            q.put(item)
        if waker is not None:
            _wake(waker)

    def _end_all(self, end: _End) -> None:
        """Abort whatever is unfinished (frees its blocks), then end every open
        stream, even if the scheduler is broken."""
        try:
            sched = self.engine.scheduler
            for seq in [*sched.waiting, *sched.running]:
                self.engine.abort(seq.request_id)
        finally:
            with self._lock:
                streams = list(self._streams.values())
                wakers = list(self._wakers.values())
                self._detoks.clear()
                self._stops.clear()
            for q in streams:
                q.put(end)
            for waker in wakers:
                _wake(waker)


class _StopMatcher:
    """Cuts a request's text before its first stop string, holding back the text
    that may begin one (at most the longest stop string less one character)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1
        self.held = ""

    def feed(self, piece: str, last: bool) -> tuple[str, bool]:
        """The text to send after ``piece``, and whether a stop string was found
        (the text then ends before it). ``last``: no text follows; send all."""
        self.held += piece
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.held = self.held[: min(hits)], ""
            return text, True
        cut = len(self.held) if last else max(0, len(self.held) - self.hold)
        text, self.held = self.held[:cut], self.held[cut:]
        return text, False


def _wake(waker: Callable[[], None]) -> None:
    """Wake an asyncio reader; its loop may be closed already (nothing to wake)."""
    with contextlib.suppress(RuntimeError):
        waker()
