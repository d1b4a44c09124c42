"""A real `agentfold serve` process and a real OpenAI client, as the bench suite measures them.

The suite measures what an agent feels: the server runs as its own process on a free loopback
port with a home of its own (so snapshots start empty), and requests go through the official
`openai` client, streamed. Times are taken on the client when chunks arrive; the server's own
figures come back on the last chunk (`timings`, `agentfold`), in `/metrics` and in the telemetry
SQLite of its home, which is read after the server has stopped (and flushed it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from agentfold.bench.harness import free_port

START_TIMEOUT_S = 600  # loading and self-checking a model on a busy 2-core machine
REQUEST_TIMEOUT_S = 3600  # a 16K-token prefill on two cores takes minutes


class BenchError(RuntimeError):
    """A bench step failed; the message says which and why."""


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
    """`python -m agentfold.cli serve` on a free port with its own home; a context manager."""

    def __init__(self, model: str | Path | None, home: Path | None = None, dtype: str = "float32",
                 extra: Sequence[str] = (), progress: Callable[[str], None] | None = None) -> None:
        self.model = model
        self._tmp = None if home else tempfile.TemporaryDirectory(prefix="agentfold-bench-")
        self.home = Path(home) if home else Path(self._tmp.name) / "home"
        self.dtype = dtype
        self.extra = list(extra)
        self.say = progress or (lambda message: None)
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.home.parent / f"serve-{id(self)}.log"
        self.startup_seconds: float | None = None
        self.health: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        self.port = free_port()
        self.home.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "agentfold.cli", "serve", "--port", str(self.port), "--home", str(self.home),
                   "--dtype", self.dtype, "--log-level", "warning", "--max-active", "1", *self.extra]
        if self.model:
            command += ["--model", str(self.model)]
        began = time.perf_counter()
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes it for its whole life
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"agentfold serve exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                response = httpx.get(self.url + "/health", timeout=2.0)
                if response.status_code == 200:
                    self.health = response.json()
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"agentfold serve did not answer /health within {timeout:.0f}s: {self.log_tail()}")
            time.sleep(0.25)
        self.startup_seconds = round(time.perf_counter() - began, 3)
        self.say(f"server up on {self.url} in {self.startup_seconds:.1f}s ({self.health.get('exactness')})")
        return self

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])

    def memory(self) -> dict[str, int]:
        return proc_status(self.proc.pid) if self.proc and self.proc.poll() is None else {}

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30.0).text)

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts down gracefully and the telemetry store flushes), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def telemetry(self, turn_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored telemetry rows of `turn_ids` (read after `stop`, when the writer has flushed)."""
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
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client_for(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def stream_chat(client: Any, messages: list[dict[str, Any]], max_tokens: int, *, draft: bool, session_id: str,
                tools: list[dict[str, Any]] | None = None, tool_choice: Any = None, seed: int = 0) -> dict[str, Any]:
    """One streamed chat completion; client-side arrival times plus the server's last-chunk telemetry.

    `ttft_s` is the time from the call to the first chunk that carries text or a tool call (the first
    chunk, with the role only, comes before the prefill). Chunk gaps are what a client sees between
    content arrivals; the server streams each verify pass's text as it settles, and a tool call as
    one piece when its JSON is complete, so tool calls show no gaps on this side.
    """
    kwargs: dict[str, Any] = {}
    if tools:
        kwargs["tools"] = tools
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, seed=seed,
        extra_body={"draft": draft, "session_id": session_id}, **kwargs)
    arrivals: list[float] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, timings, block, usage = None, None, None, None
    for chunk in stream:
        now = time.perf_counter() - began
        extra = chunk.model_extra or {}
        timings = extra.get("timings") or timings
        block = extra.get("agentfold") or block
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            got = False
            if delta.content:
                content.append(delta.content)
                got = True
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                got = True
            if got:
                arrivals.append(now)
            if choice.finish_reason:
                finish = choice.finish_reason
    total = time.perf_counter() - began
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "ttft_s": round(arrivals[0], 4) if arrivals else None,
        "total_s": round(total, 4),
        "chunks": len(arrivals),
        "chunk_gaps_ms": [round(g, 3) for g in gaps],
        "timings": timings,
        "agentfold": block,
        "usage": usage,
    }


def assistant_message(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply as the assistant message an agent appends to its history."""
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
    if reply["tool_calls"]:
        message["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(reply["tool_calls"])]
    return message


def dump_reply(reply: dict[str, Any]) -> str:
    """A stable text of a reply (content and tool calls) for comparing two replies."""
    return json.dumps({"content": reply["content"], "calls": [(c["name"], c["arguments"]) for c in reply["tool_calls"]]})


__all__ = ["BenchError", "ServerProcess", "assistant_message", "client_for", "dump_reply", "free_port",
           "parse_metrics", "proc_status", "stream_chat"]

