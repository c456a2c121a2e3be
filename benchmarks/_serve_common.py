"""Shared helpers of the serving benchmarks (not a benchmark itself): start a
``rose-serve`` process on a free localhost port, wait for ``/health``, stop it
with SIGINT (so it closes the engine and writes ``--save-records``), and read
``/metrics``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``rose-serve ARGS --port P`` as a child process (stderr to ``log``)."""

    def __init__(self, args: Sequence[str], log: Path, startup_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("rose-serve")
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            [str(exe), *args, "--port", str(self.port)], stdout=self.log, stderr=self.log, env=env
        )
        deadline = time.monotonic() + startup_s
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"rose-serve did not start; see {log}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        """True if ``/health`` answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples of ``/metrics`` by name."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.labels
        }

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGINT, then wait (uvicorn shuts down, the records are written)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)
