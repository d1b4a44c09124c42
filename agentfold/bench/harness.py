"""The benches' instruments: a real `agentfold serve` process, the error a bench step raises, a token clock.

A real process is the only way to measure what an agent feels (a server with its own memory,
reached over loopback) and to test what a crash does (SIGKILL mid-write, a restart on the same
home), so `ServerProcess` starts `agentfold serve` on a free loopback port, waits until /health
answers, keeps its stderr in a log file for the caller to read, and stops or kills it. The suite,
the agent bench, the load test and the fault drills all use this one class.

`TokenClock` times another engine's tokens (`transformers` `generate`) as they are produced, so
its rate is counted the same way as the engine's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 600  # loading and self-checking a model on a busy 2-core machine


class BenchError(RuntimeError):
    """A bench step failed; the message says which and why (one line)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def proc_status(pid: int) -> dict[str, int]:
    """VmHWM / VmRSS / VmPeak of a process in bytes (Linux /proc; empty elsewhere)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS", "VmPeak") and value.strip().endswith("kB"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def parse_metrics(text: str, prefix: str = "agentfold:") -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, only the `agentfold:` series (histogram sums and counts kept)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        series = line.split(" ", 1)[0]
        if not line.startswith(prefix) or "_bucket" in series or series.split("{")[0].endswith("_created"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


class ServerProcess:
    """One `agentfold serve` child on a free loopback port; a context manager (start, then stop).

    `home`: its --home (None: a temporary one, removed by `cleanup`); `args`: more `serve` options;
    `prefix` wraps the command (e.g. `setpriv ...`, `unshare ...`); `stop_signal` is what `stop`
    sends first (SIGINT: `agentfold serve`'s own clean-up runs after uvicorn's graceful shutdown);
    `start_timeout` is how long `start` waits for /health by default.
    """

    def __init__(self, home: str | Path | None = None, args: Sequence[str] = (), *, prefix: Sequence[str] = (),
                 log_path: str | Path | None = None, env: dict[str, str] | None = None,
                 stop_signal: int = signal.SIGINT, start_timeout: float = 180.0,
                 progress: Callable[[str], None] | None = None) -> None:
        self._tmp = None if home is not None else tempfile.TemporaryDirectory(prefix="agentfold-bench-")
        self.home = Path(home) if home is not None else Path(self._tmp.name) / "home"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path) if log_path else self.home.parent / f"serve-{self.port}.log"
        command = [sys.executable, "-m", "agentfold.cli", "serve", "--port", str(self.port), "--log-level", "warning",
                   "--home", str(self.home), *args]
        self.command = [*prefix, *command]
        self.env = {**os.environ, **(env or {})}
        self.stop_signal = stop_signal
        self.start_timeout = start_timeout
        self.say = progress or (lambda message: None)
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.health_at_start: dict[str, Any] = {}  # the /health answer that said it was ready

    @classmethod
    def for_bench(cls, model: str | Path | None, home: Path | None = None, dtype: str = "float32",
                  progress: Callable[[str], None] | None = None) -> ServerProcess:
        """The server the suite and the agent bench measure: `model` at `dtype`, one request at a time."""
        args = ["--dtype", dtype, "--max-active", "1", *(["--model", str(model)] if model else [])]
        return cls(home, args, stop_signal=signal.SIGTERM, start_timeout=START_TIMEOUT_S, progress=progress)

    def start(self, timeout: float | None = None) -> ServerProcess:
        """Launch and wait for /health; raises BenchError with the log's tail if it exits or never answers."""
        import httpx

        timeout = self.start_timeout if timeout is None else timeout
        self.home.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor for its whole life
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"agentfold serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2.0)
                if response.status_code == 200:
                    self.health_at_start = response.json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise BenchError(f"agentfold serve did not answer /health within {timeout:.0f}s: {self.log_tail()}")
            time.sleep(0.2)
        self.startup_seconds = round(time.perf_counter() - began, 3)
        self.say(f"server up on {self.url} in {self.startup_seconds:.1f}s ({self.health_at_start.get('exactness')})")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 8) -> str:
        """The log's last lines on one line (for an error message)."""
        text = self.log().strip().splitlines()
        return " | ".join(text[-lines:]) if text else "(no log)"

    def health(self) -> dict[str, Any]:
        """GET /health now."""
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def metrics(self) -> dict[str, float]:
        """GET /metrics now, parsed (`parse_metrics`)."""
        import httpx

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30.0).text)

    def memory(self) -> dict[str, int]:
        """The running server's peak and current resident memory (`proc_status`; empty once it exited)."""
        return proc_status(self.proc.pid) if self.proc and self.proc.poll() is None else {}

    def kill(self) -> None:
        """SIGKILL to the server's process group, as a crash would: no clean-up handlers run."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """`stop_signal` (a graceful shutdown), then SIGKILL if it lingers; returns the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode if self.proc is not None else None

    def telemetry(self, turn_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored telemetry rows of `turn_ids` (complete after `stop`, when the writer has flushed)."""
        from agentfold.serve.telemetry import TelemetryStore

        path = self.home / "telemetry.sqlite"
        if not path.is_file():
            return {}
        store = TelemetryStore(path)
        try:
            return {t: row for t in turn_ids if (row := store.get_turn(t)) is not None}
        finally:
            store.close()

    def cleanup(self) -> None:
        """Stop, and remove the temporary home if this server made one."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


class TokenClock:
    """A `transformers` streamer that timestamps each generated token (the first `put` is the prompt).

    `sync` runs before each timestamp (a CUDA synchronize, so the time is when the token exists,
    not when its kernel was queued).
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        for token in value.reshape(-1).tolist():
            self.times.append(now)
            self.tokens.append(int(token))

    def end(self) -> None:
        pass
