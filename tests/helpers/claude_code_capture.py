"""Record what Claude Code really sends, as the fixture tests/fixtures/claude_code/two_turns.json.

    npm install --prefix /tmp/cc @anthropic-ai/claude-code@VERSION
    .venv/bin/python -m tests.helpers.claude_code_capture /tmp/cc/node_modules/.bin/claude \\
        tests/fixtures/claude_code/two_turns.json

A capture server on loopback stores every request (headers and body) and answers as the Anthropic
API would (SSE when asked): a turn's first request gets a `Read` tool_use of hello.py, the request
carrying its tool_result gets text. Claude Code runs twice (`claude -p`, then `claude -p
--continue`) with HOME and the working directory fresh temp dirs and its non-essential traffic
off. The fixture keeps the bodies and the headers that matter, with the temp paths, the device id
and the kernel version scrubbed. Nothing in the test suite runs this: it needs the npm package.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

KEPT_HEADERS = ("user-agent", "x-claude-code-session-id", "anthropic-beta", "anthropic-version", "x-app",
                "content-type")
PROMPTS = ("What does hello.py do? Read it.", "Now say which argument it takes.")
HELLO_PY = 'def greet(name):\n    return f"Hello, {name}!"\n'


def _answer_blocks(body: dict[str, Any], read_path: str) -> tuple[list[dict[str, Any]], str]:
    """A Read tool_use while the last user message holds no tool_result, else a text answer."""
    last = next((m for m in reversed(body.get("messages") or []) if m.get("role") == "user"), {})
    content = last.get("content")
    answered = isinstance(content, list) and any(b.get("type") == "tool_result" for b in content if isinstance(b, dict))
    if not answered and any(t.get("name") == "Read" for t in body.get("tools") or []):
        return [{"type": "text", "text": "Let me read the file."},
                {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": "Read",
                 "input": {"file_path": read_path}}], "tool_use"
    return [{"type": "text", "text": "The file defines a function `greet` that returns a greeting."}], "end_turn"


def _sse(body: dict[str, Any], blocks: list[dict[str, Any]], stop: str) -> bytes:
    usage = {"input_tokens": 100, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"message": {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                                       "model": body.get("model", "claude"), "content": [], "stop_reason": None,
                                       "stop_sequence": None, "usage": usage}}), ("ping", {})]
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start, delta = {**block, "input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [("content_block_start", {"index": index, "content_block": start}),
                   ("content_block_delta", {"index": index, "delta": delta}),
                   ("content_block_stop", {"index": index})]
    events += [("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 20}}),
               ("message_stop", {})]
    return "".join(f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n" for name, data in events).encode()


def capture_server(records: list[dict[str, Any]], read_path: str) -> ThreadingHTTPServer:
    """A loopback server (port 0) that appends each request to `records` and answers it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, data: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            records.append({"method": "GET", "path": self.path, "headers": dict(self.headers.items()), "body": None})
            self._send(b'{"data": [], "has_more": false}', "application/json")

        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            body = json.loads(raw) if raw else {}
            records.append({"method": "POST", "path": self.path, "headers": dict(self.headers.items()), "body": body})
            if "count_tokens" in self.path:
                return self._send(b'{"input_tokens": 100}', "application/json")
            blocks, stop = _answer_blocks(body, read_path)
            if body.get("stream"):
                return self._send(_sse(body, blocks, stop), "text/event-stream")
            usage = {"input_tokens": 100, "output_tokens": 20}
            message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                       "model": body.get("model", "claude"), "content": blocks, "stop_reason": stop,
                       "stop_sequence": None, "usage": usage}
            return self._send(json.dumps(message).encode(), "application/json")

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def scrub(record: dict[str, Any], work: Path, home: Path) -> dict[str, Any]:
    """One request with the temp paths, device id and kernel version replaced, and only KEPT_HEADERS."""
    text = json.dumps(record, ensure_ascii=False)
    for path, stand_in in ((work, "/home/user/project"), (home, "/home/user")):
        text = text.replace(str(path), stand_in).replace(str(path).replace("/", "-"), stand_in.replace("/", "-"))
    text = re.sub(r"OS Version: Linux [^\\\s]+", "OS Version: Linux 6.8.0", text)
    record = json.loads(text)
    metadata = (record["body"] or {}).get("metadata") or {}
    if isinstance(metadata.get("user_id"), str) and metadata["user_id"].startswith("{"):
        user = json.loads(metadata["user_id"])
        user["device_id"] = "0" * len(user.get("device_id", ""))
        metadata["user_id"] = json.dumps(user, separators=(",", ":"))
    headers = {k: v for k, v in record["headers"].items() if k.lower() in KEPT_HEADERS}
    return {"method": record["method"], "path": record["path"], "headers": headers, "body": record["body"]}


def record_two_turns(claude: str) -> dict[str, Any]:
    """Run Claude Code for two turns against the capture server; the fixture's content."""
    root = Path(tempfile.mkdtemp(prefix="cc-capture-"))
    home, work = root / "home", root / "work"
    home.mkdir()
    work.mkdir()
    (work / "hello.py").write_text(HELLO_PY)
    records: list[dict[str, Any]] = []
    server = capture_server(records, str(work / "hello.py"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_address[1]}",
           "ANTHROPIC_API_KEY": "dummy", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "HOME": str(home)}
    version = subprocess.run([claude, "--version"], env=env, capture_output=True, text=True, check=True).stdout
    turns = []
    try:
        for number, prompt in enumerate(PROMPTS):
            seen = len(records)
            extra = ["--continue"] if number else []
            subprocess.run([claude, "-p", *extra, prompt], cwd=work, env=env, check=True, timeout=300,
                           capture_output=True)
            turns.append({"prompt": prompt, "requests": [scrub(r, work, home) for r in records[seen:]]})
    finally:
        server.shutdown()
    return {"claude_code_version": version.split()[0], "recorded": datetime.date.today().isoformat(), "turns": turns,
            "how": "tests/helpers/claude_code_capture.py: claude -p, then claude -p --continue, against a capture "
                   "server answering a Read tool_use of hello.py, then text; temp paths, device id and kernel "
                   "version scrubbed."}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.helpers.claude_code_capture PATH/TO/claude OUT.json")
    Path(sys.argv[2]).write_text(json.dumps(record_two_turns(sys.argv[1]), indent=1, ensure_ascii=False) + "\n")
