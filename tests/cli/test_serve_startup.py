"""`agentfold serve` as a real process: /health says "loading" (503) before it says "ok", the port and
the context come from AGENTFOLD_* variables, and the served context is what requests are sized against.

The model is a tiny random Llama folder (tests.helpers.torch_tiny), so the whole run takes seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from agentfold.bench.harness import free_port
from agentfold.cli import main
from tests.helpers.torch_tiny import write_folder

ROOT = Path(__file__).resolve().parents[2]


def start_serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """`agentfold serve` in its own process group, its output in tmp_path/serve.log."""
    command = [sys.executable, "-m", "agentfold.cli", "serve", "--home", str(tmp_path / "home"),
               "--log-level", "warning", *args]
    log = tmp_path / "serve.log"
    environ = {**os.environ, "AGENTFOLD_MODELS": str(tmp_path / "models"), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environ, cwd=ROOT,
                                start_new_session=True)
    return proc, log


def poll_health(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> list[tuple[int, dict]]:
    """Every distinct /health answer until the first 200 (connection refusals are skipped)."""
    answers: list[tuple[int, dict]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            response = httpx.get(url + "/health", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.02)
            continue
        if not answers or answers[-1][0] != response.status_code:
            answers.append((response.status_code, response.json()))
        if response.status_code == 200:
            return answers
        time.sleep(0.02)
    raise AssertionError(f"no 200 from /health (exit {proc.poll()}): {answers}")


@pytest.mark.slow  # a real server process: ~10 s alone, 30+ s on a busy machine
def test_health_loading_then_ok_with_env_port_and_ctx_size(tmp_path):
    folder = write_folder(tmp_path / "tiny-llama", "llama", seed=3)
    port = free_port()
    proc, log = start_serve(tmp_path, "--model", str(folder), "--backend", "torch", "--device", "cpu", "--no-draft",
                            env={"AGENTFOLD_PORT": str(port), "AGENTFOLD_CTX_SIZE": "64"})
    url = f"http://127.0.0.1:{port}"
    try:
        answers = poll_health(url, proc)
        statuses = [status for status, _ in answers]
        assert statuses[0] == 503 and statuses[-1] == 200, (answers, log.read_text()[-2000:])
        assert answers[0][1]["status"] == "loading" and answers[-1][1]["context_length"] == 64
        listing = httpx.get(url + "/v1/models").json()
        assert listing["data"][0]["context_length"] == 64 and len(listing["data"]) == 1
        too_long = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "def add(a, b): " * 40,
                                                            "max_tokens": 4}, timeout=60)
        assert too_long.status_code == 400, too_long.text
        assert too_long.json()["error"]["code"] == "context_length_exceeded"
        fits = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 2},
                          timeout=60)
        assert fits.status_code == 200, fits.text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        status = proc.wait(60)
    text = log.read_text()
    assert status == 128 + signal.SIGTERM, text[-2000:]
    assert "stopping: writing pending session snapshots" in text


@pytest.mark.slow  # loads SmolLM2 in a server process, then prefills a long prompt
def test_ctrl_c_during_a_long_prefill_ends_it_promptly_and_says_so(tmp_path):
    port = free_port()
    proc, log = start_serve(tmp_path, "--model", "smollm2", "--port", str(port), "--backend", "torch", "--no-draft")
    url = f"http://127.0.0.1:{port}"
    replies: list[httpx.Response] = []
    try:
        poll_health(url, proc, timeout=300)
        long_prompt = {"model": "smollm2", "messages": [{"role": "user", "content": "word " * 7000}], "max_tokens": 100}
        asker = threading.Thread(target=lambda: replies.append(
            httpx.post(url + "/v1/chat/completions", json=long_prompt, timeout=300)))
        asker.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").json()["active"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # well inside the prefill (thousands of tokens on a CPU)
        assert httpx.get(url + "/health").json()["active"] == 1, "the long turn finished before the interrupt"
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        status = proc.wait(60)
        stopped_in = time.monotonic() - began
        asker.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert status == 130 and stopped_in < 8, (status, stopped_in, text[-2000:])
    assert "stopping: ending 1 running and 0 queued turns" in text, text[-2000:]
    assert replies and replies[0].status_code == 503 and "shutting down" in replies[0].json()["error"]["message"]


@pytest.mark.parametrize("env, message", [
    ({"AGENTFOLD_PORT": "eighty"}, "AGENTFOLD_PORT='eighty'"),
    ({"AGENTFOLD_CTX_SIZE": "-5"}, "--ctx-size must be >= 16"),
    ({"AGENTFOLD_NO_DRAFT": "maybe"}, "AGENTFOLD_NO_DRAFT='maybe'"),
    ({"AGENTFOLD_BACKEND": "tpu"}, "--backend must be one of auto, mlx, torch"),
])
def test_bad_environment_value_is_one_line_exit_2(env, message, monkeypatch, capsys, tmp_path):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--home", str(tmp_path), "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_command_line_wins_over_environment(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("AGENTFOLD_PORT", "eighty")  # bad, but overridden: never reported
    monkeypatch.setenv("AGENTFOLD_MAX_ACTIVE", "0")
    port = str(free_port())
    assert main(["serve", "--port", port, "--max-active", "2", "--ctx-size", "99999", "--home", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # got past the port and --max-active: the ctx-size check refused
    assert "--ctx-size 99999 is larger than SmolLM2-135M-Instruct.Q4_1's trained context of 8192" in err, err
    monkeypatch.setenv("AGENTFOLD_MAX_ACTIVE", "0")
    assert main(["serve", "--port", port, "--home", str(tmp_path)]) == 2
    assert "--max-active must be >= 1, not 0" in capsys.readouterr().err


def test_help_names_the_environment_variables(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "AGENTFOLD_CTX_SIZE" in " ".join(capsys.readouterr().out.split())
