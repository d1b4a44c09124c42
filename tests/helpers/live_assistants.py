"""The real Claude Code and Codex CLIs (npm, pinned in .ci/setup.sh) against a live `agentfold serve`.

`.ci/setup.sh` installs both into `.venv/npm` (AGENTFOLD_NPM_BIN names another `.bin` folder); the
tests skip when they are absent. The served model is a one-layer random llama with SmolLM2's
tokenizer and chat template and a 32K context (`tests/helpers/long_context.py`), big enough for
the assistants' 12-13K-token first prompts. A random model decoding greedily rarely emits its end
token, and both assistants treat a reply cut at max_tokens as an error (Claude Code retries it),
so `ending_tiny_model` tilts two rows of its output head: after the generation prompt's final
newline the greedy choice is one word, after that word the end token. The server still renders,
tokenizes, caches, prefills and decodes every request for real; only the weights are chosen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from agentfold.bench.harness import ServerProcess
from agentfold.serve.telemetry import TelemetryStore
from tests.helpers.long_context import tiny_smollm2_folder

REPO = Path(__file__).resolve().parents[2]
PINNED = {"claude": "2.1.332", "codex": "0.171.0"}  # as .ci/setup.sh installs them
REPLY_WORD = "ok"
# What the assistants would otherwise send to the network or write outside the temp HOME.
QUIET_ENV = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
             "DISABLE_ERROR_REPORTING": "1", "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
             "NO_UPDATE_NOTIFIER": "1", "CI": "1", "TERM": "dumb", "NO_COLOR": "1"}
# Inherited variables that would point a client somewhere other than the config integrate wrote.
DROPPED_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_", "AGENTFOLD_")


def assistant_binary(name: str) -> Path | None:
    """The npm-installed `claude` / `codex` executable, or None when it is not installed."""
    folder = Path(os.environ.get("AGENTFOLD_NPM_BIN") or REPO / ".venv" / "npm" / "node_modules" / ".bin")
    path = folder / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """The assistant's environment: HOME a temp dir, non-essential traffic off, no inherited API keys."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(DROPPED_PREFIXES)}
    return {**kept, **QUIET_ENV, "HOME": str(home), **extra}


def ending_tiny_model(path: Path, smollm2_folder: Path) -> Path:
    """The one-layer 32K random SmolLM2-tokenizer model, its head tilted so a greedy reply is `REPLY_WORD`.

    The residual stream after one small random layer stays close to the last token's embedding, so
    an output row along the (final-normed) embedding of token A makes token B the argmax after A.
    """
    folder = tiny_smollm2_folder(path, smollm2_folder, layers=1)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    newline, word = (tokenizer.encode(text).ids[-1] for text in ("\n", REPLY_WORD))
    ends = json.loads((folder / "config.json").read_text())["eos_token_id"]
    end = int(ends[0] if isinstance(ends, list) else ends)  # the first: the chat template's end of turn
    weights = load_file(str(folder / "model.safetensors"))
    embed, norm = weights["model.embed_tokens.weight"], weights["model.norm.weight"]

    def along(token: int) -> torch.Tensor:
        direction = embed[token] * norm
        return direction / direction.norm() * 8.0  # logit ~8 x |hidden| (~sqrt(64)): far above the rest

    weights["lm_head.weight"][word] = along(newline)
    weights["lm_head.weight"][end] = along(word)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


def live_server(model: Path, home: Path) -> ServerProcess:
    """`agentfold serve` on the torch backend, `model` under the short name `tiny`, sessions under `home`."""
    return ServerProcess(home, ["--model", str(model), "--backend", "torch", "--drafter", "none", "--alias", "tiny"],
                         start_timeout=120)


def served_turns(server_home: Path) -> list[dict[str, Any]]:
    """Every turn the (stopped) server recorded in its telemetry, oldest first."""
    store = TelemetryStore(server_home / "telemetry.sqlite")
    try:
        return list(reversed(store.list_turns(limit=1000)))
    finally:
        store.close()
