"""Serving a built engine over HTTP: the address probe before any model work, and
the server's run until shutdown with its exit status (``rose-serve``'s library)."""

from __future__ import annotations

import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from roseinfer.executor.streaming import StreamingEngine


def check_listen(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so an address that cannot be served
    fails before the model loads.

    Raises:
        ValueError: naming ``--host`` or ``--port`` and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(
            f"--host {host[:60]!r} is not an address: {err}; give an IP address of this "
            "machine (127.0.0.1: local clients only, 0.0.0.0: every interface) or its name"
        ) from None
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(address)
    except OSError as err:
        raise ValueError(
            f"cannot listen on --host {host} --port {port}: {err.strerror or err}; "
            "pick a free port, or an address of this machine"
        ) from None


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _stop_signals_recorded(server: Any, stopped_by: list[int]) -> Iterator[None]:
    """Record SIGINT and SIGTERM (and ask ``server`` to exit) while open, in the main
    thread; elsewhere do nothing (signals reach only the main thread).

    uvicorn shuts down gracefully on these signals, then puts back the handlers it
    found and raises the signal again for them (uvicorn 0.29+, ``capture_signals``):
    with Python's defaults a Ctrl-C that had already stopped the server cleanly
    became a KeyboardInterrupt (``rose-serve: error: interrupted``, status 2), and a
    SIGTERM killed the process (status 143) after its records were saved."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(sig: int, frame: Any) -> None:
        stopped_by.append(sig)
        server.should_exit = True  # before uvicorn's own handlers are set, or after

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_server(server: Any, se: StreamingEngine) -> int:
    """Serve until shutdown; returns the exit status: 0 (also when stopped by SIGINT
    or SIGTERM, after one ``rose-serve: stopped by SIG...`` line), or 1 when the
    engine failed (after one ``rose-serve: error:`` line).

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
    stopped_by: list[int] = []
    with _stop_signals_recorded(server, stopped_by):
        server.run()
    err = se.error
    if err is None:
        if stopped_by:
            name = signal.Signals(stopped_by[0]).name
            print(f"rose-serve: stopped by {name}", file=sys.stderr, flush=True)
        return 0
    message = " ".join(f"{type(err).__name__}: {err}".splitlines())
    print(
        f"rose-serve: error: the engine failed ({message}); exiting with status 1 for a "
        "supervisor to restart the server",
        file=sys.stderr,
        flush=True,
    )
    return 1
