"""The real Claude Code and Codex CLIs, two turns each, against a live `agentfold serve` subprocess.

Each test starts `python -m agentfold.cli serve` on a free loopback port with a 32K-context model
(`tests/helpers/live_assistants.py`), writes the client's config with `agentfold integrate CLIENT
--scope user` into a temp HOME, runs turn 1 and then turn 2 of the same conversation (`claude -p`
then `claude -p --continue`; `codex exec --profile agentfold` then `codex exec ... resume --last`),
and reads the server's telemetry SQLite: both turns under the client's own session id, the second
reusing >= 95% of its prompt from the cache. The tool round trip is not asserted here: a random
model calls no tools, and the server's handling of Claude Code's and Codex's recorded
tool_use/tool_result and function_call/function_call_output requests is what
tests/http/test_claude_code_replay.py and test_codex_replay.py check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.live_assistants import (
    PINNED,
    REPLY_WORD,
    assistant_binary,
    client_env,
    ending_tiny_model,
    live_server,
    served_turns,
)

pytestmark = pytest.mark.slow
CLIENT_TIMEOUT_S = 120
HELLO = "hello from the file\n"


@pytest.fixture(scope="module")
def model(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ending_tiny_model(tmp_path_factory.mktemp("tiny-ending") / "model", smollm2_folder)


def binary_or_skip(name: str) -> Path:
    """The pinned npm executable, or a skip saying how to install it."""
    path = assistant_binary(name)
    if path is None:
        pytest.skip(f"{name} is not installed: run .ci/setup.sh (npm) or set AGENTFOLD_NPM_BIN")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    assert PINNED[name] in version, f"{name} {version.strip()} is not the pinned {PINNED[name]}"
    return path


def run_client(command: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    """Run one assistant turn; its stdout. A non-zero exit fails with the output's tail."""
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    assert done.returncode == 0, f"{command[1:3]} exited {done.returncode}: {done.stdout[-800:]} {done.stderr[-800:]}"
    return done.stdout


def integrate(client: str, home: Path, url: str) -> None:
    """`agentfold integrate CLIENT --scope user` into `home`, as a user would run it."""
    subprocess.run([sys.executable, "-m", "agentfold.cli", "integrate", client, "--scope", "user", "--home",
                    str(home), "--base-url", url, "--model", "tiny"], check=True, capture_output=True, timeout=60)


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    (project / "hello.txt").write_text(HELLO)
    return home, project


def assert_second_turn_cached(turns: list[dict], session: str, api: str) -> None:
    """Exactly the two turns, both under `session`, the second's prompt >= 95% from the cache."""
    assert [(t["session_id"], t["api"], t["status"]) for t in turns] == [(session, api, "ok")] * 2, turns
    first, second = turns
    assert first["prompt_tokens"] > 6000 and first["cached_tokens"] == 0  # the assistant's real prompt, cold
    assert second["prompt_tokens"] > first["prompt_tokens"]
    assert second["cached_tokens"] >= 0.95 * second["prompt_tokens"], second


def test_claude_code_two_turns_on_a_live_server(model: Path, tmp_path: Path) -> None:
    claude = binary_or_skip("claude")
    home, project = workspace(tmp_path)
    env = client_env(home)
    with live_server(model, tmp_path / "server") as server:
        integrate("claude-code", home, server.url)
        first = json.loads(run_client([claude, "-p", "--output-format", "json", "Read hello.txt."], project, env))
        second = json.loads(run_client([claude, "-p", "--continue", "--output-format", "json",
                                        "What does it say?"], project, env))
    for answer in (first, second):
        assert answer["is_error"] is False and answer["result"] == REPLY_WORD, answer
    assert second["session_id"] == first["session_id"]
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"claude-cli/{PINNED['claude']}") for t in turns), turns
    assert_second_turn_cached(turns, first["session_id"], "messages")


def codex_events(stdout: str) -> dict[str, dict]:
    """`codex exec --json` output: the last event of each type, and the agent's message as "reply"."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    by_type = {event["type"]: event for event in events}
    messages = [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
    return {**by_type, "reply": messages[-1] if messages else {}}


def test_codex_two_turns_on_a_live_server(model: Path, tmp_path: Path) -> None:
    codex = binary_or_skip("codex")
    home, project = workspace(tmp_path)
    env = client_env(home)
    exec_args = [codex, "exec", "--strict-config", "--profile", "agentfold", "-c", "analytics.enabled=false", "--json",
                 "--skip-git-repo-check"]
    with live_server(model, tmp_path / "server") as server:
        integrate("codex", home, server.url)
        first = codex_events(run_client([*exec_args, "Read hello.txt."], project, env))
        second = codex_events(run_client([*exec_args, "resume", "--last", "What does it say?"], project, env))
    for events in (first, second):
        assert events["reply"].get("text") == REPLY_WORD and "turn.completed" in events, events
    thread = first["thread.started"]["thread_id"]
    assert second["thread.started"]["thread_id"] == thread
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"codex_exec/{PINNED['codex']}") for t in turns), turns
    assert_second_turn_cached(turns, thread, "responses")
