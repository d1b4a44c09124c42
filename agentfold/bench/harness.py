"""`agentfold serve` as a child process on a free loopback port: for the load test and fault drills.

A real process is the only way to test what a crash does (SIGKILL mid-write, restart on the same
home) and what the server's own memory does under load, so this starts one, waits until /health
answers, keeps its stderr in a file for the caller to read, and stops or kills it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """One `agentfold serve` child; `prefix` wraps the command (e.g. `setpriv ...`, `unshare ...`)."""

    def __init__(self, home: str | Path | None, args: Sequence[str] = (), prefix: Sequence[str] = (),
                 log_path: str | Path | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = Path(home) if home is not None else None
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/agentfold-serve-{self.port}.log")
        command = [sys.executable, "-m", "agentfold.cli", "serve", "--port", str(self.port), "--log-level", "warning",
                   *(["--home", str(self.home)] if self.home is not None else []), *args]
        self.command = [*prefix, *command]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        """Launch and wait for /health; raises with the log's tail if it exits or never answers."""
        self._log = open(self.log_path, "wb")  # noqa: SIM115  (kept open for the child's lifetime)
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agentfold serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"agentfold serve did not answer within {timeout:.0f} s:\n{self.log()[-3000:]}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean-up handlers run."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self._close_log()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT (graceful shutdown), then SIGKILL if it lingers; returns the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()
        return self.proc.returncode if self.proc is not None else None

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
