"""The real Claude Code and Codex CLIs doing real work on the real coding model, drafting on.

`agentfold serve` runs Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, the model `.ci/setup.sh` installs)
as a user would start it: default backend, suffix drafting on. Each client, configured by
`agentfold integrate CLIENT --scope user`, is asked for a number that is written only in a file of
its working folder, so it must call a tool (Claude Code's Read, Codex's shell), get the result
back and answer with the number. Then a second turn of the same conversation reuses >= 95% of its
prompt from the session cache. The server's telemetry shows the tool round trip: a turn that
ended in a tool call, then the request carrying its result, served from the cache. Later new
conversations in the same folder (one before a restart of the server, one after) restore the prompt
head the first one left (the system prompt and tools), and four Claude Code sessions started at once
prefill that head once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agentfold.bench.harness import ServerProcess
from tests.helpers.live_assistants import PINNED, client_env, served_turns
from tests.integrations.test_assistants_live import binary_or_skip, codex_events

# A cold first turn prefills Claude Code's ~11.9K-token prompt (330 s on the 2-core AMD EPYC, 36 tok/s,
# the whole test 394 s; 143 s on a 2-core Xeon) and Codex's ~6.2K (61 s on the Xeon). Claude Code
# drops a stream that carries only pings for 10 min and sends the request again: `integrate` raises
# its limits, and the test checks that no request was abandoned (the server's `cancelled` count).
# Codex on this model needs the reply-opening JSON call held to the declared names
# (`engine.lazy_calls`) and the `agentfold` profile's MCP server off and developer instructions
# (`integrations/codex/profile.toml`).
#
# Each client's prompt carries its working folder and HOME (Claude Code's memory path is near the
# top of its system prompt), the date and the OS version, and the 1.5B model's choice after the tool
# result turns on such details: with pytest's numbered temp folders, Claude Code finished 5 of 6 runs
# and Codex 4 of 6 (2026-12-05). So the clients work in fixed folders (`LIVE_ROOT`), leaving the date
# (and the machine's OS version) as what varies from run to run, and the note is the one the model
# handled on every date tried: decoding the captured requests of these CLIs in-process with the
# date, note and question edited (docs/assistants.md, the sweep), the note
# `build_cache_key = 48213` with this question got a call on notes.txt and then the number on 8 of 8
# dates spread over 2027 and on each of the 16 days from 2026-12-05, for both clients; the earlier
# note with "Do not share it outside the team." drew Codex's "I'm sorry, but I can't assist with
# that." on 3 of 8 dates, and Claude Code wrote `Write` calls with a plain sentence.
pytestmark = pytest.mark.slow
CLIENT_TIMEOUT_S = 1200
LIVE_ROOT = Path("/tmp/agentfold-live-coder")  # fixed: each CLI's prompt carries its folder and HOME
NUMBER = "48213"
NOTES = f"build_cache_key = {NUMBER}\n"
ASK = "Read notes.txt and tell me the build cache key written in it."
FOLLOW_UP = "Thanks. In one short sentence: which file did you read?"
# Other new conversations in the same folder: the same system prompt and tools (the shared head),
# another question. What the model answers is not checked here, only what the server restored.
OTHER_ASKS = ("Which files are in this folder?", "What is written in notes.txt?")
CLIENTS_AT_ONCE = 4
OTHER_ASK_TIMEOUT_S = 300


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


def workspace(client: str) -> tuple[Path, Path]:
    """The client's HOME and project folder at their fixed place, made afresh (a run's files stay
    there for reading until the next run)."""
    root = LIVE_ROOT / client
    shutil.rmtree(root, ignore_errors=True)
    home, project = root / "home", root / "project"
    home.mkdir(parents=True)
    project.mkdir()
    (project / "notes.txt").write_text(NOTES)
    return home, project


def run_any(command: list[str | Path], cwd: Path, env: dict[str, str]) -> None:
    """A client run whose answer is not the point (a new conversation, measured for its cache): it
    may end as it likes, and is stopped after OTHER_ASK_TIMEOUT_S should the model keep calling tools."""
    try:
        subprocess.run([str(part) for part in command], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=OTHER_ASK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass


def opening_turns(turns: list[dict], head_at_least: int) -> list[dict]:
    """Each conversation's first turn that carries the client's whole system prompt and tools
    (not a side request such as a title), oldest first."""
    firsts: dict[str, dict] = {}
    for turn in turns:
        if turn["status"] == "ok" and turn["prompt_tokens"] > head_at_least:
            firsts.setdefault(turn["session_id"], turn)
    return sorted(firsts.values(), key=lambda t: t["started_at"])


def assert_new_conversations_restore_the_head(server_home: Path, first_session: str) -> list[dict]:
    """The first conversation prefilled its head; every later new one restored it."""
    openings = opening_turns(served_turns(server_home), 2000)
    first = next(t for t in openings if t["session_id"] == first_session)
    assert first["head_tokens"] == 0 and first["cached_tokens"] == 0, first
    later = [t for t in openings if t["session_id"] != first_session]
    assert later, "no new conversation was served"
    for turn in later:
        assert turn["head_tokens"] > 2000 and turn["cached_tokens"] >= turn["head_tokens"], turn
    return later


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
    """The tool round trip; then a second new conversation in the same folder and a third after a
    restart of the server, each restoring the ~9.3K-token head (system prompt and tools) the first
    left, so they prefill only their own ~2.5K tokens."""
    claude = binary_or_skip("claude")
    home, project = workspace("claude")
    env = client_env(home)
    print_json = [claude, "-p", "--output-format", "json"]
    with coder_server(coder_gguf, tmp_path / "server") as server:
        integrate("claude-code", home, server.url)
        first = json.loads(run_client([claude, "-p", "--output-format", "json", ASK], project, env))
        second = json.loads(run_client([claude, "-p", "--continue", "--output-format", "json", FOLLOW_UP], project,
                                       env))
        assert server.health()["turns"]["cancelled"] == 0, server.health()  # no request given up on and re-sent
        run_any([*print_json, OTHER_ASKS[0]], project, env)
    with coder_server(coder_gguf, tmp_path / "server") as restarted:  # the same home, another port
        integrate("claude-code", home, restarted.url)
        run_any([*print_json, OTHER_ASKS[1]], project, env)
    assert first["is_error"] is False and NUMBER in first["result"], first
    assert second["is_error"] is False and second["session_id"] == first["session_id"], second
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"claude-cli/{PINNED['claude']}") for t in turns), turns
    assert_round_trip_served_from_cache(turns, first["session_id"], "messages")
    later = assert_new_conversations_restore_the_head(restarted.home, first["session_id"])
    assert len(later) >= 2, later  # one before the restart, one after
    print("claude new conversations:", [(t["prompt_tokens"], t["head_tokens"], round(t["ttft_ms"])) for t in later])


def test_claude_code_sessions_started_at_once_prefill_the_head_once(coder_gguf: Path, tmp_path: Path) -> None:
    """Four `claude -p` started together in one folder: one prefills the head, the other three wait
    for its snapshot and restore it; all four finish the task."""
    claude = binary_or_skip("claude")
    home, project = workspace("claude")
    env = client_env(home)
    with coder_server(coder_gguf, tmp_path / "server") as server:
        integrate("claude-code", home, server.url)
        command = [str(part) for part in (claude, "-p", "--output-format", "json", ASK)]
        runs = [subprocess.Popen(command, cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(CLIENTS_AT_ONCE)]
        outputs = [run.communicate(timeout=CLIENT_TIMEOUT_S) for run in runs]
        assert server.health()["turns"]["cancelled"] == 0, server.health()
    results = [json.loads(out) for out, _ in outputs]
    assert all(r["is_error"] is False and r["result"] for r in results), results  # all four finished
    # What each answers is the model's: one of four runs once got a prompt 138 tokens shorter than
    # the others from Claude Code (same head) and read the file another way, answering without the number.
    print("claude at once, answers with the number:", sum(NUMBER in r["result"] for r in results))
    openings = opening_turns(served_turns(server.home), 2000)
    assert len(openings) == CLIENTS_AT_ONCE, openings
    prefilled = [t for t in openings if t["head_tokens"] == 0]
    assert len(prefilled) == 1 and prefilled[0]["cached_tokens"] == 0, openings  # the head, prefilled once
    print("claude at once:", [(t["prompt_tokens"], t["head_tokens"], round(t["ttft_ms"])) for t in openings])


def test_codex_reads_the_file_and_answers(coder_gguf: Path, tmp_path: Path) -> None:
    codex = binary_or_skip("codex")
    home, project = workspace("codex")
    env = client_env(home)
    exec_args = [codex, "exec", "--strict-config", "--profile", "agentfold", "-c", "analytics.enabled=false", "--json",
                 "--skip-git-repo-check"]
    with coder_server(coder_gguf, tmp_path / "server") as server:
        integrate("codex", home, server.url)
        first = codex_events(run_client([*exec_args, ASK], project, env))
        second = codex_events(run_client([*exec_args, "resume", "--last", FOLLOW_UP], project, env))
        assert server.health()["turns"]["cancelled"] == 0, server.health()
        run_any([*exec_args, OTHER_ASKS[0]], project, env)
    with coder_server(coder_gguf, tmp_path / "server") as restarted:  # the same home, another port
        integrate("codex", home, restarted.url)
        run_any([*exec_args, OTHER_ASKS[1]], project, env)
    assert NUMBER in first["reply"].get("text", ""), first
    assert "turn.completed" in second and second["reply"].get("text"), second
    thread = first["thread.started"]["thread_id"]
    assert second["thread.started"]["thread_id"] == thread
    turns = served_turns(server.home)
    assert all(t["client"].startswith(f"codex_exec/{PINNED['codex']}") for t in turns), turns
    assert_round_trip_served_from_cache(turns, thread, "responses")
    later = assert_new_conversations_restore_the_head(restarted.home, thread)
    assert len(later) >= 2, later
    print("codex new conversations:", [(t["prompt_tokens"], t["head_tokens"], round(t["ttft_ms"])) for t in later])
