"""The real Claude Code and Codex CLIs doing real work on the real coding model, drafting on.

`agentfold serve` runs Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, the model `.ci/setup.sh` installs)
as a user would start it: default backend, suffix drafting on. Each client, configured by
`agentfold integrate CLIENT --scope user`, is asked for a number that is written only in a file of
its working folder, so it must call a tool (Claude Code's Read, Codex's shell), get the result
back and answer with the number. Then a second turn of the same conversation reuses >= 95% of its
prompt from the session cache. The server's telemetry shows the tool round trip: a turn that
ended in a tool call, then the request carrying its result, served from the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentfold.bench.harness import ServerProcess
from tests.helpers.live_assistants import PINNED, client_env, served_turns
from tests.integrations.test_assistants_live import binary_or_skip, codex_events

# A cold first turn prefills Claude Code's ~11.9K-token prompt (330 s on the 2-core AMD EPYC, 36 tok/s,
# the whole test 394 s; 143 s on a 2-core Xeon) and Codex's ~6.5K (the test 175 s; 61 s of prefill on
# the Xeon). Claude Code drops a stream that carries only pings for 10 min and sends the request
# again: `integrate` raises its limits, and the test checks that no request was abandoned (the
# server's `cancelled` count). Codex on this model needs the reply-opening
# JSON call held to the declared names (`engine.lazy_calls`) and the `agentfold` profile's MCP server off
# and developer instructions (`integrations/codex/profile.toml`).
#
# Opt-in (AGENTFOLD_LIVE_CODER=1), not in `.ci/run`: the 1.5B model finishes these round trips on some
# prompts and not others, and each CLI's prompt carries the date and the working folder. Both passed in
# several runs in one session (other temp folders); in the next, same date, binaries and kernels' bits,
# Claude Code's turn after the Read result was a Write of the file (refused) and Codex's a sentence
# about exec_command, the number in neither reply (README, "The real CLIs on the real coding model").
# On a 2-core Xeon (2026-12-05), this note and question: Claude Code finished 5 of 6 runs, Codex 4 of
# 6 (other temp folders each run; the 4 under pytest's own folders all passed, ~4 min for the two).
# Other wordings did no better (README): Claude Code's usual miss is a Write of what it just read,
# Codex's a refusal ("I'm sorry, but I can't assist with that." after reading "Do not share it"; without
# that line Codex finished 3 of 3 and Claude Code 0 of 3), a `justification` Codex rejects, or steps in
# a ```sh fence.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("AGENTFOLD_LIVE_CODER") != "1",
    reason="the coder model finishes the round trip on some days' prompts only: AGENTFOLD_LIVE_CODER=1 runs it")]
CLIENT_TIMEOUT_S = 1200
NUMBER = "48213"
NOTES = f"Project notes\n\nThe build cache key for this project is {NUMBER}.\nDo not share it outside the team.\n"
ASK = "Read notes.txt and tell me the build cache key written in it."
FOLLOW_UP = "Thanks. In one short sentence: which file did you read?"


def coder_server(model: Path, home: Path) -> ServerProcess:
    """`agentfold serve` on the coder model as a user starts it (drafting on, the default backend)."""
    return ServerProcess(home, ["--model", str(model)], start_timeout=900)


def run_client(command: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    assert done.returncode == 0, f"{command[1:3]} exited {done.returncode}: {done.stdout[-1500:]} {done.stderr[-800:]}"
    return done.stdout


def integrate(client: str, home: Path, url: str) -> None:
    subprocess.run([sys.executable, "-m", "agentfold.cli", "integrate", client, "--scope", "user", "--home",
                    str(home), "--base-url", url], check=True, capture_output=True, timeout=60)


def workspace(tmp_path: Path) -> tuple[Path, Path]:
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    (project / "notes.txt").write_text(NOTES)
    return home, project


def assert_round_trip_served_from_cache(turns: list[dict], session: str, api: str) -> None:
    """A tool call, then its result's request and the follow-up, each >= 95% from the session's cache."""
    mine = [t for t in turns if t["session_id"] == session and t["status"] == "ok"]
    assert all(t["api"] == api for t in mine), mine
    called = [i for i, t in enumerate(mine) if t["finish_reason"] == "tool_calls"]
    assert called, f"no turn ended in a tool call: {[(t['finish_reason'], t['completion_tokens']) for t in mine]}"
    for later in mine[called[0] + 1 :]:
        assert later["cached_tokens"] >= 0.95 * later["prompt_tokens"], later
    assert any(t["drafted"] > 0 for t in mine), "drafting never ran"


def test_claude_code_reads_the_file_and_answers(coder_gguf: Path, tmp_path: Path) -> None:
    claude = binary_or_skip("claude")
    home, project = workspace(tmp_path)
    env = client_env(home)
    with coder_server(coder_gguf, tmp_path / "server") as server:
        integrate("claude-code", home, server.url)
        first = json.loads(run_client([claude, "-p", "--output-format", "json", ASK], project, env))
        second = json.loads(run_client([claude, "-p", "--continue", "--output-format", "json", FOLLOW_UP], project,
                                       env))
        assert server.health()["turns"]["cancelled"] == 0, server.health()  # no request given up on and re-sent
    assert first["is_error"] is False and NUMBER in first["result"], first
    assert second["is_error"] is False and second["session_id"] == first["session_id"], second
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"claude-cli/{PINNED['claude']}") for t in turns), turns
    assert_round_trip_served_from_cache(turns, first["session_id"], "messages")


def test_codex_reads_the_file_and_answers(coder_gguf: Path, tmp_path: Path) -> None:
    codex = binary_or_skip("codex")
    home, project = workspace(tmp_path)
    env = client_env(home)
    exec_args = [codex, "exec", "--strict-config", "--profile", "agentfold", "-c", "analytics.enabled=false", "--json",
                 "--skip-git-repo-check"]
    with coder_server(coder_gguf, tmp_path / "server") as server:
        integrate("codex", home, server.url)
        first = codex_events(run_client([*exec_args, ASK], project, env))
        second = codex_events(run_client([*exec_args, "resume", "--last", FOLLOW_UP], project, env))
        assert server.health()["turns"]["cancelled"] == 0, server.health()
    assert NUMBER in first["reply"].get("text", ""), first
    assert "turn.completed" in second and second["reply"].get("text"), second
    thread = first["thread.started"]["thread_id"]
    assert second["thread.started"]["thread_id"] == thread
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"codex_exec/{PINNED['codex']}") for t in turns), turns
    assert_round_trip_served_from_cache(turns, thread, "responses")
