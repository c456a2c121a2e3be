"""Online front end: enqueue-only ``add_request``, a worker thread, token streams.

As in seed 027, ``add_request`` does only light work (tokenize, make a
queue, enqueue) and returns an id at once; a worker thread admits pending
requests into the scheduler and runs the steps; ``stream(id)`` yields each
token (and its text piece when a tokenizer is known) as the worker produces it.
A fault in the worker ends every open stream with that error instead of
hanging, and frees every KV block. Every request ends exactly once.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from roseinfer.executor.detokenizer import IncrementalDetokenizer
from roseinfer.executor.engine import Engine
from roseinfer.request import Request, SamplingParams
from roseinfer.sequence import Sequence as Seq


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
    """End of a stream: normal (error None), aborted, or a worker fault."""

    error: BaseException | None = None
    reason: str = ""


class EngineClosedError(RuntimeError):
    """The streaming engine was closed (or failed) before the request ended."""


class StreamingEngine:
    """Thread-safe online API over an :class:`Engine`.

    Args:
        engine: the engine to drive; only the worker thread touches it.
        tokenizer: optional transformers tokenizer for text prompts and text pieces.
        idle_wait_s: how long the idle worker sleeps before re-checking (s).
    """

    def __init__(self, engine: Engine, tokenizer: Any = None, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._idle_wait_s = idle_wait_s
        self._pending: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue[StreamOutput | _End]] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._running = True
        self._error: BaseException | None = None
        self._ids = itertools.count()
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
    ) -> str:
        """Enqueue a request and return its id at once (no model work here).

        Args:
            prompt: text (needs a tokenizer) or token ids.
            max_tokens: most output tokens.
            sampling: defaults to greedy, stopping at the tokenizer's EOS if known.

        Raises:
            EngineClosedError: after :meth:`close` or a worker fault.
            ValueError: on a text prompt without a tokenizer, or a bad length.
        """
        ids = self._encode(prompt)
        sampling = sampling if sampling is not None else self._default_sampling()
        with self._lock:
            if not self._running:
                raise EngineClosedError("the streaming engine is closed") from self._error
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            request = Request(rid, 0.0, len(ids), max_tokens, tuple(ids), sampling=sampling)
            self._streams[rid] = queue.SimpleQueue()
            if self.tokenizer is not None:
                self._detoks[rid] = IncrementalDetokenizer(self.tokenizer, ids)
        self._pending.put(request)
        self._wakeup.set()
        return rid

    def stream(self, request_id: str, timeout_s: float | None = None) -> Iterator[StreamOutput]:
        """Yield the request's tokens until it ends.

        Raises:
            KeyError: for an unknown id.
            EngineClosedError: if the engine closed or the worker failed first
                (the worker's exception is the cause).
            queue.Empty: if ``timeout_s`` passes with no token.
        """
        with self._lock:
            q = self._streams[request_id]
        while True:
            item = q.get(timeout=timeout_s)
            if isinstance(item, _End):
                with self._lock:
                    self._streams.pop(request_id, None)
                if item.error is not None:
                    raise EngineClosedError(item.reason) from item.error
                return
            yield item

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> list[StreamOutput]:
        """Add a request and collect its whole stream."""
        return list(self.stream(self.add_request(prompt, **kwargs)))

    def abort(self, request_id: str) -> None:
        """End a request early; its stream ends and its KV blocks are freed."""
        self._aborts.put(request_id)
        self._wakeup.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker; every open stream ends (requests not finished are aborted)."""
        with self._lock:
            self._running = False
        self._wakeup.set()
        self._worker.join(timeout=timeout_s)

    def __enter__(self) -> StreamingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _default_sampling(self) -> SamplingParams:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return SamplingParams(ignore_eos=True)
        return SamplingParams(ignore_eos=False, stop_token_ids=(int(eos),))

    # ------------------------------------------------------------ worker side
    def _loop(self) -> None:
        try:
            while self._is_running():
                self._admit_pending()
                self._apply_aborts()
                if self.engine.scheduler.has_unfinished():
                    out, _ = self.engine.step()
                    self._emit([p.seq for p in out.prefills] if out.prefills else out.decodes)
                else:
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
            self._admit_pending()
            self._end_all(_End(EngineClosedError("closed"), "engine closed"), "closed")
        except BaseException as err:  # noqa: BLE001 - every stream must learn of it
            self._error = err
            with self._lock:
                self._running = False
            self._end_all(_End(err, f"worker failed: {err!r}"), "worker fault")

    def _is_running(self) -> bool:
        with self._lock:
            return self._running

    def _admit_pending(self) -> None:
        engine = self.engine
        while True:
            try:
                request = self._pending.get_nowait()
            except queue.Empty:
                return
            request = replace(request, arrival_time_s=engine.now())
            seq = engine.scheduler.add_request(request, request.arrival_time_s)
            if seq.is_done:  # rejected at once
                self._send(seq.request_id, _End(ValueError(seq.reject_reason), seq.reject_reason))

    def _apply_aborts(self) -> None:
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                return
            if self.engine.scheduler.abort(rid, self.engine.now()):
                self._send(rid, _End())

    def _emit(self, seqs: Sequence[Seq]) -> None:
        end_s = self.engine.scheduler.step_end_s[-1]
        for seq in seqs:
            token = seq.output_token_ids[-1]
            detok = self._detoks.get(seq.request_id)
            text = detok.add(token) if detok is not None else ""
            done = seq.is_done
            if done and detok is not None:
                text += detok.flush()
            out = StreamOutput(token, text, end_s, done, seq.stop_reason if done else "")
            self._send(seq.request_id, out)
            if done:
                self._send(seq.request_id, _End())

    def _send(self, rid: str, item: StreamOutput | _End) -> None:
        with self._lock:
            q = self._streams.get(rid)
            if isinstance(item, _End):
                self._detoks.pop(rid, None)
        if q is not None:
            q.put(item)

    def _end_all(self, end: _End, reason: str) -> None:
        """Abort whatever is unfinished (frees its blocks) and end every stream."""
        sched = self.engine.scheduler
        now = self.engine.now()
        for seq in [*sched.waiting, *sched.running]:
            sched.abort(seq.request_id, now)
        with self._lock:
            streams = list(self._streams.items())
        for _, q in streams:
            q.put(end)
