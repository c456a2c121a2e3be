"""Serving a built engine over HTTP: the address probe before any model work, and
the server's run until shutdown with its exit status (``rose-serve``'s library)."""

from __future__ import annotations

import socket
import sys
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
